# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Peak memory and time of each NVFP4 MoE preparation step, branch against
v0.34.0, on one device and without vLLM.

    PYTHONPATH=. python3 benchmarks/kernels/benchmark_nvfp4_moe_prep_cuda.py \\
        --device cuda --json prep_cuda.json

For machines with torch but no vLLM or FlashInfer (a lent H100/H200; the b12x
kernel itself needs SM120). The branch's definitions are read from this
repository's fragments of vLLM's files, which import vLLM and so cannot be
imported here: ``ast`` picks the one function out of the file and ``exec``
runs it in a namespace holding torch (``_branch``). The release's algorithm is
written below from its description, each function labelled ``v0.34.0``:

    PR 1  reorder_w1w3_to_w3w1   v0.34.0: swap the w1/w3 halves in chunks of
          rows of at most 64 MiB (all experts), each chunk through a clone;
          branch: one expert's half at a time through one buffer, in place.
    PR 2  swizzle_blockscale_    v0.34.0: zero-padded copy, then
          permute(...).contiguous(), a new tensor; branch: in place, one
          expert at a time.
    PR 3  global-scale fold      v0.34.0: ``(scale.float() * scale_2)`` back
          to FP8 over the whole block-scale tensor; branch: no fold, the block
          scales stay as loaded (so nothing to time; bytes differ by design).
    PR 4  W4A16 preparation      FlashInfer's own per-expert prepare: not here.

Per step and side, on the Qwen3.6-35B-A3B layer (E=256, H=2048, I=512): the
peak allocated above the start of the call (CUDA: the caching allocator's peak
statistics; CPU: torch.profiler's allocation events in order), the median time
of ``--repeats`` calls (each on a fresh copy, synchronized), effective GB/s
(tensor bytes / time) against a memcpy of the same bytes, and whether the
branch's output bytes equal the release's and differ from the input (exit
status 1 otherwise).
"""

import argparse
import ast
import functools
import json
import statistics
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
UTILS = REPO / "vllm/model_executor/layers/quantization/utils"
QWEN3_6_35B_A3B = (256, 2048, 512)  # experts, hidden, intermediate


def _branch(path: Path, name: str, **namespace):
    """The function ``name`` defined in ``path``, executed alone with torch
    (and ``namespace``) as its globals."""
    tree = ast.parse(path.read_text())
    node = next(n for n in tree.body if getattr(n, "name", None) == name)
    scope = {"torch": torch, **namespace}
    exec(compile(ast.Module([node], []), str(path), "exec"), scope)
    return scope[name]


# v0.34.0's reorder: halves swapped in chunks of rows (all experts at once) of
# at most 64 MiB, each chunk of the second half cloned first.
def release_reorder(weight, scale, dim=-2):
    d = dim % weight.dim()
    half = weight.size(d) // 2
    row_bytes = max(t.numel() // t.size(d) * t.element_size() for t in (weight, scale))
    rows = max(1, min(half, (64 << 20) // row_bytes))
    for start in range(0, half, rows):
        n = min(rows, half - start)
        for t in (weight, scale):
            w1, w3 = t.narrow(d, start, n), t.narrow(d, half + start, n)
            saved = w3.clone()
            w3.copy_(w1)
            w1.copy_(saved)
    return weight, scale


# v0.34.0's swizzle_blockscale for [E, M, K]: a zero-padded copy (M to 128,
# K to 4), viewed as [E, M/128, 4, 32, K/4, 4], permuted to
# [E, M/128, K/4, 32, 4, 4] and made contiguous: a new tensor. (Its final
# .cuda() is omitted: a no-op on CUDA tensors.)
def release_swizzle(scale):
    e, m, k = scale.shape
    mp, kp = -(-m // 128) * 128, -(-k // 4) * 4
    padded = scale.new_zeros(e, mp, kp)
    padded[:, :m, :k] = scale
    tiles = padded.view(e, mp // 128, 4, 32, kp // 4, 4)
    return tiles.permute(0, 1, 4, 3, 2, 5).contiguous().view(e, mp, kp)


# v0.34.0's fold of the global scale into the FP8 block scales (the b12x
# experts' process_weights_after_loading).
def release_fold(scale, scale_2):
    return (scale.float() * scale_2.view(-1, 1, 1)).to(scale.dtype)


def _peak_bytes(fn, args: tuple, device: torch.device) -> int:
    """Bytes allocated on ``device`` above the start while ``fn(*args)`` runs
    (what it returns included)."""
    if device.type == "cuda":
        _sync(device)
        start = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        fn(*args)
        _sync(device)
        return torch.cuda.max_memory_allocated() - start
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn(*args)
    level = peak = 0
    for event in sorted(prof.events(), key=lambda ev: ev.time_range.start):
        level += event.self_cpu_memory_usage
        peak = max(peak, level)
    return peak


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _median_s(fn, make_args, repeats: int, device: torch.device) -> float:
    """Median seconds of ``fn(*make_args())``, the arguments made untimed."""
    times = []
    for _ in range(repeats):
        args = make_args()
        _sync(device)
        start = time.perf_counter()
        fn(*args)
        _sync(device)
        times.append(time.perf_counter() - start)
        del args
    return statistics.median(times)


def _as_bytes(out) -> list[torch.Tensor]:
    """A step's output tensors (one, or a tuple) as uint8, to compare bytes."""
    return [
        t.contiguous().view(torch.uint8)
        for t in (out if isinstance(out, tuple) else (out,))
    ]


def _equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def _fresh(layer: dict, names: tuple) -> tuple:
    return tuple(layer[k].clone() for k in names)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", type=Path, help="write the figures here")
    args = parser.parse_args()
    device = torch.device(args.device)
    # The branch hands shapes needing padding to upstream's swizzle_blockscale.
    swizzle = _branch(
        UTILS / "nvfp4_utils.py",
        "swizzle_blockscale_",
        swizzle_blockscale=release_swizzle,
    )
    reorder = _branch(UTILS / "flashinfer_fp4_moe.py", "reorder_w1w3_to_w3w1")

    e, h, i = QWEN3_6_35B_A3B
    g = torch.Generator().manual_seed(0)
    layer = {
        "w13": torch.randint(
            0, 256, (e, 2 * i, h // 2), dtype=torch.uint8, generator=g
        ),
        "w13_scale": torch.rand(e, 2 * i, h // 16, generator=g) * 400 + 1,
        "w13_scale_2": torch.rand(e, generator=g) / 1e3,
        "w2_scale": torch.rand(e, h, i // 16, generator=g) * 400 + 1,
    }
    for k in ("w13_scale", "w2_scale"):
        layer[k] = layer[k].to(torch.float8_e4m3fn)
    layer = {k: v.to(device) for k, v in layer.items()}
    # step: (input names, branch function or None, release function)
    steps = {
        "pr1_reorder_w13": (("w13", "w13_scale"), reorder, release_reorder),
        "pr2_swizzle_w13_scale": (("w13_scale",), swizzle, release_swizzle),
        "pr2_swizzle_w2_scale": (("w2_scale",), swizzle, release_swizzle),
        "pr3_fold_w13_scale": (("w13_scale", "w13_scale_2"), None, release_fold),
    }

    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    codes = layer["w13"]
    dst = torch.empty_like(codes)
    copy_s = _median_s(dst.copy_, lambda: (codes,), args.repeats, device)
    memcpy_gbps = codes.nbytes / copy_s / 1e9
    del dst
    record = dict(device=name, torch=torch.__version__, shape=[e, h, i], steps=[])
    record["memcpy"] = dict(bytes=codes.nbytes, gbps=memcpy_gbps)
    print(f"{name}, torch {torch.__version__}; Qwen3.6-35B-A3B layer E={e} H={h} I={i}")
    print(f"memcpy of w13 ({codes.nbytes >> 20} MiB): {memcpy_gbps:.1f} GB/s")
    print(f"{'step':>22} {'side':>8} {'peak MiB':>9} {'ms':>8} {'GB/s':>7}  bytes")
    for step, (names, branch_fn, release_fn) in steps.items():
        fresh = functools.partial(_fresh, layer, names)
        outs = {}
        for side, fn in (("release", release_fn), ("branch", branch_fn)):
            row = dict(step=step, side=side)
            record["steps"].append(row)
            if fn is None:  # the branch keeps the block scales as loaded
                print(f"{step:>22} {side:>8} {'-':>9} {'-':>8} {'-':>7}  as loaded")
                continue
            outs[side] = _as_bytes(fn(*fresh()))
            row["peak_bytes"] = _peak_bytes(fn, fresh(), device)
            seconds = _median_s(fn, fresh, args.repeats, device)
            row["median_ms"] = seconds * 1e3
            row["gbps"] = sum(layer[k].nbytes for k in names) / seconds / 1e9
            verdict = ""
            if side == "branch":
                before = _as_bytes(tuple(layer[k] for k in names))
                row["equal_release"] = _equal(outs["branch"], outs["release"])
                row["changed_input"] = not _equal(outs["branch"], before)
                ok = row["equal_release"] and row["changed_input"]
                verdict = "equal" if ok else "DIFFER (or input unchanged)"
            print(
                f"{step:>22} {side:>8} {row['peak_bytes'] / 2**20:9.2f} "
                f"{row['median_ms']:8.2f} {row['gbps']:7.2f}  {verdict}"
            )
    if args.json:
        args.json.write_text(json.dumps(record, indent=1))
    bad = [
        r["step"]
        for r in record["steps"]
        if False in (r.get("equal_release"), r.get("changed_input"))
    ]
    raise SystemExit(f"branch bytes differ from the release's: {bad}" if bad else 0)


if __name__ == "__main__":
    main()
