# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Each step of the NVFP4 MoE weight preparation against its memcpy floor and
the legacy code, on a quiet machine and with busy cores, in one run.

For one MoE layer of a model preset (synthetic weights of its exact shapes,
loaded as [w1; w3], so the reorder runs), per step:

  memcpy   dst.copy_(src) of the bytes the step moves, into a preallocated
           buffer (one read and one write per byte): the step's floor
  alpha    the bounded step in the default global_scale_mode="alpha"
  fold     the bounded step in global_scale_mode="fold" (the lookup-table
           fold runs)
  legacy   the pre-change step (whole-tensor copies; it always folds)

Then, on one thread and a quiet machine, the choices inside two steps against
what they replaced (each checked for equal bytes): the swizzle's permutation
on 4-byte words against the same call on bytes (a scale at an odd address,
the fallback path), and the fold's lookup tables against the float32 fold
through a buffer that preceded them.

W4A16 (``--w4a16``, FlashInfer's packed b12x layout): each step of the
in-place W4A16 preparation (codes and scales of w13, then of w2; the [w3; w1]
w13 rotated on the way) against the memcpy of the bytes it rewrites, one
thread, quiet and with --busy-cores; checked byte for byte against the
reference (``flashinfer_w4a16_layout.w4a16_pack_*``) before it is timed.

What the preparation would cost on the GPU that runs it (it runs there, not
on this CPU), printed first, for W4A4 and W4A16: per step the device
operations it dispatches per layer (torch ops: a kernel launch each on a
GPU) at the CUDA tile size and at the CPU one, its host syncs, and the bytes
it moves; and from them an estimate for a 16 GB SM120 card whose
assumptions are flags (``--gpu-*``). The counts come from running each step
on CPU tensors under a TorchDispatchMode, with CUDA's tile
(``bounded_chunks._TILE_BYTES["cuda"]``, 16 MiB) set for CPU tensors while
counting: CUDA's chunking on CPU tensors. The timing tables show the CUDA
tile's op count beside each step's time.

Medians of --repeats, each on a fresh layer. First on the machine as it is,
then with --busy-cores processes each copying memory on one core (another
worker preparing its shard), started for that measurement and stopped after
it. Before anything is timed, each bounded mode's result is checked byte for
byte against the legacy preparation (weights; folded scales) and the
reference swizzle (alpha scales).

    python benchmarks/kernels/benchmark_moe_weight_prep_steps.py \\
        --model qwen3.6-35b-a3b --busy-cores 1 --json steps.json
"""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import time
from collections.abc import Callable, Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from vllm.benchmarks.moe_weight_prep.baselines import (
    float_chunk_fold_,
    legacy_preparation_steps,
)
from vllm.benchmarks.moe_weight_prep.busy_cores import busy_cores
from vllm.benchmarks.moe_weight_prep.layer import make_layer
from vllm.benchmarks.moe_weight_prep.presets import MOE_MODEL_PRESETS, get_preset
from vllm.benchmarks.moe_weight_prep.report import format_speedup
from vllm.benchmarks.moe_weight_prep.shard import RankShard
from vllm.benchmarks.moe_weight_prep.synthetic_weights import synthetic_layer_tensors
from vllm.benchmarks.moe_weight_prep.w4a4_layers import check_equal
from vllm.model_executor.layers.quantization.utils import bounded_chunks
from vllm.model_executor.layers.quantization.utils.blockscale_fold import (
    fold_global_scale_into_blockscale_,
)
from vllm.model_executor.layers.quantization.utils.blockscale_swizzle import (
    swizzle_blockscale_bounded,
)
from vllm.model_executor.layers.quantization.utils.bounded_chunks import (
    DEFAULT_MAX_TRANSIENT_BYTES,
    moe_prep_threads,
)
from vllm.model_executor.layers.quantization.utils.nvfp4_format import (
    swizzled_blockscale_shape,
)
from vllm.utils.argparse_utils import (
    CommandLineParser,
    core_count,
    non_negative_int,
    positive_int,
)

MIB = 1 << 20
STEPS = ["validate", "fold", "reorder", "swizzle", "total"]
MODES = ["alpha", "fold"]


def _step_bytes(tensors: dict, gated: bool) -> dict[str, dict[str, int]]:
    """Bytes each step rewrites (validate: reads), per mode; a step that does
    nothing, 0. What a memcpy of them moves is twice that (one read and one
    write per byte): see :func:`moved_bytes`."""
    scales = tensors["w13_weight_scale"].numel() + tensors["w2_weight_scale"].numel()
    reorder = tensors["w13_weight"].numel() + tensors["w13_weight_scale"].numel()
    out = {}
    # alpha mode rewrites no block scale (differing gate/up global scales
    # ride on the FC2 alpha): its fold step moves nothing.
    for mode, fold in (("alpha", 0), ("fold", scales), ("legacy", scales)):
        b = {
            "validate": 0 if mode == "legacy" else scales,
            "fold": fold,
            "reorder": reorder if gated else 0,
            "swizzle": scales,
        }
        b["total"] = sum(b.values())
        out[mode] = b
    return out


# --- on a GPU: device operations and bytes moved, per step -----------------------
#
# The preparation runs on the GPU that serves the model. There a step costs
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
    make_layer: Callable[[], torch.nn.Module], tile: str = "cuda"
) -> dict[str, dict[str, int]]:
    """Per preparation step of a fresh ``make_layer()`` (and "total"): the
    :class:`DeviceOpCounter` counts of running it at ``tile`` ("cuda": CUDA's
    tile on these CPU tensors, :func:`cuda_tiling`; "cpu": the CPU's)."""
    layer = make_layer()
    steps = layer.quant_method.preparation_steps(layer)
    tiling = cuda_tiling() if tile == "cuda" else contextlib.nullcontext()
    out: dict[str, dict[str, int]] = {}
    with tiling, moe_prep_threads(torch.device("cpu")):
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
_READ_ONLY_STEPS = ("validate", "exponents")


def gpu_estimate_s(ops: dict, moved: int, gpu: dict) -> float:
    """Seconds one step would take on a GPU: the larger of its host time
    (``ops["ops"]`` x ``gpu["op_us"]``: eager dispatch and launch, the
    device working meanwhile) and its bytes over the effective bandwidth,
    plus ``gpu["sync_us"]`` for each host sync (the queue drains)."""
    host = ops["ops"] * gpu["op_us"] * 1e-6
    device = moved / (gpu["bandwidth_gbs"] * 1e9)
    return max(host, device) + ops["syncs"] * gpu["sync_us"] * 1e-6


LAYOUTS = ("w4a4 alpha", "w4a4 fold", "w4a16")


def measure_device_ops(preset, tensors, layouts=LAYOUTS) -> dict:
    """Per layout of ``layouts`` (W4A4 in either mode, W4A16), per step: the
    op counts at the CUDA and the CPU tile, and the bytes: ``rewritten``,
    ``moved`` (the floor, :func:`moved_bytes`) and, from the CUDA tile's
    count, ``traffic``."""

    def w4a4(mode):
        cap, cpu = DEFAULT_MAX_TRANSIENT_BYTES, torch.device("cpu")
        return lambda: make_layer(preset, RankShard(), cpu, tensors, cap, mode)

    step_bytes = _step_bytes(tensors, preset.is_gated)
    makers = {
        "w4a4 alpha": (w4a4("alpha"), step_bytes["alpha"]),
        "w4a4 fold": (w4a4("fold"), step_bytes["fold"]),
        "w4a16": (lambda: _w4a16_layer(preset, tensors), _w4a16_bytes(tensors)),
    }
    layouts_made = {name: makers[name] for name in layouts}
    out = {}
    for layout, (make, rewritten) in layouts_made.items():
        cuda, cpu = count_step_ops(make, "cuda"), count_step_ops(make, "cpu")
        rewritten = {s: rewritten.get(s, 0) for s in cuda}
        rewritten["total"] = sum(n for s, n in rewritten.items() if s != "total")
        moved = moved_bytes(rewritten, _READ_ONLY_STEPS)
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
    """The op and byte table of :func:`measure_device_ops` and the GPU
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


def _median(values: list[float]) -> float:
    return statistics.median(values)


def _time_steps(make_layer, repeats: int, names) -> dict[str, list[float]]:
    """Each preparation step of ``repeats`` fresh layers, timed one by one
    (``names``: the steps to keep, "total" included)."""
    times: dict[str, list[float]] = {s: [] for s in names}
    device = torch.device("cpu")
    for _ in range(repeats):
        layer = make_layer()
        steps = layer.quant_method.preparation_steps(layer)
        # As process_weights_after_loading runs them: one thread setting.
        with moe_prep_threads(device):
            total = 0.0
            for name, fn in steps:
                start = time.perf_counter()
                fn()
                dt = time.perf_counter() - start
                total += dt
                if name in times:
                    times[name].append(dt)
        times["total"].append(total)
        del layer, steps
    return times


def _time_bounded(preset, tensors, mode, repeats) -> dict[str, float]:
    times = _time_steps(
        lambda: make_layer(
            preset,
            RankShard(),
            torch.device("cpu"),
            tensors,
            DEFAULT_MAX_TRANSIENT_BYTES,
            mode,
        ),
        repeats,
        STEPS,
    )
    return {s: _median(v) for s, v in times.items() if v}


def _time_legacy(preset, tensors, repeats) -> dict[str, float]:
    times: dict[str, list[float]] = {s: [] for s in STEPS}
    for _ in range(repeats):
        owned = {k: v.clone() for k, v in tensors.items()}
        total = 0.0
        for name, fn in legacy_preparation_steps(owned, preset.is_gated):
            start = time.perf_counter()
            fn()
            dt = time.perf_counter() - start
            total += dt
            times[name].append(dt)
        times["total"].append(total)
        del owned
    return {s: _median(v) for s, v in times.items() if v}


def _time_memcpy(byte_counts: set[int], repeats: int) -> dict[int, float]:
    largest = max(byte_counts)
    src = torch.ones(largest, dtype=torch.uint8)
    dst = torch.empty_like(src)
    out = {0: 0.0}
    for n in sorted(byte_counts - {0}):
        times = []
        for _ in range(repeats + 1):
            start = time.perf_counter()
            dst[:n].copy_(src[:n])
            times.append(time.perf_counter() - start)
        out[n] = _median(times[1:])
    return out


def _check(preset, tensors) -> None:
    owned = {k: v.clone() for k, v in tensors.items()}
    for _, fn in legacy_preparation_steps(owned, preset.is_gated):
        fn()
    for mode in MODES:
        layer = make_layer(
            preset,
            RankShard(),
            torch.device("cpu"),
            tensors,
            DEFAULT_MAX_TRANSIENT_BYTES,
            mode,
        )
        layer.quant_method.process_weights_after_loading(layer)
        check_equal(layer, owned, tensors, 0, mode)


def measure(preset, tensors, repeats: int, floors: dict[int, float]) -> dict:
    nbytes = _step_bytes(tensors, preset.is_gated)
    rows = {mode: _time_bounded(preset, tensors, mode, repeats) for mode in MODES}
    rows["legacy"] = _time_legacy(preset, tensors, repeats)
    return {
        variant: {
            step: {
                "time_s": times.get(step),
                "bytes": nbytes[variant][step],
                "memcpy_s": floors[nbytes[variant][step]],
            }
            for step in STEPS
        }
        for variant, times in rows.items()
    }


def _swizzle_at(src: torch.Tensor, offset: int):
    """A fresh copy of ``src`` [E, R, C] at byte ``offset`` of a storage with
    room for its swizzled result, and the in-place swizzle of it."""
    e, r, c = src.shape
    rp, cp = swizzled_blockscale_shape(r, c)
    storage = torch.zeros(offset + e * rp * cp, dtype=torch.uint8)
    scale = storage[offset : offset + e * r * c].view(e, r, c)
    scale.copy_(src.view(torch.uint8))
    scale = scale.view(torch.float8_e4m3fn)
    return lambda: swizzle_blockscale_bounded(scale, storage_has_room=True)


def measure_alternatives(tensors: dict, repeats: int) -> dict[str, float]:
    """Median seconds of each step's chosen method and the one it replaced,
    on the layer's w13 + w2 scales, one thread; results compared first."""
    scales = [tensors["w13_weight_scale"], tensors["w2_weight_scale"]]
    factors = [tensors["w13_weight_scale_2"], tensors["w2_weight_scale_2"]]

    def run(make) -> tuple[float, list[torch.Tensor]]:
        times, out = [], None
        for _ in range(repeats):
            calls = make()  # fresh inputs, not timed
            with moe_prep_threads("cpu"):
                start = time.perf_counter()
                out = [call() for call in calls]
                times.append(time.perf_counter() - start)
        return _median(times), [o.view(torch.uint8).clone() for o in out]

    words_t, words = run(lambda: [_swizzle_at(s, 0) for s in scales])
    bytes_t, by_bytes = run(lambda: [_swizzle_at(s, 1) for s in scales])

    def folds(fn):
        def make():
            pairs = zip([s.clone() for s in scales], factors, strict=True)
            return [lambda s=s, f=f: fn(s, f) for s, f in pairs]

        return make

    table_t, table = run(folds(fold_global_scale_into_blockscale_))
    float_t, by_float = run(folds(float_chunk_fold_))
    for name, a, b in (("swizzle", words, by_bytes), ("fold", table, by_float)):
        if not all(torch.equal(x, y) for x, y in zip(a, b, strict=True)):
            raise RuntimeError(f"the two {name} methods give different bytes")
    return {
        "swizzle_words_s": words_t,
        "swizzle_bytes_s": bytes_t,
        "fold_table_s": table_t,
        "fold_float_s": float_t,
    }


W4A16_STEPS = ["validate", "halves", "exponents", "w13", "w2", "finalize"]


def _w4a16_layer(preset, tensors):
    from vllm.model_executor.layers.fused_moe.layer import FusedMoE
    from vllm.model_executor.layers.quantization.modelopt import ModelOptNvFp4Config

    layer = FusedMoE(
        num_experts=preset.num_experts,
        top_k=preset.top_k,
        hidden_size=preset.hidden_size,
        intermediate_size=preset.intermediate_size,
        activation=preset.activation,
        quant_config=ModelOptNvFp4Config.for_mode("w4a16"),
        moe_backend="flashinfer_b12x_emulated",
        place_w3w1_at_load=True,
    )
    with torch.no_grad():
        for name, value in tensors.items():
            getattr(layer, name).copy_(value)  # taken as [w3; w1]: rotated
    return layer


def _check_w4a16(preset, tensors) -> None:
    from vllm.model_executor.layers.quantization.utils.flashinfer_w4a16_layout import (
        w4a16_pack_blockscale,
        w4a16_pack_weight,
        w4a16_scale_exponent,
    )

    layer = _w4a16_layer(preset, tensors)
    layer.quant_method.process_weights_after_loading(layer)
    pw = layer.quant_method.experts.prepared
    rotate = preset.intermediate_size if preset.is_gated else 0
    for prefix, rot in (("w13", rotate), ("w2", 0)):
        w, s = tensors[f"{prefix}_weight"], tensors[f"{prefix}_weight_scale"]
        x = w4a16_scale_exponent(s)
        for e0 in range(0, w.shape[0], 16):  # the reference, 16 experts at a time
            want_w = w4a16_pack_weight(w[e0 : e0 + 16], rot)
            want_s = w4a16_pack_blockscale(s[e0 : e0 + 16], x, rot)
            got_w = getattr(pw, prefix)[e0 : e0 + 16]
            got_s = getattr(pw, f"{prefix}_scale")[e0 : e0 + 16]
            if not (
                torch.equal(got_w, want_w)
                and torch.equal(got_s.view(torch.uint8), want_s.view(torch.uint8))
            ):
                raise SystemExit(f"W4A16 {prefix} differs from the reference")


def _w4a16_bytes(tensors) -> dict[str, int]:
    """Bytes each W4A16 step rewrites (validate and exponents: the block
    scales they read); "total": what the preparation rewrites, w13 and w2."""
    nbytes = {s: 0 for s in [*W4A16_STEPS, "total"]}
    for prefix in ("w13", "w2"):
        nbytes[prefix] = sum(
            tensors[f"{prefix}_{k}"].numel() for k in ("weight", "weight_scale")
        )
    scales = tensors["w13_weight_scale"].numel() + tensors["w2_weight_scale"].numel()
    nbytes["validate"] = nbytes["exponents"] = scales
    nbytes["total"] = nbytes["w13"] + nbytes["w2"]
    return nbytes


def measure_w4a16(
    preset, tensors, repeats: int, floors: dict[int, float] | None = None
) -> dict:
    """Per W4A16 step: median time and the memcpy of the bytes it rewrites
    (``floors``: those memcpy times by byte count; measured here if None)."""
    times = _time_steps(
        lambda: _w4a16_layer(preset, tensors), repeats, [*W4A16_STEPS, "total"]
    )
    nbytes = _w4a16_bytes(tensors)
    if floors is None:
        floors = _time_memcpy(set(nbytes.values()), repeats)
    return {
        step: {
            "time_s": _median(v),
            "bytes": nbytes[step],
            "memcpy_s": floors[nbytes[step]],
        }
        for step, v in times.items()
    }


def _condition(busy: int, threads: int) -> str:
    if busy == 0:
        return "quiet"
    return f"{busy} busy process(es) on {threads} thread(s) each"


def format_w4a16(result: dict, condition: str = "quiet", ops=None) -> str:
    """The W4A16 timing table; ``ops`` (:func:`measure_device_ops`' "w4a16")
    adds each step's op count at the CUDA tile and the bytes it moves."""
    lines = [
        f"W4A16 (FlashInfer's packed layout, in place; one thread, {condition}; "
        "memcpy: quiet)",
        f"{'step':<10}{'MiB':>7}{'memcpy':>10}{'time':>10}{'x memcpy':>10}"
        + (f"{'ops@CUDA':>10}{'moved MiB':>11}" if ops else ""),
    ]
    for step, rec in result.items():
        ratio = f"{rec['time_s'] / rec['memcpy_s']:.1f}x" if rec["memcpy_s"] else "-"
        extra = ""
        if ops:
            o = ops[step]
            extra = f"{o['ops_cuda_tile']['ops']:>10,}{o['moved_bytes'] / MIB:>11,.0f}"
        lines.append(
            f"{step:<10}{rec['bytes'] / MIB:>7.0f}{rec['memcpy_s'] * 1e3:>8.1f}ms"
            f"{rec['time_s'] * 1e3:>8.1f}ms{ratio:>10}{extra}"
        )
    if ops:
        lines.append(
            "(MiB: the bytes a step rewrites; ops@CUDA: torch ops it dispatches "
            "with CUDA's tile, a kernel launch each on a GPU; moved: read + written)"
        )
    return "\n".join(lines)


def _cell(rec: dict, ops: dict | None = None) -> str:
    t, floor = rec["time_s"], rec["memcpy_s"]
    count = f"{ops['ops_cuda_tile']['ops']:>6,}" if ops else ""
    if t is None:
        return f"{'-':>9}{'':>7}{count}"
    ratio = f"{t / floor:5.1f}x" if floor else "     -"
    return f"{t * 1e3:7.1f}ms{ratio:>7}{count}"


def format_condition(label: str, result: dict, ops: dict | None = None) -> str:
    """One condition's W4A4 table; ``ops`` (:func:`measure_device_ops`) adds
    each bounded step's op count at the CUDA tile beside its time, and the
    bytes the fold mode's step moves."""
    variants = ["alpha", "fold", "legacy"]
    layout = {"alpha": "w4a4 alpha", "fold": "w4a4 fold"}
    width = 22 if ops else 16
    lines = [
        label,
        f"{'step':<10}{'MiB':>7}{'memcpy':>10}"
        + (f"{'moved':>9}" if ops else "")
        + "".join(f"{v:>{width}}" for v in variants)
        + "   (time, x the memcpy of its bytes"
        + (", ops at the CUDA tile)" if ops else ")"),
    ]
    for step in STEPS:
        f = result["fold"][step]  # the mode that moves the most
        moved = ""
        if ops:
            moved = f"{ops['w4a4 fold'][step]['moved_bytes'] / MIB:>9,.0f}"
        cells = [
            _cell(result[v][step], ops and ops[layout[v]].get(step))
            if v in layout
            else _cell(result[v][step])
            for v in variants
        ]
        lines.append(
            f"{step:<10}{f['bytes'] / MIB:>7.0f}{f['memcpy_s'] * 1e3:>8.1f}ms{moved}"
            + "".join(f"{c:>{width}}" for c in cells)
        )
    lines.append(
        "(MiB: the bytes the fold mode's step rewrites (validate: reads), memcpy: "
        "quiet, of those "
        "bytes; moved: read + written, MiB; in alpha mode the fold step moves "
        "nothing: no block scale is rewritten)"
    )
    lt = result["legacy"]["total"]["time_s"]
    for mode in MODES:
        bt = result[mode]["total"]["time_s"]
        lines.append(f"whole layer, bounded {mode} vs legacy: {format_speedup(lt, bt)}")
    return "\n".join(lines)


def main() -> int:
    parser = CommandLineParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--model", default="qwen3.6-35b-a3b", choices=sorted(MOE_MODEL_PRESETS)
    )
    parser.add_argument("--repeats", type=positive_int, default=5)
    parser.add_argument(
        "--busy-cores",
        type=core_count,
        default=1,
        help="processes that keep a core busy copying memory during the second "
        "measurement (0: quiet only)",
    )
    parser.add_argument(
        "--busy-threads",
        type=positive_int,
        default=1,
        help="intra-op threads of each busy process (default 1; 2 on a 2-core "
        "machine makes a neighbour that runs parallel operations itself)",
    )
    parser.add_argument(
        "--threads",
        type=positive_int,
        default=None,
        help="torch intra-op threads for the whole run (default: torch's)",
    )
    parser.add_argument(
        "--prep-threads",
        type=non_negative_int,
        default=None,
        help="threads of the bounded steps on CPU, i.e. VLLM_MOE_PREP_CPU_THREADS "
        "(default: its value, 1 when unset; 0: the run's torch setting)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--w4a16",
        choices=["also", "only", "no"],
        default="also",
        help="time the W4A16 preparation's steps too (only: nothing else)",
    )
    parser.add_argument(
        "--device-ops",
        choices=["also", "only", "no"],
        default="also",
        help="count each step's device operations and bytes and print the GPU "
        "estimate first (only: nothing else; counting at the CPU tile runs "
        "the W4A16 steps once more, seconds)",
    )
    # The GPU estimate's assumptions, for a 16 GB SM120 card.
    parser.add_argument(
        "--gpu-op-us",
        type=float,
        default=GPU_ASSUMPTIONS["op_us"],
        help="host time per torch op on the GPU machine: eager dispatch and "
        "the launch (default %(default)s us)",
    )
    parser.add_argument(
        "--gpu-sync-us",
        type=float,
        default=GPU_ASSUMPTIONS["sync_us"],
        help="extra wait per host sync, the queue draining (default %(default)s us)",
    )
    parser.add_argument(
        "--gpu-bandwidth-gbs",
        type=float,
        default=GPU_ASSUMPTIONS["bandwidth_gbs"],
        help="effective memory bandwidth (default %(default)s GB/s: about 70%% of "
        "the RTX 5060 Ti 16 GB's 448 GB/s, the slowest 16 GB SM120 card)",
    )
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    if args.prep_threads is not None:
        os.environ["VLLM_MOE_PREP_CPU_THREADS"] = str(args.prep_threads)
    preset = get_preset(args.model)
    tensors = synthetic_layer_tensors(preset, 1, torch.device("cpu"), args.seed)
    gpu = {
        "op_us": args.gpu_op_us,
        "sync_us": args.gpu_sync_us,
        "bandwidth_gbs": args.gpu_bandwidth_gbs,
    }
    device_ops = None
    if args.device_ops != "no":
        layouts = {"only": ("w4a16",), "no": LAYOUTS[:2]}.get(args.w4a16, LAYOUTS)
        device_ops = measure_device_ops(preset, tensors, layouts)
        print(format_device_ops(preset, device_ops, gpu) + "\n")
        if args.device_ops == "only":
            if args.json:
                with open(args.json, "w") as f:
                    json.dump(
                        {"device_ops": device_ops, "gpu_assumptions": gpu}, f, indent=1
                    )
            return 0
    w4a16 = None
    if args.w4a16 != "no":
        _check_w4a16(preset, tensors)
        w4a16 = {}
        # the floors once, quiet, as for the W4A4 steps below
        w4a16_floors = _time_memcpy(set(_w4a16_bytes(tensors).values()), args.repeats)
        for busy in sorted({0, args.busy_cores}):
            with (
                busy_cores(busy, args.busy_threads),
                moe_prep_threads(torch.device("cpu")),
            ):
                w4a16[str(busy)] = measure_w4a16(
                    preset, tensors, args.repeats, w4a16_floors
                )
            condition = _condition(busy, args.busy_threads)
            ops = device_ops and device_ops["w4a16"]
            print(format_w4a16(w4a16[str(busy)], condition, ops))
        if args.busy_cores:
            quiet = w4a16["0"]["total"]["time_s"]
            busy_s = w4a16[str(args.busy_cores)]["total"]["time_s"]
            print(f" W4A16: busy / quiet = {busy_s / quiet:.2f}x\n")
    if args.w4a16 == "only":
        if args.json:
            with open(args.json, "w") as f:
                json.dump(
                    {
                        "busy_cores": args.busy_cores,
                        "w4a16": w4a16,
                        "device_ops": device_ops,
                        "gpu_assumptions": gpu,
                    },
                    f,
                    indent=1,
                )
        return 0
    _check(preset, tensors)
    prep_threads = os.environ.get("VLLM_MOE_PREP_CPU_THREADS", "1 (default)")
    header = (
        f"{preset.name}, one MoE layer on CPU ({os.cpu_count()} cores), torch "
        f"{torch.__version__} with {torch.get_num_threads()} intra-op threads, "
        f"bounded steps on VLLM_MOE_PREP_CPU_THREADS={prep_threads}; medians of "
        f"{args.repeats}; results checked byte for byte against legacy first"
    )
    print(header)
    # The floors are measured once, quiet: the bandwidth the machine offers.
    nbytes = _step_bytes(tensors, preset.is_gated)
    floors = _time_memcpy(
        {b for per in nbytes.values() for b in per.values()}, args.repeats
    )
    conditions = {}
    for busy in sorted({0, args.busy_cores}):
        with busy_cores(busy, args.busy_threads):
            conditions[busy] = measure(preset, tensors, args.repeats, floors)
        label = _condition(busy, args.busy_threads)
        print("\n" + format_condition(label, conditions[busy], device_ops))
    alternatives = measure_alternatives(tensors, args.repeats)
    a = alternatives
    print(
        "\nchoices inside the steps (w13 + w2 scales, one thread, quiet):\n"
        f"  swizzle: 4-byte words {a['swizzle_words_s'] * 1e3:.1f} ms, bytes "
        f"{a['swizzle_bytes_s'] * 1e3:.1f} ms "
        f"({format_speedup(a['swizzle_bytes_s'], a['swizzle_words_s'])})\n"
        f"  fold: lookup tables {a['fold_table_s'] * 1e3:.1f} ms, float32 through "
        f"a buffer {a['fold_float_s'] * 1e3:.1f} ms "
        f"({format_speedup(a['fold_float_s'], a['fold_table_s'])})"
    )
    if args.busy_cores:
        for variant in ["alpha", "fold", "legacy"]:
            quiet = conditions[0][variant]["total"]["time_s"]
            busy = conditions[args.busy_cores][variant]["total"]["time_s"]
            print(f"{variant:>6}: busy / quiet = {busy / quiet:.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "header": header,
                    "busy_cores": args.busy_cores,
                    "conditions": {str(k): v for k, v in conditions.items()},
                    "alternatives": alternatives,
                    "w4a16": w4a16,
                    "device_ops": device_ops,
                    "gpu_assumptions": gpu,
                },
                f,
                indent=1,
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
