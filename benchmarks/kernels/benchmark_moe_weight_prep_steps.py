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

import json
import os
import statistics
import time

import torch

from vllm.benchmarks.moe_weight_prep.baselines import (
    legacy_preparation_steps,
    measure_alternatives,
)
from vllm.benchmarks.moe_weight_prep.busy_cores import busy_cores
from vllm.benchmarks.moe_weight_prep.device_ops import (
    GPU_ASSUMPTIONS,
    count_layouts,
    format_device_ops,
)
from vllm.benchmarks.moe_weight_prep.layer import make_layer
from vllm.benchmarks.moe_weight_prep.presets import MOE_MODEL_PRESETS, get_preset
from vllm.benchmarks.moe_weight_prep.report import format_speedup
from vllm.benchmarks.moe_weight_prep.shard import RankShard
from vllm.benchmarks.moe_weight_prep.synthetic_weights import synthetic_layer_tensors
from vllm.benchmarks.moe_weight_prep.w4a4_layers import check_equal
from vllm.entrypoints.process_policy import PREP_CPU_THREADS, preparing_weights
from vllm.model_executor.layers.quantization.utils.bounded_chunks import (
    DEFAULT_MAX_TRANSIENT_BYTES,
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
#: Intra-op threads of the bounded steps on CPU (``--prep-threads``).
PREP = {"threads": PREP_CPU_THREADS}


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


LAYOUTS = ("w4a4 alpha", "w4a4 fold", "w4a16")


def measure_device_ops(preset, tensors, layouts=LAYOUTS) -> dict:
    """Per layout of ``layouts`` (W4A4 in either mode, W4A16):
    :func:`~vllm.benchmarks.moe_weight_prep.device_ops.count_layouts` of a
    fresh layer of ``preset`` holding ``tensors``."""

    def w4a4(mode):
        cap, cpu = DEFAULT_MAX_TRANSIENT_BYTES, torch.device("cpu")
        return lambda: make_layer(preset, RankShard(), cpu, tensors, cap, mode)

    step_bytes = _step_bytes(tensors, preset.is_gated)
    makers = {
        "w4a4 alpha": (w4a4("alpha"), step_bytes["alpha"]),
        "w4a4 fold": (w4a4("fold"), step_bytes["fold"]),
        "w4a16": (lambda: _w4a16_layer(preset, tensors), _w4a16_bytes(tensors)),
    }
    return count_layouts({name: makers[name] for name in layouts})


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
        with preparing_weights(device, PREP["threads"]):
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
        help="threads of the bounded steps on CPU (default "
        f"{PREP_CPU_THREADS}, the commands' setting; 0: the run's torch setting)",
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
        PREP["threads"] = args.prep_threads
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
                preparing_weights(torch.device("cpu"), PREP["threads"]),
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
    prep_threads = PREP["threads"] or f"torch's {torch.get_num_threads()}"
    header = (
        f"{preset.name}, one MoE layer on CPU ({os.cpu_count()} cores), torch "
        f"{torch.__version__} with {torch.get_num_threads()} intra-op threads, "
        f"bounded steps on {prep_threads} thread(s); medians of "
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
    alternatives = measure_alternatives(tensors, args.repeats, PREP["threads"])
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
