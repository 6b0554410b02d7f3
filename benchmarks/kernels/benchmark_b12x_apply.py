# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Host time of one b12x experts ``apply``: the installed fork's against the
unmodified release's, side by side in one run.

    (cd tests/upstream && python ../../benchmarks/kernels/benchmark_b12x_apply.py)

Run in the upstream environment (README.md, "Tests inside vLLM 0.34.0 and
0.33.0 (CPU)"): the fork wheel installed, the unmodified release unpacked
(``build/fork/<release>/upstream``, imported in a subprocess ahead of
site-packages). Each side builds the layer with its own code (upstream's
ModelOpt method, ``moe_backend="flashinfer_b12x"``; the same synthetic
checkpoint), then times its experts' ``apply`` (upstream's 15 arguments)
down to FlashInfer 0.7.4's host code, the kernel launch stubbed (as
tests/upstream/test_fork_flashinfer_b12x_host.py stubs it): W4A4 and W4A16
checkpoints (the unmodified release runs a W4A16 one as W4A4), M = 1 and
64 tokens, a small layer and the Qwen3.6-35B-A3B layer. Per case: median
of ``--calls`` calls after ``--warmup``, each timed alone
(``time.perf_counter_ns``), in microseconds; the difference fork minus
upstream. Each side runs in a fresh interpreter, the two alternating
``--rounds`` times (default 2); per case the lower of a side's medians is
printed. ``--json`` writes every figure. One thread
(``torch.set_num_threads``), as a serving worker's host thread.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from unittest import mock

_REPO = Path(__file__).resolve().parents[2]
# The tests' CPU harness (stand-ins, upstream's layers): never the
# repository root, whose vllm/ would shadow the installed one.
sys.path.insert(0, str(_REPO / "tests" / "upstream"))

__all__ = ["CASES", "measure", "main"]

#: (shape name, checkpoint config) pairs; upstream_layers names them.
CASES = (
    ("small", "modelopt"),
    ("small", "modelopt-w4a16"),
    ("qwen3.6-35b-a3b", "modelopt"),
    ("qwen3.6-35b-a3b", "modelopt-w4a16"),
)
TOKENS = (1, 64)


@contextlib.contextmanager
def flashinfer_launch_stubbed() -> Iterator[None]:
    """FlashInfer 0.7.4's SM12x MoE dispatch runnable on CPU up to the kernel
    launch: CUDA version and device properties answered, the kernel
    getters and launches (W4A4's, W4A16's ``run_w4a16_moe``) no-ops, the
    platform's SM count answered as on CUDA, and
    ``B12xMoEWrapper`` made on the CPU (upstream's experts name no device)."""
    import flashinfer.jit.cpp_ext as cpp_ext
    import torch
    from flashinfer.fused_moe.cute_dsl.blackwell_sm12x import moe_dispatch as md

    from vllm.platforms import current_platform

    props = types.SimpleNamespace(
        multi_processor_count=48, major=12, minor=0, name="sm120", total_memory=16 << 30
    )

    def launch(*args, **kwargs):
        return None

    with contextlib.ExitStack() as stack:
        patch = stack.enter_context
        patch(
            mock.patch.object(
                cpp_ext,
                "get_cuda_version",
                lambda: types.SimpleNamespace(major=13, minor=0),
            )
        )
        patch(
            mock.patch.object(
                torch.cuda, "get_device_properties", lambda *a, **k: props
            )
        )
        patch(
            mock.patch.object(torch.cuda, "is_current_stream_capturing", lambda: False)
        )
        # The SM count as vLLM's CUDA platform answers it (the CPU platform
        # has none): the W4A16 call sizes FlashInfer's workspace by it.
        patch(
            mock.patch.object(
                current_platform,
                "num_compute_units",
                lambda device_id=0: props.multi_processor_count,
            )
        )
        for getter in (
            "_get_static_kernel",
            "_get_micro_kernel",
            "_get_dynamic_kernel",
        ):
            patch(mock.patch.object(md, getter, lambda *a, **k: (launch, 1)))
        patch(
            mock.patch.object(
                md, "_get_direct_micro_kernel", lambda *a, **k: (launch, 1, True)
            )
        )
        patch(
            mock.patch.object(md.MoEDirectMicroKernel, "launch", staticmethod(launch))
        )
        if hasattr(md, "run_w4a16_moe"):
            patch(
                mock.patch.object(
                    md, "run_w4a16_moe", lambda a, *r, **k: k.get("output")
                )
            )
        # Upstream's experts build the wrapper without a device ("cuda"):
        # the same wrapper, its buffers on the CPU.
        import flashinfer.fused_moe as fused_moe

        class _OnCpu(fused_moe.B12xMoEWrapper):
            def __init__(self, *args, device: str = "cpu", **kwargs):
                super().__init__(*args, device="cpu", **kwargs)

        patch(mock.patch.object(fused_moe, "B12xMoEWrapper", _OnCpu))
        md.clear_sm120_moe_caches()
        try:
            yield
        finally:
            md.clear_sm120_moe_caches()


def _apply_call(layer, x, weights, ids):
    method = layer.quant_method
    experts = method.moe_kernel.fused_experts
    out = x.new_empty(x.shape)
    args = (
        out,
        x,
        layer.w13_weight,
        layer.w2_weight,
        weights,
        ids,
        method.moe.activation,
        method.moe.num_experts,
        None,
        None,
        None,
        None,
        None,
        None,
        False,
    )

    def call() -> None:
        experts.apply(*args)

    return call


def measure(
    cases: list[tuple[str, str]], tokens: list[int], calls: int, warmup: int
) -> list[dict[str, Any]]:
    """Time ``apply`` of the running vllm's experts for each case (see the
    module doc); JSON-able rows."""
    import torch
    from upstream_reports import moe_inputs

    from cpu_stand_ins import b12x_preparation_on_cpu
    from upstream_layers import MOE_SHAPES, one_rank_vllm, prepare_layer

    torch.set_num_threads(1)
    rows = []
    with b12x_preparation_on_cpu(), flashinfer_launch_stubbed():
        for n, (shape_name, config) in enumerate(cases):
            shape = MOE_SHAPES[shape_name]
            with one_rank_vllm("flashinfer_b12x"), torch.inference_mode(False):
                layer, _, _ = prepare_layer(
                    shape, config, prefix=f"model.layers.{n}.mlp.experts"
                )
                experts = layer.quant_method.moe_kernel.fused_experts
                for m in tokens:
                    call = _apply_call(layer, *moe_inputs(shape, m, seed=m))
                    for _ in range(warmup):
                        call()
                    times = []
                    for _ in range(calls):
                        start = time.perf_counter_ns()
                        call()
                        times.append(time.perf_counter_ns() - start)
                    rows.append(
                        {
                            "shape": shape.id,
                            "config": config,
                            "tokens": m,
                            "experts": type(experts).__name__,
                            "weight_only": bool(getattr(experts, "weight_only", False)),
                            "median_us": statistics.median(times) / 1e3,
                            "p10_us": sorted(times)[calls // 10] / 1e3,
                            "calls": calls,
                        }
                    )
                del layer, experts
    return rows


_SNIPPET = """\
import sys
sys.path.insert(0, {bench!r})
import benchmark_b12x_apply as b
result = b.measure({cases!r}, {tokens!r}, {calls!r}, {warmup!r})
"""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--warmup", type=int, default=30)
    parser.add_argument("--tokens", type=int, nargs="+", default=list(TOKENS))
    parser.add_argument("--shapes", nargs="+", default=["small", "qwen3.6-35b-a3b"])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--json", type=Path, help="write the figures here")
    args = parser.parse_args(argv)
    if args.calls < 300 or args.warmup < 1 or args.rounds < 1:
        parser.error("--calls must be at least 300, --warmup and --rounds at least 1")
    from upstream_env import (
        UPSTREAM_VERSION,
        installed_vllm_problem,
        run_installed_json,
        run_unmodified_json,
        unmodified_tree_problem,
    )

    if problem := installed_vllm_problem() or unmodified_tree_problem():
        parser.exit(2, f"benchmark_b12x_apply: error: {problem}\n")
    cases = [c for c in CASES if c[0] in args.shapes]
    snippet = _SNIPPET.format(
        bench=str(Path(__file__).resolve().parent),
        cases=cases,
        tokens=args.tokens,
        calls=args.calls,
        warmup=args.warmup,
    )
    # Both sides in a fresh interpreter each, alternating, ``--rounds``
    # times: per case the lower of each side's medians (the round least
    # disturbed by other work on the machine).
    runs: dict[str, list] = {"fork": [], "upstream": []}
    for _ in range(args.rounds):
        runs["fork"].append(run_installed_json(snippet))
        runs["upstream"].append(run_unmodified_json(snippet))
    fork, upstream = (
        [
            min(rows, key=lambda r: r["median_us"])
            for rows in zip(*runs[side], strict=True)
        ]
        for side in ("fork", "upstream")
    )
    print(
        f"b12x experts apply, host time per call (median of {args.calls}; "
        f"FlashInfer launch stubbed; vLLM {UPSTREAM_VERSION})"
    )
    print(
        f"{'layer':>12} {'checkpoint':>15} {'M':>3} {'fork us':>9} "
        f"{'upstream us':>12} {'diff us':>8} {'p10 fork/upstream':>18}  fork mode"
    )
    for f, u in zip(fork, upstream, strict=True):
        mode = "W4A16" if f["weight_only"] else "W4A4"
        diff = f["median_us"] - u["median_us"]
        p10 = f"{f['p10_us']:.1f} / {u['p10_us']:.1f}"
        print(
            f"{f['shape']:>12} {f['config']:>15} {f['tokens']:>3} "
            f"{f['median_us']:9.1f} {u['median_us']:12.1f} {diff:+8.1f} {p10:>18}"
            f"  {mode}"
        )
    if args.json:
        record = {"release": UPSTREAM_VERSION, "fork": fork, "upstream": upstream}
        record["rounds"] = runs
        args.json.write_text(json.dumps(record, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
