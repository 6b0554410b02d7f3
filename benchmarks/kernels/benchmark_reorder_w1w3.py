# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Benchmark reorder_w1w3_to_w3w1 against its predecessors and a memcpy.

For each gated model preset's w13 weight + block scale (one MoE layer) on each
device, time (median of --repeats):

  memcpy        dst.copy_(src) of the same bytes into a preallocated buffer:
                the achievable bandwidth (one read + one write per byte)
  split+cat     the pre-change reorder (returns a full new copy)
  clone-64MiB   the first in-place fix: clone a 64 MiB chunk, copy twice
  inplace       this implementation, default cap and a few smaller caps
  xor-swap      a zero-transient alternative measured for the record: the
                halves swapped by a ^= b, b ^= a, a ^= b on 8-byte words,
                2 MiB at a time (not used: see the design page)

Every variant's result is checked byte for byte against split+cat before it is
timed. Peak transient memory is measured in a separate, untimed call.

    python benchmarks/kernels/benchmark_reorder_w1w3.py --models qwen3.6-35b-a3b
"""

from __future__ import annotations

import json
import statistics
import time

import torch

from vllm.benchmarks.moe_weight_prep.baselines import (
    clone_chunk_reorder,
    split_cat_reorder,
)
from vllm.benchmarks.moe_weight_prep.busy_cores import busy_cores
from vllm.benchmarks.moe_weight_prep.presets import MOE_MODEL_PRESETS
from vllm.benchmarks.moe_weight_prep.synthetic_weights import synthetic_w13
from vllm.entrypoints.process_policy import preparing_weights
from vllm.model_executor.layers.fused_moe.weight_prep_state import wait_for_step
from vllm.model_executor.layers.quantization.utils import bounded_chunks
from vllm.model_executor.layers.quantization.utils.bounded_chunks import (
    DEFAULT_MAX_TRANSIENT_BYTES,
)
from vllm.model_executor.layers.quantization.utils.flashinfer_fp4_moe import (
    reorder_w1w3_to_w3w1,
)
from vllm.utils.argparse_utils import CommandLineParser, core_count, positive_int
from vllm.utils.mem_utils import measure_peak_memory

MIB = 1 << 20


def _median_time(fn, device, repeats: int, warmup: int = 1) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        wait_for_step(device)
        start = time.perf_counter()
        fn()
        wait_for_step(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def xor_swap_reorder(
    weight: torch.Tensor, scale: torch.Tensor, chunk_bytes: int = 2 << 20
) -> None:
    """[w1; w3] -> [w3; w1] along dim -2 with no buffer at all: three XOR
    passes per chunk on int64 words (each tensor's halves must be whole
    words). A chunk interrupted between its passes holds neither layout.
    Runs on the bounded steps' thread setting, like ``reorder_w1w3_to_w3w1``."""
    with preparing_weights(weight.device):
        _xor_swap(weight, scale, chunk_bytes)


def _xor_swap(weight, scale, chunk_bytes):
    for t in (weight, scale):
        e = t.shape[0]
        halves = t.reshape(e, 2, -1).view(torch.uint8).view(torch.int64)
        per = max(1, chunk_bytes // (halves.shape[2] * 8))
        for s in range(0, e, per):
            a, b = halves[s : s + per, 0], halves[s : s + per, 1]
            a.bitwise_xor_(b)
            b.bitwise_xor_(a)
            a.bitwise_xor_(b)


def _peak(fn, device) -> int:
    with measure_peak_memory(device) as mem:
        out = fn()
        del out
    return mem.peak_bytes


def bench_model(name: str, device: torch.device, repeats: int, caps: list[int]):
    preset = MOE_MODEL_PRESETS[name]
    weight, scale = synthetic_w13(preset, 1, device, seed=0)
    nbytes = weight.numel() + scale.numel()
    want_w, want_s = split_cat_reorder(weight, scale)
    original = (weight.clone(), scale.clone())

    def check(label):
        ok = torch.equal(weight, want_w) and torch.equal(
            scale.view(torch.uint8), want_s.view(torch.uint8)
        )
        if not ok:
            raise RuntimeError(f"{name}: {label} differs from split+cat")
        weight.copy_(original[0])
        scale.copy_(original[1])

    dst_w, dst_s = torch.empty_like(weight), torch.empty_like(scale)
    variants = {
        "memcpy": lambda: (dst_w.copy_(weight), dst_s.copy_(scale)),
        "split+cat": lambda: split_cat_reorder(weight, scale),
        "clone-64MiB": lambda: clone_chunk_reorder(weight, scale),
        "xor-swap": lambda: xor_swap_reorder(weight, scale),  # same threads:
    }
    for cap in caps:
        label = "inplace" + (
            "" if cap == DEFAULT_MAX_TRANSIENT_BYTES else f"-cap{cap // 1024}KiB"
        )
        variants[label] = lambda cap=cap: reorder_w1w3_to_w3w1(
            weight, scale, max_transient_bytes=cap
        )

    rows = []
    for label, fn in variants.items():
        if label not in ("memcpy", "split+cat"):
            fn()
            check(label)
        # In-place variants are involutions: repeated calls keep swapping,
        # which costs the same; the data is restored afterwards.
        t = _median_time(fn, device, repeats)
        peak = _peak(fn, device)
        weight.copy_(original[0])
        scale.copy_(original[1])
        rows.append({"variant": label, "time_s": t, "peak_transient_bytes": peak})
    memcpy_t = rows[0]["time_s"]
    for r in rows:
        r["effective_GBps"] = 2 * nbytes / r["time_s"] / 1e9
        r["ratio_to_memcpy"] = r["time_s"] / memcpy_t
    return {
        "model": name,
        "device": str(device),
        "bytes": nbytes,
        "weight_shape": list(weight.shape),
        "scale_shape": list(scale.shape),
        "rows": rows,
    }


def tile_sweep(name: str, device: torch.device, repeats: int, tiles_kib: list[int]):
    """Median time of the in-place swap for each bounce-buffer size."""
    preset = MOE_MODEL_PRESETS[name]
    weight, scale = synthetic_w13(preset, 1, device, seed=0)
    dst_w, dst_s = torch.empty_like(weight), torch.empty_like(scale)
    memcpy = _median_time(
        lambda: (dst_w.copy_(weight), dst_s.copy_(scale)), device, repeats
    )
    saved = dict(bounded_chunks._TILE_BYTES)
    rows = []
    try:
        for kib in tiles_kib:
            bounded_chunks._TILE_BYTES[device.type] = kib << 10
            t = _median_time(
                lambda: reorder_w1w3_to_w3w1(weight, scale), device, repeats
            )
            rows.append({"tile_kib": kib, "time_s": t, "ratio_to_memcpy": t / memcpy})
    finally:
        bounded_chunks._TILE_BYTES.clear()
        bounded_chunks._TILE_BYTES.update(saved)
    print(f"\ntile sweep, {name} on {device} (memcpy {memcpy * 1e3:.2f} ms)")
    for r in rows:
        print(
            f"  tile {r['tile_kib']:>6} KiB  {r['time_s'] * 1e3:8.2f} ms  "
            f"{r['ratio_to_memcpy']:.2f}x memcpy"
        )
    return {"model": name, "device": str(device), "memcpy_s": memcpy, "rows": rows}


def print_table(result):
    print(
        f"\n{result['model']} on {result['device']}: weight {result['weight_shape']}"
        f" + scale {result['scale_shape']} = {result['bytes'] / MIB:.1f} MiB"
    )
    print(
        f"{'variant':<18}{'median ms':>11}{'GB/s':>8}{'x memcpy':>10}"
        f"{'peak transient':>17}"
    )
    for r in result["rows"]:
        print(
            f"{r['variant']:<18}{r['time_s'] * 1e3:>11.2f}{r['effective_GBps']:>8.1f}"
            f"{r['ratio_to_memcpy']:>10.2f}"
            f"{r['peak_transient_bytes'] / MIB:>13.2f} MiB"
        )


def main():
    gated = [n for n, p in MOE_MODEL_PRESETS.items() if p.is_gated]
    parser = CommandLineParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=gated, choices=gated)
    parser.add_argument(
        "--devices",
        nargs="+",
        default=None,
        choices=["cpu", "cuda"],
        help="default: cpu, and cuda if present",
    )
    parser.add_argument("--repeats", type=positive_int, default=7)
    parser.add_argument(
        "--caps-kib",
        nargs="+",
        type=positive_int,
        default=[1024, 4096, 16384],
        help="extra max_transient_bytes values, in KiB, beside the 64 MiB default",
    )
    parser.add_argument(
        "--tile-sweep-kib",
        nargs="*",
        type=positive_int,
        default=None,
        help="also time the in-place swap with these bounce-buffer sizes (KiB), "
        "overriding the per-device tile: how the default tile was chosen",
    )
    parser.add_argument(
        "--busy-cores",
        type=core_count,
        default=0,
        help="processes keeping a core busy copying memory during the run",
    )
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args()
    if "cuda" in (args.devices or []) and not torch.cuda.is_available():
        parser.error("--devices cuda: no CUDA device is available")
    devices = args.devices or (
        ["cpu", "cuda"] if torch.cuda.is_available() else ["cpu"]
    )
    caps = [DEFAULT_MAX_TRANSIENT_BYTES] + [k * 1024 for k in args.caps_kib]
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} CPU threads, "
        f"{args.busy_cores} busy core(s)"
    )
    results = []
    sweeps = []
    with busy_cores(args.busy_cores):
        for dev in devices:
            for name in args.models:
                result = bench_model(name, torch.device(dev), args.repeats, caps)
                print_table(result)
                results.append(result)
        for dev in devices if args.tile_sweep_kib else []:
            for name in args.models:
                sweeps.append(
                    tile_sweep(
                        name, torch.device(dev), args.repeats, args.tile_sweep_kib
                    )
                )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {"torch": torch.__version__, "results": results, "tile_sweeps": sweeps},
                f,
                indent=2,
            )
        print(f"\nwrote {args.json}")


if __name__ == "__main__":
    main()
