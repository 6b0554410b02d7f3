# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""vLLM's weight-reload package (stand-in: the slice carries only the module
the branch adds to it, ``prepared_layers``, and the names upstream's
``direct.py`` and ``layerwise.py`` take from it)."""

from vllm.model_executor.model_loader.reload.prepared_layers import (
    begin_prepared_reload,
    check_prepared_reload,
    finish_prepared_reload,
)

__all__ = ["begin_prepared_reload", "check_prepared_reload", "finish_prepared_reload"]
