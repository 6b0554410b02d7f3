# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Load a checkpoint through vLLM 0.34.0's own loader in this process, on CPU,
with ``moe_backend="flashinfer_b12x"``:

    with vllm_world(init_file):         loading stand-ins held; vLLM's parallel
                                        state on a gloo world (one rank, or
                                        one rank of a TP world)
        model, cfg = load_model(ckpt)   engine_config(ckpt): EngineArgs(...)
                                        .create_engine_config(); then
                                        get_model_loader(...).load_model(...):
                                        initialize_model -> load_weights ->
                                        process_weights_after_loading

An engine config serves one model (its attention layers register in it), so
each load builds its own.

The stand-ins are ``benchmarks/vllm_cpu_stand_ins.py``'s (each with its
reason there); none touches the weight preparation.
"""

from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import torch

from vllm.config import VllmConfig, set_current_vllm_config

from vllm_cpu_stand_ins import (
    b12x_backend_selectable,
    cpu_worker_torch_patches,
    cuda_is_identity,
    dense_layers_unpacked,
    triton_reported_present,
)

__all__ = ["engine_config", "is_release", "load_model", "vllm_world"]


def is_release() -> bool:
    """Whether the imported vllm is the unmodified release tree (no series)."""
    import vllm.model_executor.layers.quantization.utils.nvfp4_utils as nvfp4_utils

    return not hasattr(nvfp4_utils, "swizzle_blockscale_")


def engine_config(checkpoint: str | Path, **engine_args) -> VllmConfig:
    """The engine config vLLM builds for ``checkpoint`` on the b12x backend:
    BF16, eager, no tokenizer, safetensors; ``engine_args`` add to or override
    these ``EngineArgs``."""
    from vllm.engine.arg_utils import EngineArgs

    args = dict(
        model=str(checkpoint),
        moe_backend="flashinfer_b12x",
        dtype="bfloat16",
        enforce_eager=True,
        skip_tokenizer_init=True,
        max_model_len=128,
        load_format="safetensors",
    )
    with triton_reported_present():
        return EngineArgs(**(args | engine_args)).create_engine_config()


@contextmanager
def vllm_world(
    init_file: str | Path, cfg: VllmConfig | None = None, rank: int = 0
) -> Iterator[None]:
    """Hold the loading stand-ins and vLLM's parallel state on gloo for
    ``cfg``'s parallel config (default: one rank), this process being
    ``rank`` of ``tensor_parallel_size`` ranks; ``init_file`` is the
    rendezvous file, the same for every rank. Torn down on exit."""
    from vllm.distributed import (
        destroy_distributed_environment,
        destroy_model_parallel,
        init_distributed_environment,
        initialize_model_parallel,
    )

    if cfg is None:
        with triton_reported_present():
            cfg = VllmConfig()
    tp = cfg.parallel_config.tensor_parallel_size
    with ExitStack() as stack:
        stack.enter_context(cpu_worker_torch_patches())
        stack.enter_context(b12x_backend_selectable())
        stack.enter_context(dense_layers_unpacked())
        if is_release():
            stack.enter_context(cuda_is_identity())
        with set_current_vllm_config(cfg):
            init_distributed_environment(
                world_size=tp,
                rank=rank,
                local_rank=rank,
                distributed_init_method=f"file://{init_file}",
                backend="gloo",
            )
            stack.callback(destroy_distributed_environment)
            initialize_model_parallel(tp, 1)
            stack.callback(destroy_model_parallel)
        yield


def load_model(
    checkpoint: str | Path, **engine_args
) -> tuple[torch.nn.Module, VllmConfig]:
    """``checkpoint`` loaded and prepared by vLLM's own loader (inside
    ``vllm_world``), and the engine config it was loaded with."""
    from vllm.model_executor.model_loader import get_model_loader

    cfg = engine_config(checkpoint, **engine_args)
    with set_current_vllm_config(cfg):
        loader = get_model_loader(cfg.load_config)
        model = loader.load_model(vllm_config=cfg, model_config=cfg.model_config)
    return model, cfg
