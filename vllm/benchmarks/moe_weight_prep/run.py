# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The job of ``vllm bench moe-weight-prep``, for either quant mode: the
layer source checked, the ranks run, the report printed, the JSON and the
plot written, the exit status."""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from vllm.benchmarks.moe_weight_prep.busy_cores import busy_cores
from vllm.benchmarks.moe_weight_prep.checks import check_num_layers
from vllm.benchmarks.moe_weight_prep.output_files import write_atomically
from vllm.benchmarks.moe_weight_prep.plot import write_plot
from vllm.benchmarks.moe_weight_prep.presets import get_preset
from vllm.benchmarks.moe_weight_prep.ranks import rank_job, run_ranks
from vllm.benchmarks.moe_weight_prep.report import (
    format_job_time,
    format_mib,
    format_ranks,
    format_report,
    format_w4a16_report,
)
from vllm.benchmarks.moe_weight_prep.shard import shard_of
from vllm.benchmarks.moe_weight_prep.sources import checkpoint_source
from vllm.distributed.launcher import WorkerError
from vllm.utils.argparse_utils import RunError

__all__ = [
    "QUANT_MODES",
    "run_job",
    "write_json",
]

#: The quant modes a job measures.
QUANT_MODES = ("w4a4", "w4a16")


def write_json(path: str, value) -> None:
    """``value`` as indented JSON at ``path``, written whole or not at all."""

    def write(tmp: str) -> None:
        with open(tmp, "w") as f:
            json.dump(value, f, indent=2)

    write_atomically(path, write)


def _exceeds(result: dict, quant_mode: str) -> bool:
    """Whether the bounded preparation of ``result`` exceeds --memory-limit."""
    ok = result["memory_limit_ok"]
    if quant_mode == "w4a16":
        return ok is False
    return ok is not None and not ok["bounded"]


def run_job(
    args: argparse.Namespace,
    device: torch.device,
    quant_mode: str,
    *,
    start: float,
    json_path: str | None = None,
    plot_path: str | None = None,
) -> int:
    """Run the job of ``args`` (already checked by the command line) in mode
    ``quant_mode`` (:data:`QUANT_MODES`) on ``device``: ``args.tp`` ranks (W4A16:
    one), each preparing its shard of every layer. Prints the report, writes
    ``json_path`` (before the plot) and ``plot_path``; returns 1 when the
    bounded preparation exceeds ``--memory-limit``, else 0. ``start`` is the
    job's ``time.perf_counter()`` start, for its wall time.

    A bad layer source raises ValueError before any rank starts; a failure
    after that raises :class:`RunError` (or the launcher's ``WorkerError``).
    """
    if quant_mode not in QUANT_MODES:
        raise ValueError(
            f"--quant-mode must be one of {QUANT_MODES}, got {quant_mode!r}"
        )
    n = args.tp
    rank0 = shard_of(0, n, args.enable_expert_parallel)
    if args.checkpoint:
        preset, _ = checkpoint_source(args.checkpoint, rank0, device, quant_mode)
    else:
        preset = get_preset(args.model)
        rank0.check(preset)  # a bad --tp is refused before anything runs
    # Before any rank is spawned: the same error for one rank or N.
    check_num_layers(preset, args.num_layers)
    params = {
        "quant_mode": quant_mode,
        "preset": preset,
        "checkpoint": args.checkpoint,
        "world_size": n,
        "expert_parallel": args.enable_expert_parallel,
        "device": device.type,
        "num_layers": args.num_layers,
        "max_transient_bytes": args.max_transient,
        "memory_limit": args.memory_limit,
        "seed": args.seed,
        "progress": not args.no_progress,
        "global_scale_mode": args.global_scale_mode,
        "precision": args.precision,
    }
    try:
        with busy_cores(args.busy_cores):
            results = [rank_job(0, params)] if n == 1 else run_ranks(params)
    except KeyboardInterrupt:
        if n > 1 and not args.no_progress:
            # Rank 0's progress bar was stopped mid-line (by its parent, so
            # it could not close it): the Ctrl-C line starts on its own.
            sys.stderr.write("\n")
        raise
    except (ValueError, OSError, RuntimeError) as e:
        if isinstance(e, WorkerError):
            raise
        raise RunError(str(e).splitlines()[0] if str(e) else repr(e)) from e
    wall = time.perf_counter() - start
    for result in results:
        result["busy_cores"] = args.busy_cores
    if quant_mode == "w4a16":
        print(format_w4a16_report(results[0]))
    else:
        print(format_report(results[0]))
        if n > 1:
            print()
            print(format_ranks(results))
        print(format_job_time(results[0]["phase_times_s"], wall))
    if json_path:
        # The same layout for any --tp: one result per rank under "ranks".
        job = {"world_size": n, "expert_parallel": args.enable_expert_parallel}
        if quant_mode == "w4a16":
            job |= {"quant_mode": quant_mode, "busy_cores": args.busy_cores}
        else:
            job |= {
                "busy_cores": args.busy_cores,
                "precision": args.precision,
                "wall_time_s": wall,
            }
        write_json(json_path, job | {"ranks": results})
        print(f"wrote {json_path}")
    if plot_path:
        try:
            write_atomically(plot_path, lambda tmp: write_plot(results[0], tmp))
        except (OSError, ValueError, RuntimeError) as e:
            what = getattr(e, "strerror", None) or str(e).splitlines()[0]
            raise RunError(f"--plot {args.plot}: {what}") from e
        print(f"wrote {plot_path}")
    over = [r.get("rank", 0) for r in results if _exceeds(r, quant_mode)]
    if over:
        what = "W4A16 preparation" if quant_mode == "w4a16" else "preparation"
        where = "" if n == 1 else f" on rank(s) {', '.join(map(str, over))}"
        print(
            f"vllm bench moe-weight-prep: error: the bounded {what} exceeds "
            f"--memory-limit {format_mib(args.memory_limit)}{where}",
            file=sys.stderr,
        )
        return 1
    return 0
