# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The branch's definitions keep vLLM 0.33.0's interfaces, in the installed
fork and against unmodified 0.33.0's source (interface_check.py says how).

1. Every definition the branch ships in a file upstream has (spliced, the
   replaced b12x experts file, the stand-ins) has upstream's signature and
   class shape: zero differences.
2. Every name upstream's own modules take from those files is in the fork.
3. Every name the shipped code takes from upstream's modules is in the fork,
   and each call of one binds to the fork's signature.
4. The slice's other names at upstream's paths (harness only), beside
   0.33.0's: the design page's table is what this run computes.
"""

from collections.abc import Callable

import pytest

from interface_check import (
    DOCS_PAGE,
    TABLE_BEGIN,
    TABLE_END,
    TABLE_ENV,
    Interfaces,
    docs_table,
    table_path,
)
from upstream_env import UPSTREAM_VERSION, unmodified_tree_problem

# The b12x experts' interface as upstream's subclasses and the modular
# kernel use it: a vacuous comparison (nothing found) must fail.
B12X_MODULE = "vllm.model_executor.layers.fused_moe.experts.flashinfer_b12x_moe"
B12X_MEMBERS = (
    "activation_format",
    "_supports_current_device",
    "_supports_no_act_and_mul",
    "_supports_quant_scheme",
    "_supports_activation",
    "_supports_parallel_config",
    "supports_expert_map",
    "finalize_weight_and_reduce_impl",
    "workspace_shapes",
    "expects_unquantized_inputs",
    "apply",
    "process_weights_after_loading",
)
ORACLE_MODULE = "vllm.model_executor.layers.fused_moe.oracle.nvfp4"
FP4_MOE_MODULE = "vllm.model_executor.layers.quantization.utils.flashinfer_fp4_moe"
# What 0.33.0's modules import from it: the NVFP4 oracle, the MXINT4 MoE
# preparation (the reorder) and the Flint model's MoE ops.
_FP4_MOE_IMPORTED_0_33 = (
    "interleave_linear_and_gate",
    "nvfp4_swizzled_scale_to_cutedsl_mma_view",
    "prepare_nvfp4_moe_layer_for_fi_or_cutlass",
    "prepare_nvfp4_moe_layer_for_flashinfer_cutedsl",
    "reorder_w13_to_w31_for_flashinfer_cutedsl",
    "reorder_w1w3_to_w3w1",
)
#: Per release, the names upstream's modules take from flashinfer_fp4_moe.py.
FP4_MOE_IMPORTED = {
    "0.33.0": _FP4_MOE_IMPORTED_0_33,
    "0.34.0": (*_FP4_MOE_IMPORTED_0_33, "prepare_static_weights_for_trtllm_fp4_moe"),
}


def _none(found: list, what: str) -> None:
    """Fail listing each item (module or file, definition, difference)."""
    if found:
        pytest.fail(f"{len(found)} {what}:\n" + "\n".join(map(str, found)))


@pytest.fixture(scope="module")
def interfaces() -> Interfaces:
    if problem := unmodified_tree_problem():
        pytest.skip(problem)
    return Interfaces()


def test_fork_ships_the_slices_definitions(interfaces):
    # Otherwise the checks below read a stale fork: rebuild and reinstall it.
    assert interfaces.fork_definition_mismatches() == []


def test_changed_definitions_keep_upstreams_interfaces(
    interfaces, upstream_measurements: Callable[[str, object], None]
):
    result = interfaces.changed_definitions()
    upstream_measurements(
        "changed definitions",
        f"{len(result.compared)} names compared, {len(result.added)} added, "
        f"{len(result.differences)} differences",
    )
    compared = set(result.compared)
    assert "FlashInferB12xExperts.__init__" in compared
    for member in B12X_MEMBERS:
        assert f"FlashInferB12xExperts.{member}" in compared, member
    assert "prepare_nvfp4_moe_layer_for_fi_or_cutlass" in compared
    assert "make_nvfp4_moe_quant_config" in compared
    _none(result.differences, "differences from 0.33.0 in the changed files")


def test_upstream_importers_find_their_names_in_the_fork(
    interfaces, upstream_measurements
):
    stats, uses = interfaces.importer_names()
    upstream_measurements(
        "names upstream's modules take from the changed ones",
        f"{stats.names} names in {stats.uses} uses, {stats.calls} calls bound, "
        f"{len(stats.problems)} problems",
    )
    taken = {u.name for u in uses if u.module == FP4_MOE_MODULE}
    assert taken == set(FP4_MOE_IMPORTED[UPSTREAM_VERSION])
    called = {(u.module, u.name) for u in uses if u.call is not None}
    assert (FP4_MOE_MODULE, "prepare_nvfp4_moe_layer_for_fi_or_cutlass") in called
    assert (ORACLE_MODULE, "make_nvfp4_moe_quant_config") in called
    assert any(u.module == "vllm.envs" for u in uses)
    _none(stats.problems, "problems")


def test_shipped_code_finds_upstreams_names_in_the_fork(
    interfaces, upstream_measurements
):
    stats, checks = interfaces.shipped_code_uses()
    upstream_measurements(
        "names the shipped code takes from upstream",
        f"{stats.names} names in {stats.uses} uses, {stats.calls} calls bound, "
        f"{stats.dynamic} not knowable (nn.Module attributes), "
        f"{len(stats.problems)} problems",
    )
    names = {c.name for c in checks}
    for expected in (
        "vllm.model_executor.layers.fused_moe.modular_kernel.FusedMoEExpertsModular",
        "vllm.model_executor.layers.fused_moe.modular_kernel.FusedMoEExperts"
        ".__init__(...)",
        "vllm.envs.VLLM_FLASHINFER_B12X_GLOBAL_SCALE_MODE",
        "vllm.platforms.current_platform.is_device_capability_family",
    ):
        assert expected in names, expected
    _none(stats.problems, "problems")


def test_design_page_table_of_the_slice_beside_upstream_is_current(interfaces):
    table = interfaces.harness_table()
    out = table_path()
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(table)
    documented = docs_table()
    assert documented is not None, (
        f"{DOCS_PAGE} has no {TABLE_BEGIN} ... {TABLE_END} section"
    )
    assert documented == table, (
        f"the table in {DOCS_PAGE.name} is stale: replace it with {out} "
        f"(written by this test; ${TABLE_ENV} names another path)"
    )
