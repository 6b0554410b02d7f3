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
reference (``nvfp4_utils.w4a16_pack_*``) before it is timed.

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

from vllm.benchmarks.busy_cores import busy_cores
from vllm.benchmarks.legacy_moe_prep import (
    float_chunk_fold_,
    legacy_preparation_steps,
)
from vllm.benchmarks.moe_model_presets import MOE_MODEL_PRESETS, get_preset
from vllm.benchmarks.moe_synthetic_weights import synthetic_layer_tensors
from vllm.benchmarks.moe_weight_prep_ranks import RankShard
from vllm.benchmarks.moe_weight_prep_report import format_speedup
from vllm.benchmarks.moe_weight_prep_run import _check_equal, _make_layer
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
from vllm.model_executor.layers.quantization.utils.nvfp4_utils import (
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
    """Bytes each step moves, per mode (a step that does nothing moves 0)."""
    scales = tensors["w13_weight_scale"].numel() + tensors["w2_weight_scale"].numel()
    reorder = tensors["w13_weight"].numel() + tensors["w13_weight_scale"].numel()
    s2 = tensors["w13_weight_scale_2"]
    differ = bool((s2 != s2[:, :1]).any())  # only then does "alpha" fold w13
    alpha_fold = tensors["w13_weight_scale"].numel() if differ else 0
    out = {}
    for mode, fold in (("alpha", alpha_fold), ("fold", scales), ("legacy", scales)):
        b = {"validate": 0 if mode == "legacy" else scales, "fold": fold,
             "reorder": reorder if gated else 0, "swizzle": scales}  # fmt: skip
        b["total"] = sum(b.values())
        out[mode] = b
    return out


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
        lambda: _make_layer(preset, RankShard(), torch.device("cpu"), tensors,
                            DEFAULT_MAX_TRANSIENT_BYTES, mode),
        repeats, STEPS,
    )  # fmt: skip
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
        layer = _make_layer(preset, RankShard(), torch.device("cpu"), tensors,
                            DEFAULT_MAX_TRANSIENT_BYTES, mode)  # fmt: skip
        layer.quant_method.process_weights_after_loading(layer)
        _check_equal(layer, owned, tensors, 0, mode)


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
    return {"swizzle_words_s": words_t, "swizzle_bytes_s": bytes_t,
            "fold_table_s": table_t, "fold_float_s": float_t}  # fmt: skip


W4A16_STEPS = ["validate", "halves", "exponents", "w13", "w2", "finalize"]


def _w4a16_layer(preset, tensors):
    from vllm.model_executor.layers.fused_moe.layer import FusedMoE
    from vllm.model_executor.layers.quantization.modelopt import ModelOptNvFp4Config

    layer = FusedMoE(
        num_experts=preset.num_experts, top_k=preset.top_k,
        hidden_size=preset.hidden_size, intermediate_size=preset.intermediate_size,
        activation=preset.activation,
        quant_config=ModelOptNvFp4Config.for_mode("w4a16"),
        moe_backend="flashinfer_b12x_emulated", place_w3w1_at_load=True,
    )  # fmt: skip
    with torch.no_grad():
        for name, value in tensors.items():
            getattr(layer, name).copy_(value)  # taken as [w3; w1]: rotated
    return layer


def _check_w4a16(preset, tensors) -> None:
    from vllm.model_executor.layers.quantization.utils.nvfp4_utils import (
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
            if not (torch.equal(got_w, want_w) and torch.equal(
                    got_s.view(torch.uint8), want_s.view(torch.uint8))):  # fmt: skip
                raise SystemExit(f"W4A16 {prefix} differs from the reference")


def _w4a16_bytes(tensors) -> dict[str, int]:
    nbytes = {s: 0 for s in [*W4A16_STEPS, "total"]}
    for prefix in ("w13", "w2"):
        nbytes[prefix] = sum(tensors[f"{prefix}_{k}"].numel()
                             for k in ("weight", "weight_scale"))  # fmt: skip
    nbytes["total"] = nbytes["w13"] + nbytes["w2"]
    return nbytes


def measure_w4a16(preset, tensors, repeats: int,
                  floors: dict[int, float] | None = None) -> dict:  # fmt: skip
    """Per W4A16 step: median time and the memcpy of the bytes it rewrites
    (``floors``: those memcpy times by byte count; measured here if None)."""
    times = _time_steps(lambda: _w4a16_layer(preset, tensors), repeats,
                        [*W4A16_STEPS, "total"])  # fmt: skip
    nbytes = _w4a16_bytes(tensors)
    if floors is None:
        floors = _time_memcpy(set(nbytes.values()), repeats)
    return {
        step: {
            "time_s": _median(v),
            "bytes": nbytes[step],
            "memcpy_s": floors[nbytes[step]],
        }  # fmt: skip
        for step, v in times.items()
    }


def _condition(busy: int, threads: int) -> str:
    if busy == 0:
        return "quiet"
    return f"{busy} busy process(es) on {threads} thread(s) each"


def format_w4a16(result: dict, condition: str = "quiet") -> str:
    lines = [
        f"W4A16 (FlashInfer's packed layout, in place; one thread, {condition}; "
        "memcpy: quiet)",
        f"{'step':<10}{'MiB':>7}{'memcpy':>10}{'time':>10}{'x memcpy':>10}",
    ]
    for step, rec in result.items():
        ratio = (f"{rec['time_s'] / rec['memcpy_s']:.1f}x" if rec["memcpy_s"]
                 else "-")  # fmt: skip
        lines.append(
            f"{step:<10}{rec['bytes'] / MIB:>7.0f}{rec['memcpy_s'] * 1e3:>8.1f}ms"
            f"{rec['time_s'] * 1e3:>8.1f}ms{ratio:>10}"
        )
    return "\n".join(lines)


def _cell(rec: dict) -> str:
    t, floor = rec["time_s"], rec["memcpy_s"]
    if t is None:
        return f"{'-':>9}{'':>7}"
    ratio = f"{t / floor:5.1f}x" if floor else "     -"
    return f"{t * 1e3:7.1f}ms{ratio:>7}"


def format_condition(label: str, result: dict) -> str:
    variants = ["alpha", "fold", "legacy"]
    lines = [
        label,
        f"{'step':<10}{'MiB':>7}{'memcpy':>10}"
        + "".join(f"{v:>16}" for v in variants)
        + "   (time, x the memcpy of its bytes)",
    ]
    for step in STEPS:
        f = result["fold"][step]  # the mode that moves the most
        lines.append(
            f"{step:<10}{f['bytes'] / MIB:>7.0f}{f['memcpy_s'] * 1e3:>8.1f}ms"
            + "".join(f"{_cell(result[v][step]):>16}" for v in variants)
        )
    lines.append(
        "(memcpy: quiet, of the bytes the fold mode moves; in alpha mode the fold "
        "moves nothing when w1 and w3 share a global scale)"
    )
    lt = result["legacy"]["total"]["time_s"]
    for mode in MODES:
        bt = result[mode]["total"]["time_s"]
        lines.append(f"whole layer, bounded {mode} vs legacy: {format_speedup(lt, bt)}")
    return "\n".join(lines)


def main() -> int:
    parser = CommandLineParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen3.6-35b-a3b",
                        choices=sorted(MOE_MODEL_PRESETS))  # fmt: skip
    parser.add_argument("--repeats", type=positive_int, default=5)
    parser.add_argument(
        "--busy-cores", type=core_count, default=1,
        help="processes that keep a core busy copying memory during the second "
        "measurement (0: quiet only)",
    )  # fmt: skip
    parser.add_argument(
        "--busy-threads", type=positive_int, default=1,
        help="intra-op threads of each busy process (default 1; 2 on a 2-core "
        "machine makes a neighbour that runs parallel operations itself)",
    )  # fmt: skip
    parser.add_argument(
        "--threads", type=positive_int, default=None,
        help="torch intra-op threads for the whole run (default: torch's)",
    )  # fmt: skip
    parser.add_argument(
        "--prep-threads", type=non_negative_int, default=None,
        help="threads of the bounded steps on CPU, i.e. VLLM_MOE_PREP_CPU_THREADS "
        "(default: its value, 1 when unset; 0: the run's torch setting)",
    )  # fmt: skip
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--w4a16", choices=["also", "only", "no"], default="also",
        help="time the W4A16 preparation's steps too (only: nothing else)",
    )  # fmt: skip
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    if args.prep_threads is not None:
        os.environ["VLLM_MOE_PREP_CPU_THREADS"] = str(args.prep_threads)
    preset = get_preset(args.model)
    tensors = synthetic_layer_tensors(preset, 1, torch.device("cpu"), args.seed)
    w4a16 = None
    if args.w4a16 != "no":
        _check_w4a16(preset, tensors)
        w4a16 = {}
        # the floors once, quiet, as for the W4A4 steps below
        w4a16_floors = _time_memcpy(set(_w4a16_bytes(tensors).values()),
                                    args.repeats)  # fmt: skip
        for busy in sorted({0, args.busy_cores}):
            with busy_cores(busy, args.busy_threads), moe_prep_threads(
                    torch.device("cpu")):  # fmt: skip
                w4a16[str(busy)] = measure_w4a16(preset, tensors, args.repeats,
                                                 w4a16_floors)  # fmt: skip
            print(format_w4a16(w4a16[str(busy)], _condition(busy, args.busy_threads)))
        if args.busy_cores:
            quiet = w4a16["0"]["total"]["time_s"]
            busy_s = w4a16[str(args.busy_cores)]["total"]["time_s"]
            print(f" W4A16: busy / quiet = {busy_s / quiet:.2f}x\n")
    if args.w4a16 == "only":
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"busy_cores": args.busy_cores, "w4a16": w4a16}, f,
                          indent=1)  # fmt: skip
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
    floors = _time_memcpy({b for per in nbytes.values() for b in per.values()},
                          args.repeats)  # fmt: skip
    conditions = {}
    for busy in sorted({0, args.busy_cores}):
        with busy_cores(busy, args.busy_threads):
            conditions[busy] = measure(preset, tensors, args.repeats, floors)
        label = _condition(busy, args.busy_threads)
        print("\n" + format_condition(label, conditions[busy]))
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
            json.dump({"header": header, "busy_cores": args.busy_cores,
                       "conditions": {str(k): v for k, v in conditions.items()},
                       "alternatives": alternatives, "w4a16": w4a16}, f,
                      indent=1)  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
