# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Upstream's b12x test module, ``tests/kernels/moe/test_flashinfer_b12x_moe.py``
of the source tree whose ``vllm`` this process imports, for its reference
helpers: ``_TorchB12xMoEWrapper`` (FlashInfer's B12xMoEWrapper, W4A4 gated
SiLU, as its kernels compute, in torch), ``_quantize_modelopt`` (ModelOpt's
NVFP4 of ``[E, N, K]``) and ``_decode`` (codes and linear block scales to
float32). Imported from the tree, never copied.
"""

import functools
import importlib
import sys
from pathlib import Path
from types import ModuleType

import vllm

__all__ = ["b12x_test_module"]

_MODULE = "tests.kernels.moe.test_flashinfer_b12x_moe"


def _is_tests(name: str) -> bool:
    return name == "tests" or name.startswith("tests.")


@functools.cache
def b12x_test_module() -> ModuleType:
    """The tree's module, imported once. Its ``tests`` package shares the name
    of this repository's (which pytest registers): the tree's is imported with
    the tree on ``sys.path`` and ours put back after, so both keep their
    modules."""
    tree = str(Path(vllm.__file__).resolve().parents[1])
    ours = {k: sys.modules.pop(k) for k in list(sys.modules) if _is_tests(k)}
    sys.path.insert(0, tree)
    try:
        return importlib.import_module(_MODULE)
    finally:
        sys.path.remove(tree)
        for name in [k for k in sys.modules if _is_tests(k)]:
            del sys.modules[name]
        sys.modules.update(ours)
