# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Distributed execution: process groups and collectives (upstream names)."""

from vllm.distributed.communication_op import tensor_model_parallel_all_reduce
from vllm.distributed.parallel_state import (
    GroupCoordinator,
    check_ranks_agree,
    destroy_distributed_environment,
    destroy_model_parallel,
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_world_size,
    get_tp_group,
    get_world_group,
    init_distributed_environment,
    initialize_model_parallel,
    model_parallel_is_initialized,
)

__all__ = [
    "GroupCoordinator",
    "check_ranks_agree",
    "destroy_distributed_environment",
    "destroy_model_parallel",
    "get_tensor_model_parallel_rank",
    "get_tensor_model_parallel_world_size",
    "get_tp_group",
    "get_world_group",
    "init_distributed_environment",
    "initialize_model_parallel",
    "model_parallel_is_initialized",
    "tensor_model_parallel_all_reduce",
]
