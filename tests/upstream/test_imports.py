# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The installed vllm is the release expected (``VLLM_UPSTREAM_RELEASE``, or
that release +label) beside FlashInfer 0.7.4, and every module of
``vllm.model_executor`` that imports in the unmodified release imports in it
too."""

import importlib.metadata
import re
from concurrent.futures import ThreadPoolExecutor

import pytest

from upstream_env import (
    FLASHINFER_VERSION,
    UPSTREAM_VERSION,
    run_installed_json,
)

# The modules this branch's change lives in or is reached through; the walk
# is vacuous unless the unmodified release imports them here.
NVFP4_MOE_MODULES = (
    "vllm.model_executor.layers.fused_moe.oracle.nvfp4",
    "vllm.model_executor.layers.fused_moe.experts.flashinfer_b12x_moe",
    "vllm.model_executor.layers.quantization.modelopt",
    "vllm.model_executor.layers.quantization.utils.flashinfer_fp4_moe",
    "vllm.model_executor.layers.quantization.compressed_tensors."
    "compressed_tensors_moe.compressed_tensors_moe_w4a4_nvfp4",
)

_WALK = """\
from import_walk import walk_imports
result = walk_imports("vllm.model_executor")
"""


def test_installed_vllm_is_the_release_beside_flashinfer_0_7_4():
    import flashinfer

    import vllm

    version = re.escape(UPSTREAM_VERSION) + r"(\+[0-9A-Za-z.]+)?"
    assert re.fullmatch(version, importlib.metadata.version("vllm"))
    assert re.fullmatch(version, vllm.__version__)
    assert importlib.metadata.version("flashinfer-python") == FLASHINFER_VERSION
    assert flashinfer.__version__ == FLASHINFER_VERSION


@pytest.mark.slow
def test_model_executor_imports_everything_the_unmodified_release_imports(
    unmodified_upstream, upstream_measurements
):
    # One subprocess per side, both at once (one walk takes ~25 s).
    with ThreadPoolExecutor(2) as pool:
        unmodified = pool.submit(unmodified_upstream, _WALK)
        installed = pool.submit(run_installed_json, _WALK)
        unmodified, installed = unmodified.result(), installed.result()

    for side in (unmodified, installed):
        assert all(error is None for error in side["first"].values()), side["first"]
    upstream_measurements(
        f"vllm.model_executor import walk, unmodified {UPSTREAM_VERSION}",
        f"{len(unmodified['ok'])} import, {len(unmodified['failed'])} fail",
    )
    upstream_measurements(
        "vllm.model_executor import walk, installed vllm",
        f"{len(installed['ok'])} import, {len(installed['failed'])} fail",
    )
    missing = set(NVFP4_MOE_MODULES) - set(unmodified["ok"])
    assert not missing, {m: unmodified["failed"].get(m) for m in missing}
    lost = sorted(set(unmodified["ok"]) - set(installed["ok"]))
    assert not lost, {m: installed["failed"].get(m, "not found") for m in lost}
