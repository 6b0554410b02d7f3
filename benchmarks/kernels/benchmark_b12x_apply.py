# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Host time of one FlashInfer b12x experts ``apply``: branch against release.

    python benchmarks/kernels/benchmark_b12x_apply.py \\
        --release build/release/vllm-0.34.0 --rounds 3 --json b12x_apply.json

The branch is the installed vLLM (``build/source/vllm-0.34.0`` at
``nvfp4moe``); the release is a worktree of tag v0.34.0, imported ahead of it
(``PYTHONPATH``). Each side prepares a synthetic ModelOpt NVFP4 layer through
its own oracle functions (as ``_prepare_b12x`` in
tests/kernels/moe/test_flashinfer_b12x_moe.py) and times its experts' ``apply``
with FlashInfer 0.7.4's host code running on the CPU. The branch runs a W4A16
checkpoint on ``FlashInferB12xW4A16Experts``; the release runs it as W4A4.

Stubbed, because the kernels compile and run only on SM120/121: the CuTe DSL
kernel getters of ``blackwell_sm12x.moe_dispatch`` (``_get_static_kernel``,
``_get_micro_kernel``, ``_get_dynamic_kernel``, ``_get_direct_micro_kernel``:
JIT compilation; the kernel they return records its call, the W4A4 launch),
``MoEDirectMicroKernel.launch`` (the direct micro launch) and
``moe_dispatch.run_w4a16_moe`` (W4A16: it compiles and launches its kernels
and its host path needs CUDA tensors and stream, so the W4A16 figure stops
one call higher than the W4A4 one). Standing in for the device:
``torch.cuda.get_device_properties`` (188 SMs, SM120),
``is_current_stream_capturing``, FlashInfer's CUDA version, and
``B12xMoEWrapper`` allocating its workspaces on the CPU.

Before timing, each case's first call must reach exactly one launch carrying
the experts' own scales (branch W4A4: per-expert input scales and FC2 alpha;
W4A16: the prepared weights object) and both sides' outputs must have the same
shape. Each side runs in a fresh interpreter, the two alternating ``--rounds``
times; per case the median and 10th percentile of all rounds' ``--calls``
calls (after ``--warmup`` each), on one torch thread (the preparation too: a
loaded 2-core machine makes small parallel copies erratic), in microseconds.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path
from types import SimpleNamespace

import torch

# name: (experts, hidden, intermediate, top-k)
SHAPES = {"small": (8, 512, 256, 2), "qwen3.6-35b-a3b": (256, 2048, 512, 8)}
CHECKPOINTS = ("w4a4", "w4a16")
TOKENS = (1, 64)
_NAMES = ("w13", "w13_scale", "w13_scale_2", "a13_scale")
_NAMES += ("w2", "w2_scale", "w2_scale_2", "a2_scale")
# What each side's experts hand the launch, where they have it (the release:
# its FC2 input scale; the branch: input scales and FC2 alpha, or W4A16's
# prepared weights).
_OWN = ("_fc1_input_scale", "_fc2_input_scale", "_w2_alpha", "_weights")


def _stand_ins(release: bool) -> list:
    """Device stand-ins and the launch stubs; returns the launch records."""
    import flashinfer.fused_moe as fused_moe
    import flashinfer.jit.cpp_ext as cpp_ext
    from flashinfer.fused_moe.cute_dsl.blackwell_sm12x import moe_dispatch as md

    props = SimpleNamespace(multi_processor_count=188, major=12, minor=0)
    torch.cuda.get_device_properties = lambda *a, **k: props
    torch.cuda.is_current_stream_capturing = lambda: False
    cpp_ext.get_cuda_version = lambda: SimpleNamespace(major=13, minor=0)
    if release:  # the release's swizzle_blockscale ends in .cuda()
        torch.Tensor.cuda = lambda self, *a, **k: self

    class _OnCpu(fused_moe.B12xMoEWrapper):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **{**kwargs, "device": "cpu"})

    fused_moe.B12xMoEWrapper = _OnCpu
    launches: list = []

    def kernel(*args, **kwargs):
        launches.append([*args, *kwargs.values()])

    md._get_static_kernel = md._get_micro_kernel = lambda *a, **k: (kernel, 1)
    md._get_dynamic_kernel = lambda *a, **k: (kernel, 1)
    md._get_direct_micro_kernel = lambda *a, **k: (kernel, 1, True)
    md.MoEDirectMicroKernel.launch = staticmethod(lambda _, **k: kernel(**k))
    md.run_w4a16_moe = lambda *a, **k: kernel(*a, **k) or k["output"]
    return launches


def _prepare(shape: tuple, checkpoint: str):
    """A synthetic ModelOpt NVFP4 layer through this side's FLASHINFER_B12X
    preparation, as the quant method runs it; returns (experts, layer,
    seconds the preparation took)."""
    from tests.kernels.moe.utils import make_dummy_moe_config
    from vllm.model_executor.layers.fused_moe.activation import MoEActivation
    from vllm.model_executor.layers.fused_moe.oracle import nvfp4
    from vllm.model_executor.layers.quantization.utils import quant_utils as qu

    e, h, i, topk = shape
    use_a16 = checkpoint == "w4a16"
    backend = nvfp4.NvFp4MoeBackend.FLASHINFER_B12X
    moe = make_dummy_moe_config(
        num_experts=e, experts_per_token=topk, hidden_dim=h, intermediate_size=i
    )
    layer = SimpleNamespace(activation=MoEActivation.SILU, moe_config=moe)
    g = torch.Generator().manual_seed(0)
    rand = lambda *size: torch.rand(size, generator=g)  # noqa: E731
    codes = [
        torch.randint(0, 256, s, dtype=torch.uint8, generator=g)
        for s in ((e, 2 * i, h // 2), (e, h, i // 2))
    ]
    scales = [
        (rand(*s) * 400 + 1).to(torch.float8_e4m3fn)
        for s in ((e, 2 * i, h // 16), (e, h, i // 16))
    ]
    ckpt = (codes[0], scales[0], rand(e) / 1e3, rand(e, 2) / 1e2)
    ckpt += (codes[1], scales[1], rand(e) / 1e3, rand(e) / 1e2)
    start = time.perf_counter()
    t = nvfp4.convert_to_nvfp4_moe_kernel_format(
        backend, layer, *ckpt, is_act_and_mul=True, use_a16=use_a16
    )
    t = dict(zip(_NAMES, t, strict=True))
    scale_args = {k: v for k, v in t.items() if k not in ("w13", "w2")}
    quant_config = nvfp4.make_nvfp4_moe_quant_config(
        backend, **scale_args, layer=layer, use_a16=use_a16
    )
    activation_key = None if use_a16 else qu.kNvfp4Dynamic
    experts_cls = next(
        cls
        for cls in nvfp4.backend_to_kernel_cls(backend)
        if cls._supports_quant_scheme(qu.kNvfp4Static, activation_key)
    )
    kernel = nvfp4.make_nvfp4_moe_kernel(quant_config, moe, experts_cls, backend)
    for w in ("w13", "w2"):  # the parameters as replace_parameter leaves them
        setattr(layer, f"{w}_weight", t[w])
        setattr(layer, f"{w}_weight_scale", t[f"{w}_scale"])
        setattr(layer, f"{w}_weight_scale_2", t[f"{w}_scale_2"])
    kernel.fused_experts.process_weights_after_loading(layer)
    return kernel.fused_experts, layer, time.perf_counter() - start


def _reached(launch: list, want) -> bool:
    """Whether ``want`` (an object, or a tensor's values) is an argument of
    the recorded ``launch``."""
    if isinstance(want, torch.Tensor):
        return any(isinstance(a, torch.Tensor) and torch.equal(a, want) for a in launch)
    return any(a is want for a in launch)


def _worker(side: str, shapes: list[str], calls: int, warmup: int, out: Path):
    import vllm
    from vllm.model_executor.layers.fused_moe.activation import MoEActivation

    sys.path.insert(0, str(Path(vllm.__file__).parents[1]))  # its tests/
    warnings.filterwarnings("ignore")
    launches = _stand_ins(side == "release")
    torch.set_num_threads(1)
    rows = []
    for shape_name in shapes:
        e, h, _, topk = SHAPES[shape_name]
        for checkpoint in CHECKPOINTS:
            experts, layer, seconds = _prepare(SHAPES[shape_name], checkpoint)
            key = dict(shape=shape_name, checkpoint=checkpoint, prepare_s=seconds)
            key.update(experts=type(experts).__name__)
            for m in TOKENS:
                g = torch.Generator().manual_seed(m)
                x = torch.randn(m, h, generator=g).bfloat16()
                ids = torch.stack([torch.randperm(e, generator=g)[:topk] for _ in x])
                routing = torch.rand(m, topk, generator=g).softmax(-1)
                args = (x.new_empty(x.shape), x, layer.w13_weight, layer.w2_weight)
                args += (routing, ids, MoEActivation.SILU, e, *[None] * 6, False)
                # Before timing: one launch, given this side's own scales.
                launches.clear()
                experts.apply(*args)
                own = [n for n in _OWN if hasattr(experts, n)]
                if len(launches) != 1 or not all(
                    _reached(launches[0], getattr(experts, n)) for n in own
                ):
                    raise RuntimeError(f"{side} {shape_name} {checkpoint} M={m}")
                for _ in range(warmup):
                    experts.apply(*args)
                times = []
                for _ in range(calls):
                    t0 = time.perf_counter_ns()
                    experts.apply(*args)
                    times.append((time.perf_counter_ns() - t0) / 1e3)
                row = dict(key, tokens=m, reached_launch=own, us=times)
                rows.append(dict(row, output=list(args[0].shape)))
            del experts, layer
    out.write_text(json.dumps({"vllm": vllm.__file__, "rows": rows}))


def main() -> None:
    repo = Path(__file__).resolve().parents[2]
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--release", type=Path, default=repo / "build/release/vllm-0.34.0"
    )
    parser.add_argument("--shapes", nargs="+", choices=SHAPES, default=list(SHAPES))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--warmup", type=int, default=30)
    parser.add_argument("--json", type=Path, help="write the figures here")
    parser.add_argument(
        "--worker", choices=("branch", "release"), help=argparse.SUPPRESS
    )
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return _worker(args.worker, args.shapes, args.calls, args.warmup, args.out)

    release = str(args.release.resolve())
    runs: dict[str, list] = {"branch": [], "release": []}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for side in runs:
                env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
                env.update({"PYTHONPATH": release} if side == "release" else {})
                out = Path(tmp, f"{side}{r}.json")
                cmd = [sys.executable, __file__, "--worker", side, "--out", str(out)]
                cmd += ["--calls", str(args.calls), "--warmup", str(args.warmup)]
                subprocess.run(
                    [*cmd, "--shapes", *args.shapes],
                    env=env,
                    check=True,
                    stdout=subprocess.DEVNULL,
                )
                runs[side].append(json.loads(out.read_text()))
    trees = {side: runs[side][0]["vllm"] for side in runs}
    if trees["branch"].startswith(release) or not trees["release"].startswith(release):
        sys.exit(f"wrong vllm imported: {trees}")
    print(f"b12x experts apply, host us per call ({args.rounds} x {args.calls} calls)")
    print(f"branch:  {trees['branch']}\nrelease: {trees['release']}")
    print(
        f"{'layer':>15} {'ckpt':>5} {'M':>2} {'branch experts':>26} {'branch':>8} "
        f"{'release':>8} {'diff':>7}  p10 branch/release"
    )
    record = []
    for n, row in enumerate(runs["branch"][0]["rows"]):
        fig = {}
        for side in runs:
            rows = [run["rows"][n] for run in runs[side]]
            if rows[0]["output"] != row["output"] or rows[0]["tokens"] != row["tokens"]:
                sys.exit(f"outputs differ: {row} vs {rows[0]}")
            per_round = [statistics.median(r["us"]) for r in rows]
            us = sorted(t for r in rows for t in r.pop("us"))
            fig[side] = dict(rows[0], median_us=statistics.median(us))
            fig[side].update(p10_us=us[len(us) // 10], round_medians_us=per_round)
        b, r = fig["branch"], fig["release"]
        print(
            f"{row['shape']:>15} {row['checkpoint']:>5} {row['tokens']:>2} "
            f"{b['experts']:>26} {b['median_us']:8.1f} {r['median_us']:8.1f} "
            f"{b['median_us'] - r['median_us']:+7.1f}  "
            f"{b['p10_us']:.1f}/{r['p10_us']:.1f}"
        )
        record.append(fig)
    print("The release runs W4A16 checkpoints as W4A4 (FlashInferB12xExperts); the")
    print("branch's W4A16 figures stop at run_w4a16_moe, the W4A4 ones deeper.")
    if args.json:
        args.json.write_text(json.dumps({"trees": trees, "rows": record}, indent=1))


if __name__ == "__main__":
    main()
