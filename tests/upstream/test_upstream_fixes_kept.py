# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""What the release does in and around the definitions the branch replaces,
kept by the fork: each probe (upstream_fixes.py) runs in the installed fork
and in the unmodified release, and the two reports must match.

In 0.34.0: ``make_nvfp4_moe_quant_config`` refills the layer's activation
global scales in place (the "refill probe"), the ModelOpt method hands the
experts to ``keep_constants``, the compressed-tensors method aliases the
packed weights with ``move_parameter``, the kernel is built through
``NvFp4MoEKernelOracle`` / ``make_moe_kernel``, and the CuteDSL preparation
shards per die. In 0.33.0 the same probes report that release's behaviour
(new gscales, no ``keep_constants``, ...), which the fork must equally keep.
"""

from __future__ import annotations

import upstream_fixes

from upstream_env import UPSTREAM_VERSION

_SNIPPET = "import upstream_fixes\nresult = upstream_fixes.{probe}()\n"


def _both(unmodified_upstream, probe: str) -> tuple[dict, dict]:
    fork = getattr(upstream_fixes, probe)()
    upstream = unmodified_upstream(_SNIPPET.format(probe=probe))
    return fork, upstream


def test_quant_config_refills_activation_gscales_as_the_release_does(
    unmodified_upstream, upstream_measurements
):
    fork, upstream = _both(unmodified_upstream, "refill_probe")
    upstream_measurements(f"refill probe, unmodified {UPSTREAM_VERSION}", upstream)
    upstream_measurements("refill probe, fork", fork)
    if UPSTREAM_VERSION != "0.33.0":
        # The release's own fix: same storage, and the first config sees b.
        for backend in ("FLASHINFER_B12X", "FLASHINFER_CUTLASS"):
            for name in ("a1_gscale", "a2_gscale"):
                want = upstream[backend][name]
                assert want["same_storage"] and want["first_sees_new"], (backend, name)
    assert fork == upstream


def test_modelopt_keep_constants_as_the_release_does(unmodified_upstream):
    fork, upstream = _both(unmodified_upstream, "keep_constants_probe")
    assert fork["experts"] == upstream["experts"] == "FlashInferB12xExperts"
    assert fork["has_keep_constants"] == upstream["has_keep_constants"]
    if upstream["has_keep_constants"]:
        assert [c["is_the_layer"] for c in upstream["calls"]] == [True]
        # The fork's preparation hands its experts over the same way, once.
        assert [c["is_the_layer"] for c in fork["calls"]] == [True]
        assert [c["experts"] for c in fork["calls"]] == ["FlashInferB12xExperts"]
        # Whatever the experts keep is on the layer, under keep_constants' names.
        kept = fork["calls"][0]["kept_constants"]
        assert fork["kept_on_layer"] == sorted(
            "_experts_" + n.lstrip("_") for n in kept
        )
    else:
        assert fork["calls"] == upstream["calls"] == []


def test_compressed_tensors_aliases_packed_weights_as_the_release_does(
    unmodified_upstream,
):
    fork, upstream = _both(unmodified_upstream, "compressed_tensors_alias_probe")
    if UPSTREAM_VERSION != "0.33.0":
        assert ["w13_weight", "w13_weight_packed"] in upstream["aliases"]
        assert upstream["packed_names_resolve"] == {
            "w13_weight_packed": True,
            "w2_weight_packed": True,
        }
    assert fork == upstream


def test_kernel_built_through_the_releases_oracle(unmodified_upstream):
    fork, upstream = _both(unmodified_upstream, "kernel_assembly_probe")
    if UPSTREAM_VERSION != "0.33.0":
        assert upstream["ran"]["make_moe_kernel"] == 1
        assert upstream["ran"]["NvFp4MoEKernelOracle.return_or_raise"] == 1
    assert fork == upstream
    assert fork["experts"] == "FlashInferB12xExperts"
    assert fork["backend"] == "FLASHINFER_B12X"


def test_cutedsl_preparation_and_per_die_shards_as_the_release(unmodified_upstream):
    fork, upstream = _both(unmodified_upstream, "cutedsl_probe")
    if UPSTREAM_VERSION != "0.33.0":
        assert upstream["localized"] and upstream["num_shards"] == 2
        assert len(upstream["shards"]) == 8  # 4 tensors per die
    assert fork == upstream


_PLANTED = """\
import upstream_fixes
result = {}
for mutant, probe in upstream_fixes.MUTANTS.items():
    plain = getattr(upstream_fixes, probe)()
    with upstream_fixes.planted(mutant):
        result[mutant] = getattr(upstream_fixes, probe)() != plain
"""


def test_probes_see_planted_changes(unmodified_upstream):
    """The comparisons can fail: the unmodified release with a change planted
    in the function a probe watches (upstream_fixes.planted: activation
    scales doubled; new gscales where the release refills them; CuteDSL
    block-scale rows reversed) reports otherwise than without it."""
    changed = unmodified_upstream(_PLANTED)
    want = dict.fromkeys(upstream_fixes.MUTANTS, True)
    if UPSTREAM_VERSION == "0.33.0":
        want["no_refill"] = False  # 0.33.0 allocates new gscales itself
    assert changed == want
