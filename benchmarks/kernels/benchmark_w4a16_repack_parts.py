# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Where the in-place W4A16 repack's time goes, per expert, on one thread.

For one expert of a preset's w13 (uint8 [2I, H/2] codes, float8 [2I, H/16]
block scales), the parts of ``flashinfer_w4a16_moe``'s path A chunk, each
timed alone (median of --repeats) beside two memcpy floors of the expert's
codes (from cache; and the layer-wide copy's rate, the expert's share of a
memcpy of all E experts):

  fill        rows copied into the 8 planes (``_Planes.fill`` less the shuffle)
  bit steps   the four delta-swap steps (``_shuffle_planes``)
  write-back  the planes written to the expert's storage in 64-byte blocks
  whole       ``repack_w4a16_weight_`` per expert, over all E experts
  scales      ``pack_w4a16_blockscale_`` per expert, over all E experts

The same again with --busy-cores processes copying memory on other cores.
With --torch-compile, also the chunk (fill, bit steps and write-back) as one
``torch.compile`` function: its time per expert after a first call, and the
compilation time (seconds; a C++ compiler is needed). Every variant is
checked against the reference (``flashinfer_w4a16_layout.w4a16_pack_weight``) first.

    python benchmarks/kernels/benchmark_w4a16_repack_parts.py \\
        --model qwen3.6-35b-a3b --busy-cores 1 --torch-compile
"""

from __future__ import annotations

import statistics
import time

import torch

from vllm.benchmarks.moe_weight_prep.busy_cores import busy_cores
from vllm.benchmarks.moe_weight_prep.presets import MOE_MODEL_PRESETS, get_preset
from vllm.model_executor.layers.quantization.utils import flashinfer_w4a16_moe as w4
from vllm.model_executor.layers.quantization.utils.flashinfer_w4a16_layout import (
    w4a16_pack_weight,
)
from vllm.utils.argparse_utils import CommandLineParser, core_count, positive_int

MIB = 1 << 20


def _median_ms(fn, repeats: int) -> float:
    fn()  # warm up (and first-touch every buffer)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def _compiled_chunk():
    """The path A chunk as one function for ``torch.compile``: int64 strips
    [g, nt, 64, kt] -> the expert's words [g, kt, nt, col, tr, wh]."""
    masks = (w4._NIBBLE_MASK, w4._EVEN_BYTES, w4._MID_UNIT, w4._LOW_WORD)

    def swap(x, y, shift, mask):  # across two words
        t = ((x >> shift) ^ y) & mask
        return x ^ (t << shift), y ^ t

    def inner(x, shift, mask):  # inside each word
        t = ((x >> shift) ^ x) & mask
        return x ^ t ^ (t << shift)

    def chunk(src):
        g, nt, _, kt = src.shape
        v = src.view(g, nt, 2, 2, 2, 8, kt)  # [g, nt, wh, wl, c, col, kt]
        p = {
            (wl, c, wh): v[:, :, wh, wl, c]
            for wl in range(2)
            for c in range(2)
            for wh in range(2)
        }
        p = {key: inner(x, 28, masks[0]) for key, x in p.items()}
        for wl in range(2):
            for wh in range(2):
                p[wl, 0, wh], p[wl, 1, wh] = swap(
                    p[wl, 0, wh], p[wl, 1, wh], 8, masks[1]
                )
        p = {key: inner(x, 16, masks[2]) for key, x in p.items()}
        for c in range(2):
            for wh in range(2):
                p[0, c, wh], p[1, c, wh] = swap(p[0, c, wh], p[1, c, wh], 32, masks[3])
        # slot tr*2 + wh holds plane (wl, c, wh) with tr = wl*2 + c
        out = torch.stack(
            [p[tr // 2, tr % 2, wh] for tr in range(4) for wh in range(2)], dim=-1
        )
        return out.permute(0, 3, 1, 2, 4).contiguous()

    return chunk


def measure(preset, repeats: int, compiled) -> dict[str, float]:
    n, k, e = 2 * preset.intermediate_size, preset.hidden_size, preset.num_experts
    nt, kt = n // 64, k // 16
    gen = torch.Generator().manual_seed(0)
    weight = torch.randint(0, 256, (e, n, k // 2), dtype=torch.uint8, generator=gen)
    scale = torch.randint(
        0, 0x7E, (e, n, k // 16), dtype=torch.uint8, generator=gen
    ).view(torch.float8_e4m3fn)
    copy = torch.empty_like(weight)
    rows = weight.view(torch.int64).view(e * n, kt)
    strips = weight.view(torch.int64).view(e, nt, 64, kt)
    work = w4._Planes(rows, nt, kt)
    planes = work.view(nt)
    dst = planes.view(2, 2, 2, nt, 8, kt)
    r = {
        "memcpy (cached)": _median_ms(lambda: copy[0].copy_(weight[0]), repeats),
        "memcpy (layer rate)": _median_ms(lambda: copy.copy_(weight), repeats) / e,
        "fill": _median_ms(lambda: dst.copy_(w4._as_planes(strips[0])), repeats),
        "bit steps": _median_ms(
            lambda: w4._shuffle_planes(planes, work.scratch), repeats
        ),
        "write-back": _median_ms(
            lambda: (
                copy.view(torch.int64)
                .view(e, kt, nt, 8, 4, 2)[0]
                .copy_(w4._expert_view(planes, 1, nt, kt)[0])
            ),
            repeats,
        ),
    }
    fresh = weight.clone()
    r["whole"] = (
        _median_ms(
            lambda: w4.repack_w4a16_weight_(weight.copy_(fresh)), max(1, repeats // 4)
        )
        / e
    )
    r["whole"] -= r["memcpy (layer rate)"]  # less the reset of the input
    fresh_s = scale.clone()
    few = max(1, repeats // 4)
    reset = _median_ms(lambda: scale.copy_(fresh_s), few) / e
    r["scales"] = (
        _median_ms(lambda: w4.pack_w4a16_blockscale_(scale.copy_(fresh_s), 0), few) / e
        - reset
    )
    if compiled is not None:
        blocks = copy.view(torch.int64).view(e, kt, nt, 8, 8)
        r["torch.compile chunk"] = _median_ms(
            lambda: blocks[0:1].copy_(compiled(strips[0:1])), repeats
        )
    return r


def main() -> int:
    parser = CommandLineParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--model", default="qwen3.6-35b-a3b", choices=sorted(MOE_MODEL_PRESETS)
    )
    parser.add_argument("--repeats", type=positive_int, default=20)
    parser.add_argument("--busy-cores", type=core_count, default=1)
    parser.add_argument("--torch-compile", action="store_true")
    args = parser.parse_args()
    preset = get_preset(args.model)
    torch.set_num_threads(1)
    n, k = 2 * preset.intermediate_size, preset.hidden_size
    # Correctness first: the repack, and the compiled chunk when asked for.
    w = torch.randint(0, 256, (2, n, k // 2), dtype=torch.uint8)
    want = w4a16_pack_weight(w)
    if not torch.equal(w4.repack_w4a16_weight_(w.clone()), want):
        raise SystemExit("repack_w4a16_weight_ differs from the reference")
    compiled = None
    if args.torch_compile:
        start = time.perf_counter()
        compiled = torch.compile(_compiled_chunk(), dynamic=False, fullgraph=True)
        got = compiled(w.view(torch.int64).view(2, n // 64, 64, k // 16))
        print(
            f"torch.compile: first call (compilation) "
            f"{time.perf_counter() - start:.1f} s"
        )
        if not torch.equal(got.reshape(-1), want.view(torch.int64).reshape(-1)):
            raise SystemExit("the compiled chunk differs from the reference")
    print(
        f"{preset.name}: one w13 expert, codes {n * k // 2 / MIB:.2f} MiB, "
        f"block scales {n * k // 16 / MIB:.3f} MiB; one thread, median ms"
    )
    for busy in sorted({0, args.busy_cores}):
        with busy_cores(busy):
            r = measure(preset, args.repeats, compiled)
        label = "quiet" if busy == 0 else f"{busy} busy core(s)"
        print(f"\n{label}")
        for name, ms in r.items():
            print(f"  {name:<22}{ms:8.3f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
