# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Per-MoE-layer peak memory and time of NVFP4 weight preparation for the
FlashInfer b12x kernels, inside vLLM 0.34.0's own loader: release vs branch.

    synthetic NVFP4 checkpoint (nvfp4_checkpoint.py), or --checkpoint DIR
        |
        v   for pass in (timed, profiled), for side in (release, branch):
    worker subprocess (python moe_weight_prep.py _worker ...), its own vllm:
        CPU stand-ins (vllm_cpu_stand_ins.py)
        EngineArgs(moe_backend="flashinfer_b12x", ...).create_engine_config()
        one-rank gloo world, get_model_loader(...).load_model(...):
            initialize_model -> load_weights -> process_weights_after_loading
                each MoE layer's quant_method.process_weights_after_loading
                wrapped for the call: measured, nothing else changed
        |
        v
    JSON per layer {release, branch}: peak_bytes (torch's CPU allocations
    above the start, profiled pass), peak_rss_bytes and seconds (timed pass,
    no profiler), resident_bytes after; plot of the peaks.

Accuracy check before the figures: each layer's prepared codes, and its block
scales with the per-expert global scale folded in as the release folds it,
must be byte-identical on both sides (sha256 per tensor).
"""

import argparse
import gc
import hashlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path
from unittest import mock

from nvfp4_checkpoint import FORMATS, PRESETS, write_checkpoint

__all__ = ["main"]

_HERE = Path(__file__).resolve().parent
_RELEASE_TREE = _HERE.parent / "build" / "release" / "vllm-0.34.0"
_SIDES = ("release", "branch")
_PASSES = ("timed", "profiled")
_MARK = "@@moe-layer-done "
_MiB = 1 << 20


# ---- worker: runs in its own process, with the side's vllm on sys.path ----


def _proc_status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024  # kB
    raise RuntimeError(f"{field} not in /proc/self/status")


def _running_peak(events) -> int:
    """Peak of the running sum of torch's CPU allocations, in event order."""
    run = peak = 0
    for e in sorted(events, key=lambda e: e.time_range.start):
        run += e.self_cpu_memory_usage
        peak = max(peak, run)
    return peak


def _measured(prepare, profiled: bool, name: str):
    """Returns `call(layer)`, which runs `prepare(layer)`, and the dict that
    `call` fills with its figures."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    figures: dict = {}

    def call(layer):
        gc.collect()
        if profiled:
            with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as p:
                prepare(layer)
            figures["peak_bytes"] = _running_peak(p.events())
            print(_MARK + name, flush=True)
            return
        rss = _proc_status("VmRSS")
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # VmHWM := VmRSS
        start = time.perf_counter()
        prepare(layer)
        figures["seconds"] = time.perf_counter() - start
        figures["peak_rss_bytes"] = _proc_status("VmHWM") - rss
        tensors = [*layer.parameters(), *layer.buffers()]
        storages = {
            t.untyped_storage().data_ptr(): t.untyped_storage() for t in tensors
        }
        figures["resident_bytes"] = sum(s.nbytes() for s in storages.values())
        figures["torch_threads"] = torch.get_num_threads()
        print(_MARK + name, flush=True)

    return call, figures


def _digests(layer) -> dict[str, str]:
    """sha256 of the prepared codes, and of the block scales times the
    per-expert global scale as the release folds them (`scale.float() *
    scale_2 -> fp8`; its own scale_2 is then 1)."""
    import torch

    def sha(*tensors):
        h = hashlib.sha256()
        for t in tensors:
            h.update(t.contiguous().view(torch.uint8).reshape(-1).numpy())
        return h.hexdigest()

    out = {}
    for w in ("w13", "w2"):
        scale = getattr(layer, f"{w}_weight_scale")
        scale_2 = getattr(layer, f"{w}_weight_scale_2").reshape(-1)
        folded = (
            (s.float() * g).to(s.dtype) for s, g in zip(scale, scale_2, strict=True)
        )
        out[f"{w}_weight"] = sha(getattr(layer, f"{w}_weight"))
        out[f"{w}_weight_scale_folded"] = sha(*folded)
    return out


def _vllm_identity() -> dict:
    import vllm

    root = Path(vllm.__file__).resolve().parent.parent

    def git(*args: str) -> str:
        env = {**os.environ, "GIT_OPTIONAL_LOCKS": "0"}  # read only
        r = subprocess.run(
            ["git", "-C", str(root), *args], capture_output=True, text=True, env=env
        )
        return r.stdout.strip() if r.returncode == 0 else ""

    describe = git("describe", "--tags", "--always")
    dirty = bool(git("status", "--porcelain", "--untracked-files=no", "vllm"))
    return {
        "path": str(root),
        "version": vllm.__version__,
        "describe": describe + ("-dirty" if dirty else ""),
        "commit": git("rev-parse", "HEAD"),
    }


def _worker(side: str, mode: str, checkpoint: str, result: str) -> None:
    from vllm_cpu_stand_ins import (
        b12x_backend_selectable,
        cpu_worker_torch_patches,
        cuda_is_identity,
        dense_layers_unpacked,
        triton_reported_present,
    )

    layers: dict[str, dict] = {}
    with ExitStack() as stack:
        stack.enter_context(cpu_worker_torch_patches())
        from vllm.config import set_current_vllm_config
        from vllm.distributed import (
            init_distributed_environment,
            initialize_model_parallel,
        )
        from vllm.engine.arg_utils import EngineArgs
        from vllm.model_executor.layers.fused_moe.fused_moe_method_base import (
            FusedMoEMethodBase,
        )
        from vllm.model_executor.model_loader import base_loader, get_model_loader

        with triton_reported_present():
            cfg = EngineArgs(
                model=checkpoint,
                moe_backend="flashinfer_b12x",
                dtype="bfloat16",
                enforce_eager=True,
                skip_tokenizer_init=True,
                max_model_len=128,
                load_format="safetensors",
            ).create_engine_config()
        stack.enter_context(b12x_backend_selectable())
        stack.enter_context(dense_layers_unpacked())
        if side == "release":
            stack.enter_context(cuda_is_identity())

        process_all = base_loader.process_weights_after_loading

        def process_measured(model, model_config, target_device):
            wrapped = []
            for name, module in model.named_modules():
                method = getattr(module, "quant_method", None)
                if isinstance(method, FusedMoEMethodBase):
                    prepare = method.process_weights_after_loading
                    call, layers[name] = _measured(prepare, mode == "profiled", name)
                    method.process_weights_after_loading = call
                    wrapped.append(method)
            process_all(model, model_config, target_device)
            for method in wrapped:
                del method.process_weights_after_loading

        store = stack.enter_context(tempfile.TemporaryDirectory())
        stack.enter_context(set_current_vllm_config(cfg))
        init_distributed_environment(
            world_size=1,
            rank=0,
            local_rank=0,
            distributed_init_method=f"file://{store}/store",
            backend="gloo",
        )
        initialize_model_parallel(1, 1)
        # Warm-up: the first layer would import FlashInfer (about 600 modules,
        # 50 MiB) inside its measurement, via flashinfer_convert_sf_to_mma_layout.
        import flashinfer  # noqa: F401

        loader = get_model_loader(cfg.load_config)
        with mock.patch.object(
            base_loader, "process_weights_after_loading", process_measured
        ):
            model = loader.load_model(vllm_config=cfg, model_config=cfg.model_config)
        if mode == "timed":
            for name in layers:
                layers[name]["digests"] = _digests(model.get_submodule(name))
    Path(result).write_text(json.dumps({"vllm": _vllm_identity(), "layers": layers}))


# ---- driver ----


def _run_worker(side: str, mode: str, args, checkpoint: Path, bar) -> dict:
    env = {**os.environ, "VLLM_TARGET_DEVICE": "cpu"}
    if args.threads:
        env["OMP_NUM_THREADS"] = str(args.threads)  # read when torch loads
    tree = args.release_vllm if side == "release" else args.branch_vllm
    if tree is not None:
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in (str(tree), env.get("PYTHONPATH")) if p
        )
    log = Path(args.out) / f"{side}-{mode}.log"
    result = Path(args.out) / f".{side}-{mode}.json"
    cmd = [sys.executable, __file__, "_worker", side, mode, str(checkpoint)]
    bar.set_description(f"{side} {mode}")
    with open(log, "w") as f:
        proc = subprocess.Popen(
            [*cmd, str(result)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for line in proc.stdout:
            if line.startswith(_MARK):
                bar.update()
            f.write(line)
    if proc.wait() != 0:
        tail = "".join(log.read_text().splitlines(keepends=True)[-30:])
        raise SystemExit(f"{side} {mode} worker failed ({log}):\n{tail}")
    data = json.loads(result.read_text())
    result.unlink()
    return data


def _progress(total: int | None):
    try:
        from tqdm import tqdm
    except ImportError:
        return _SimpleBar(total)
    return tqdm(total=total, unit="layer", file=sys.stderr)


class _SimpleBar:
    def __init__(self, total: int | None):
        self.n, self.total, self.desc = 0, total, ""

    def set_description(self, desc: str) -> None:
        self.desc = desc
        self.update(0)

    def update(self, n: int = 1) -> None:
        self.n += n
        print(f"\r{self.desc}: {self.n}/{self.total or '?'}", end="", file=sys.stderr)

    def close(self) -> None:
        print(file=sys.stderr)


def _merge(model: str, checkpoint: Path, runs: dict) -> dict:
    layers: dict[str, dict] = {}
    for side in _SIDES:
        ident = runs[side]["timed"]["vllm"]
        tag = f"{ident['version']} {ident['describe']} ({ident['path']})"
        for name, timed in runs[side]["timed"]["layers"].items():
            profiled = runs[side]["profiled"]["layers"][name]
            layers.setdefault(name, {})[side] = {
                "peak_bytes": profiled["peak_bytes"],
                "peak_rss_bytes": timed["peak_rss_bytes"],
                "seconds": timed["seconds"],
                "resident_bytes": timed["resident_bytes"],
                "torch_threads": timed["torch_threads"],
                "digests": timed["digests"],
                "vllm": tag,
            }
    for entry in layers.values():
        entry["identical"] = entry["release"]["digests"] == entry["branch"]["digests"]
    # Peaks do not add up across layers (each transient is gone before the
    # next layer): the total is the largest; time and residency add up.
    total = {
        side: {
            "layers": len(layers),
            "peak_bytes": max(e[side]["peak_bytes"] for e in layers.values()),
            "peak_rss_bytes": max(e[side]["peak_rss_bytes"] for e in layers.values()),
            "seconds": sum(e[side]["seconds"] for e in layers.values()),
            "median_seconds": statistics.median(
                e[side]["seconds"] for e in layers.values()
            ),
            "resident_bytes": sum(e[side]["resident_bytes"] for e in layers.values()),
        }
        for side in _SIDES
    }
    total["identical"] = all(e["identical"] for e in layers.values())
    return {
        "model": model,
        "checkpoint": str(checkpoint),
        "vllm": {side: runs[side]["timed"]["vllm"] for side in _SIDES},
        "layers": layers,
        "total": total,
    }


def _plot(report: dict, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"matplotlib is not installed: no plot ({path})")
        return
    names = list(report["layers"])
    fig, ax = plt.subplots(figsize=(max(6, len(names) * 0.3), 4))
    for side in _SIDES:
        peaks = [report["layers"][n][side]["peak_bytes"] / _MiB for n in names]
        ax.plot(range(len(names)), peaks, marker="o", label=side)
    ax.set_yscale("log")
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.set_xlabel("MoE layer")
    ax.set_ylabel("peak transient (MiB, torch CPU allocations)")
    ax.set_title(f"{report['model']}: process_weights_after_loading per MoE layer")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    print(f"plot: {path}")


def _print_table(report: dict) -> None:
    print(f"{'MoE layer':<44} {'peak MiB rel/branch':>22} {'RSS MiB':>15} {'s':>13}")
    for name, e in report["layers"].items():
        r, b = e["release"], e["branch"]
        print(
            f"{name:<44} {r['peak_bytes'] / _MiB:>10.2f}"
            f" {b['peak_bytes'] / _MiB:>10.2f}"
            f" {r['peak_rss_bytes'] / _MiB:>7.1f} {b['peak_rss_bytes'] / _MiB:>7.1f}"
            f" {r['seconds']:>6.2f} {b['seconds']:>6.2f}"
            + ("" if e["identical"] else "  PREPARED TENSORS DIFFER")
        )


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="qwen3.6-35b-a3b", choices=sorted(PRESETS))
    layers = p.add_mutually_exclusive_group()
    layers.add_argument(
        "--num-layers", type=int, default=4, help="MoE layers to write (default 4)"
    )
    layers.add_argument("--all-layers", action="store_true", help="the model's all")
    p.add_argument("--format", default="modelopt", choices=FORMATS)
    p.add_argument(
        "--checkpoint",
        type=Path,
        help="load this NVFP4 (ModelOpt or compressed-tensors) checkpoint, all its "
        "layers, instead of writing a synthetic one",
    )
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads of the workers (default 1: on a shared machine every "
        "parallel op waits for its slowest thread; 0: torch's default)",
    )
    p.add_argument("--out", type=Path, default=Path("moe_weight_prep_out"))
    p.add_argument("--plot", type=Path, help="default: OUT/moe_weight_prep.png")
    p.add_argument(
        "--release-vllm",
        type=Path,
        default=_RELEASE_TREE,
        help="source tree of unmodified vLLM 0.34.0 (git worktree of tag v0.34.0)",
    )
    p.add_argument(
        "--branch-vllm",
        type=Path,
        help="source tree of the branch (default: the vllm this Python imports)",
    )
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    if not (args.release_vllm / "vllm" / "__init__.py").is_file():
        raise SystemExit(
            f"no vLLM 0.34.0 source tree at {args.release_vllm}; make one with\n"
            "  git -C <vllm git tree> worktree add --detach "
            f"{args.release_vllm} v0.34.0"
        )
    args.out.mkdir(parents=True, exist_ok=True)
    preset = PRESETS[args.model]
    num_layers = preset.num_moe_layers if args.all_layers else args.num_layers
    started = time.perf_counter()
    with ExitStack() as stack:
        checkpoint = args.checkpoint
        bar_total = None if checkpoint else num_layers * (1 + 2 * len(_SIDES))
        bar = _progress(bar_total)
        stack.callback(bar.close)
        if checkpoint is None:
            tmp = tempfile.TemporaryDirectory(dir=args.out, prefix="checkpoint-")
            checkpoint = Path(stack.enter_context(tmp))
            bar.set_description(f"writing {args.model} ({args.format})")
            write_checkpoint(
                checkpoint,
                preset,
                num_layers,
                args.format,
                progress=lambda _: bar.update(),
            )
            # Else the kernel writes it back while the workers time layers.
            os.sync()
        runs: dict[str, dict] = {side: {} for side in _SIDES}
        for mode in _PASSES:
            for side in _SIDES:
                runs[side][mode] = _run_worker(side, mode, args, checkpoint, bar)
            trees = {runs[side][mode]["vllm"]["path"] for side in _SIDES}
            if len(trees) != 2:
                raise SystemExit(f"release and branch ran the same vllm: {trees}")
    model = args.model if args.checkpoint is None else str(args.checkpoint)
    report = _merge(model, checkpoint, runs)
    report["format"] = args.format if args.checkpoint is None else None
    report["wall_seconds"] = time.perf_counter() - started
    _print_table(report)
    for side in _SIDES:
        v = report["vllm"][side]
        print(f"{side}: vllm {v['version']} {v['describe']} {v['commit']} {v['path']}")
    _plot(report, args.plot or args.out / "moe_weight_prep.png")
    json_path = args.out / "moe_weight_prep.json"
    json_path.write_text(json.dumps(report, indent=1))
    if not report["total"]["identical"]:
        print("ERROR: release and branch prepared different tensors (digests)")
    print(f"{report['wall_seconds']:.0f} s; results: {json_path}")
    return 0 if report["total"]["identical"] else 1


if __name__ == "__main__":
    if sys.argv[1:2] == ["_worker"]:
        _worker(*sys.argv[2:])
    else:
        sys.exit(main())
