# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""``vllm bench``: registry of the benchmark subcommands."""

from __future__ import annotations

import argparse

from vllm.benchmarks import moe_weight_prep

__all__ = ["BENCHMARKS", "add_bench_subparser"]

# name -> module with add_cli_args(parser) and main(args); add new ones here.
BENCHMARKS = {
    "moe-weight-prep": moe_weight_prep,
}


def add_bench_subparser(commands: argparse._SubParsersAction) -> None:
    bench = commands.add_parser("bench", help="run a benchmark")
    benches = bench.add_subparsers(dest="benchmark", metavar="BENCHMARK")
    benches.required = True
    for name, module in BENCHMARKS.items():
        sub = benches.add_parser(name, help=(module.__doc__ or "").splitlines()[0])
        module.add_cli_args(sub)
        sub.set_defaults(dispatch=module.main, command_parser=sub)
