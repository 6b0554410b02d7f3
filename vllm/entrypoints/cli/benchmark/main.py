# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""``vllm bench``: registry of the benchmark subcommands."""

from __future__ import annotations

import argparse

from vllm.benchmarks.moe_weight_prep import cli as moe_weight_prep

__all__ = ["BENCHMARKS", "add_bench_subparser"]

# name -> module with CLI_HELP (one line), CLI_DESCRIPTION (plain text),
# add_cli_args(parser) and main(args); add new ones here.
BENCHMARKS = {
    "moe-weight-prep": moe_weight_prep,
}


def add_bench_subparser(commands: argparse._SubParsersAction) -> None:
    bench = commands.add_parser(
        "bench", help="run a benchmark", description="Run a benchmark."
    )
    benches = bench.add_subparsers(dest="benchmark", metavar="BENCHMARK")
    benches.required = True
    for name, module in BENCHMARKS.items():
        sub = benches.add_parser(
            name, help=module.CLI_HELP, description=module.CLI_DESCRIPTION
        )
        module.add_cli_args(sub)
        sub.set_defaults(dispatch=module.main, command_parser=sub)
