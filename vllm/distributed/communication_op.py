# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Collectives over the tensor-parallel group (upstream's names)."""

from __future__ import annotations

import torch

from vllm.distributed.parallel_state import get_tp_group

__all__ = ["tensor_model_parallel_all_reduce"]


def tensor_model_parallel_all_reduce(input_: torch.Tensor) -> torch.Tensor:
    """Sum ``input_`` over the tensor-parallel group, in place; returns it.
    Every rank of the group must call it with the same shape and dtype."""
    return get_tp_group().all_reduce(input_)
