# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The ``vllm`` command line: ``vllm bench <benchmark> [options]``."""

from __future__ import annotations

import argparse
import os
import sys

# The CPU peak-memory meter sees tensors freed that were allocated before it
# started; c10 logs a warning for each. Quiet by default on the command line
# (must be set before torch loads).
os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")

import vllm  # noqa: E402
from vllm.distributed.launcher import WorkerError  # noqa: E402
from vllm.entrypoints.cli.benchmark.main import add_bench_subparser  # noqa: E402

__all__ = ["main"]


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="vllm",
        description="vLLM (NVFP4 MoE weight-preparation branch) command line.",
    )
    parser.add_argument("--version", action="version",
                        version=f"%(prog)s {vllm.__version__}")  # fmt: skip
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    commands.required = True
    add_bench_subparser(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = make_parser()
    args = parser.parse_args(argv)
    try:
        return args.dispatch(args) or 0
    except BrokenPipeError:
        # The reader went away (`vllm bench ... | head`): not an error here.
        # Point stdout at /dev/null so the interpreter's final flush is quiet.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141  # 128 + SIGPIPE, as a shell reports it
    except WorkerError as e:
        # A rank of a parallel run failed; the others were stopped.
        command = getattr(args, "command_parser", parser)
        command.exit(1, f"{command.prog}: error: {e}\n")
    except (ValueError, OSError) as e:
        # One line, prefixed like argparse's own errors for the same command.
        command = getattr(args, "command_parser", parser)
        command.exit(2, f"{command.prog}: error: {e}\n")


if __name__ == "__main__":
    sys.exit(main())
