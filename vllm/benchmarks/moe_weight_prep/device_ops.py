# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""What an NVFP4 MoE layer's preparation would dispatch and move on a GPU,
counted on CPU tensors: torch ops per step (a kernel launch each on a GPU)
at CUDA's tile and the CPU's, host syncs, bytes moved, and an estimate of
the step's time on a card from stated assumptions."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from vllm.entrypoints.process_policy import PREP_CPU_THREADS, preparing_weights
from vllm.model_executor.layers.quantization.utils import bounded_chunks

__all__ = [
    "GPU_ASSUMPTIONS",
    "READ_ONLY_STEPS",
    "DeviceOpCounter",
    "count_layouts",
    "count_step_ops",
    "cuda_tiling",
    "format_device_ops",
    "gpu_estimate_s",
    "moved_bytes",
]

MIB = 1 << 20

# # The preparation runs on the GPU that serves the model. There a step costs
# the operations it dispatches (each a kernel launch, and eager PyTorch
# spends microseconds of host time on each) or the bytes it moves at the
# card's bandwidth, whichever is larger; this CPU's speed says little about
# either. Both are counted on CPU tensors, with CUDA's chunking.

#: aten ops that launch no kernel on a GPU: allocation and metadata.
_NO_KERNEL_OPS = frozenset(
    {"empty", "empty_like", "empty_strided", "lift_fresh", "resize_", "set_"}
    | {"_unsafe_view"}
)
#: aten ops that make the host wait for the device (a scalar read back:
#: ``.item()``, ``bool(tensor)``).
_HOST_SYNC_OPS = frozenset({"_local_scalar_dense"})
#: In-place ops that overwrite their destination without reading it.
_OVERWRITING_OPS = frozenset({"copy_", "fill_", "zero_"})


def _tensors_in(value) -> list[torch.Tensor]:
    return [t for t in tree_flatten(value)[0] if isinstance(t, torch.Tensor)]


def _nbytes(tensors: list[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


class DeviceOpCounter(TorchDispatchMode):
    """Counts the aten ops dispatched while it is active (one step's).

    ``ops``: every op that is not a view (views change no data and launch
    nothing); ``launches``: those that run a kernel on a GPU (``ops`` less
    allocation and metadata ops, :data:`_NO_KERNEL_OPS`); ``syncs``: host
    waits (:data:`_HOST_SYNC_OPS`, included in both). ``traffic_bytes``: the
    bytes the ops read and write, from their tensors: each tensor argument is
    read (a destination that is only overwritten, ``copy_``, is not), each
    result or mutated argument written. That counts the bounce buffer's round
    trips, which a GPU's L2 may absorb: an upper bound of the DRAM traffic.
    """

    def __init__(self):
        super().__init__()
        self.ops = self.launches = self.syncs = self.traffic_bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func.is_view:
            return out
        name = func.overloadpacket.__name__
        self.ops += 1
        self.syncs += name in _HOST_SYNC_OPS
        if name in _NO_KERNEL_OPS:
            return out  # no kernel: reads and writes nothing
        self.launches += 1
        schema = func._schema.arguments
        given = list(args) + [kwargs.get(a.name) for a in schema[len(args) :]]
        read, written = [], []
        for arg, value in zip(schema, given, strict=True):
            tensors = _tensors_in(value)
            if arg.alias_info is not None and arg.alias_info.is_write:
                written += tensors
                if name not in _OVERWRITING_OPS:
                    read += tensors
            else:
                read += tensors
        if not written:
            written = _tensors_in(out)
        self.traffic_bytes += _nbytes(read) + _nbytes(written)
        return out

    def counts(self) -> dict[str, int]:
        return {
            "ops": self.ops,
            "launches": self.launches,
            "syncs": self.syncs,
            "traffic_bytes": self.traffic_bytes,
        }


@contextlib.contextmanager
def cuda_tiling() -> Iterator[None]:
    """CPU tensors chunked as CUDA tensors are while the block runs: the
    bounded steps' tile (``bounded_chunks._TILE_BYTES["cpu"]``) set to
    CUDA's, restored after. Counting a step's operations inside gives the
    number a GPU would dispatch."""
    tiles = bounded_chunks._TILE_BYTES
    saved = tiles["cpu"]
    tiles["cpu"] = tiles["cuda"]
    try:
        yield
    finally:
        tiles["cpu"] = saved


def count_step_ops(
    make_layer: Callable[[], torch.nn.Module],
    tile: str = "cuda",
    threads: int = PREP_CPU_THREADS,
) -> dict[str, dict[str, int]]:
    """Per preparation step of a fresh ``make_layer()`` (and "total"): the
    :class:`DeviceOpCounter` counts of running it at ``tile`` ("cuda": CUDA's
    tile on these CPU tensors, :func:`cuda_tiling`; "cpu": the CPU's), on
    ``threads`` intra-op threads."""
    layer = make_layer()
    steps = layer.quant_method.preparation_steps(layer)
    tiling = cuda_tiling() if tile == "cuda" else contextlib.nullcontext()
    out: dict[str, dict[str, int]] = {}
    with tiling, preparing_weights(torch.device("cpu"), threads):
        for name, fn in steps:
            with DeviceOpCounter() as counter:
                fn()
            out[name] = counter.counts()
    out["total"] = {
        k: sum(c[k] for c in out.values()) for k in next(iter(out.values()))
    }
    return out


def moved_bytes(rewritten: dict[str, int], read_only: tuple[str, ...]) -> dict:
    """Bytes each step must move at least, read plus written, from the bytes
    it rewrites (each read once and written once: 2x) or, for the steps in
    ``read_only``, only reads (1x); "total" is recomputed."""
    out = {s: n * (1 if s in read_only else 2) for s, n in rewritten.items()}
    out["total"] = sum(n for s, n in out.items() if s != "total")
    return out


#: The GPU estimate's defaults (``--gpu-*``), for a 16 GB SM120 card: host
#: time per eager torch op (Python, the dispatcher, the launch; 5-20 us on
#: current CPUs), the extra wait of a host sync, and the effective bandwidth
#: of the slowest such card (RTX 5060 Ti 16 GB: 448 GB/s peak, ~70% of it).
GPU_ASSUMPTIONS = {"op_us": 10.0, "sync_us": 20.0, "bandwidth_gbs": 320.0}

#: Steps that read tensors and write nothing (a check, the exponents).
READ_ONLY_STEPS = ("validate", "exponents")


def gpu_estimate_s(ops: dict, moved: int, gpu: dict) -> float:
    """Seconds one step would take on a GPU: the larger of its host time
    (``ops["ops"]`` x ``gpu["op_us"]``: eager dispatch and launch, the
    device working meanwhile) and its bytes over the effective bandwidth,
    plus ``gpu["sync_us"]`` for each host sync (the queue drains)."""
    host = ops["ops"] * gpu["op_us"] * 1e-6
    device = moved / (gpu["bandwidth_gbs"] * 1e9)
    return max(host, device) + ops["syncs"] * gpu["sync_us"] * 1e-6


def count_layouts(makers: dict[str, tuple[Callable, dict[str, int]]]) -> dict:
    """Per layout of ``makers`` (name -> a fresh layer's maker and the bytes
    each step rewrites), per step: the op counts at the CUDA and the CPU tile,
    and the bytes: ``rewritten``, ``moved`` (the floor, :func:`moved_bytes`)
    and, from the CUDA tile's count, ``traffic``."""
    out = {}
    for layout, (make, rewritten) in makers.items():
        cuda, cpu = count_step_ops(make, "cuda"), count_step_ops(make, "cpu")
        rewritten = {s: rewritten.get(s, 0) for s in cuda}
        rewritten["total"] = sum(n for s, n in rewritten.items() if s != "total")
        moved = moved_bytes(rewritten, READ_ONLY_STEPS)
        out[layout] = {
            step: {
                "ops_cuda_tile": cuda[step],
                "ops_cpu_tile": cpu[step],
                "rewritten_bytes": rewritten[step],
                "moved_bytes": moved[step],
                "traffic_bytes": cuda[step]["traffic_bytes"],
            }
            for step in cuda
        }
    return out


def format_device_ops(preset, result: dict, gpu: dict) -> str:
    """The op and byte table of :func:`count_layouts` and the GPU
    estimate, with what was counted and assumed."""
    tiles = bounded_chunks._TILE_BYTES
    lines = [
        f"On a GPU: what one {preset.name} MoE layer's preparation dispatches "
        "and moves, per step",
        "  ops: torch ops dispatched (views not counted), each a kernel launch "
        "on a GPU (allocations aside); counted on CPU tensors",
        f"  ops@CUDA: with CUDA's {tiles['cuda'] >> 20} MiB tile set for CPU "
        "tensors while counting (bounded_chunks._TILE_BYTES): the chunks a GPU "
        f"runs; ops@CPU: the CPU's {tiles['cpu'] / MIB:.2f} MiB tile",
        "  syncs: host waits (.item(), bool() of a tensor)",
        "  moved: bytes read + written, 2x what a step rewrites (1x what "
        "validate and exponents only read): the floor",
        "  traffic: what its ops read and write, the bounce buffer's round trips "
        "included (a GPU's L2 holds some): the ceiling",
    ]
    for layout, steps in result.items():
        lines += [
            "",
            f"{layout:<11}{'ops@CUDA':>9}{'ops@CPU':>9}{'syncs':>7}"
            f"{'moved MiB':>11}{'traffic MiB':>13}",
        ]
        for step, r in steps.items():
            lines.append(
                f"{step:<11}{r['ops_cuda_tile']['ops']:>9,}"
                f"{r['ops_cpu_tile']['ops']:>9,}{r['ops_cuda_tile']['syncs']:>7}"
                f"{r['moved_bytes'] / MIB:>11,.0f}{r['traffic_bytes'] / MIB:>13,.0f}"
            )
    layers = preset.num_moe_layers
    lines += [
        "",
        f"estimated on a 16 GB SM120 card, assumed: {gpu['op_us']:g} us of host "
        f"time per op (eager dispatch and launch), {gpu['sync_us']:g} us more per "
        f"sync, {gpu['bandwidth_gbs']:g} GB/s effective (--gpu-op-us, "
        "--gpu-sync-us, --gpu-bandwidth-gbs); per step the larger of host time "
        "and bytes / bandwidth; the range: moved .. traffic bytes",
    ]
    for layout, steps in result.items():
        per_layer = [
            sum(
                gpu_estimate_s(r["ops_cuda_tile"], r[key], gpu)
                for step, r in steps.items()
                if step != "total"
            )
            for key in ("moved_bytes", "traffic_bytes")
        ]
        lines.append(
            f"  {layout:<11}{per_layer[0] * 1e3:6.1f} - {per_layer[1] * 1e3:6.1f} ms "
            f"per layer, {per_layer[0] * layers:.2f} - {per_layer[1] * layers:.2f} s "
            f"for the {layers} MoE layers"
        )
    return "\n".join(lines)
