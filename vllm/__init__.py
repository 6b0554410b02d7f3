# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""vLLM, NVFP4 MoE weight-preparation branch (a clean-room slice)."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("vllm")
except PackageNotFoundError:  # run from a source tree (PYTHONPATH=.)
    __version__ = "0.0.0+source"

__all__ = ["__version__"]
