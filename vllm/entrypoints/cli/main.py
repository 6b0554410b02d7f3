# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The ``vllm`` command line: ``vllm bench <benchmark> [options]``."""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
import threading

# The CPU peak-memory meter sees tensors freed that were allocated before it
# started; c10 logs a warning for each. Quiet by default on the command line
# (must be set before torch loads).
os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")

import vllm  # noqa: E402  (no torch: it loads inside main)

__all__ = ["main", "make_parser"]


def make_parser() -> argparse.ArgumentParser:
    from vllm.entrypoints.cli.benchmark.main import add_bench_subparser
    from vllm.utils.argparse_utils import CommandLineParser

    parser = CommandLineParser(
        prog="vllm",
        description="vLLM (NVFP4 MoE weight-preparation branch) command line.",
    )
    parser.add_argument(
        "--version", action="version", version=f"%(prog)s {vllm.__version__}"
    )
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    commands.required = True
    add_bench_subparser(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    prog = ["vllm"]  # the command's name once known, for the Ctrl-C line
    try:
        return _main(argv, prog)
    except KeyboardInterrupt:
        # Ctrl-C: one line and the shell's status for SIGINT, no traceback.
        # Outputs are written whole or not at all, so nothing is left behind.
        print(f"{prog[0]}: interrupted", file=sys.stderr)
        return 130  # 128 + SIGINT


def _exit_at_once(signum, frame) -> None:
    os.write(2, b"vllm: interrupted\n")
    os._exit(130)


@contextlib.contextmanager
def _sigint_exits_at_once():
    """Ctrl-C while the benchmarks import (torch: seconds) exits at once,
    quietly: a KeyboardInterrupt in the middle of an import leaves modules
    half-initialized, and the interpreter's exit then fails on them. Nothing
    has been started or written yet, so there is nothing to clean up. Only
    where Ctrl-C would raise KeyboardInterrupt (not when it is ignored, as
    in a background job)."""
    main_thread = threading.current_thread() is threading.main_thread()
    if not main_thread or signal.getsignal(signal.SIGINT) is not (
        signal.default_int_handler
    ):
        yield
        return
    signal.signal(signal.SIGINT, _exit_at_once)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def _main(argv: list[str] | None, prog: list[str]) -> int:
    with _sigint_exits_at_once():
        from vllm.distributed.launcher import WorkerError
        from vllm.utils.argparse_utils import RunError

        parser = make_parser()
    args, unknown = parser.parse_known_args(argv)
    command = getattr(args, "command_parser", parser)
    prog[0] = command.prog
    if unknown:
        # Reported by the command they were given to (its name, its --help),
        # not by the top-level parser as parse_args would.
        command.error(f"unrecognized arguments: {' '.join(unknown)}")
    try:
        return args.dispatch(args) or 0
    except BrokenPipeError:
        # The reader went away (`vllm bench ... | head`): not an error here.
        # Point stdout at /dev/null so the interpreter's final flush is quiet.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141  # 128 + SIGPIPE, as a shell reports it
    except (WorkerError, RunError) as e:
        # The run failed (a rank of a parallel run: the others were
        # stopped): one line, status 1.
        command.exit(1, f"{command.prog}: error: {e}\n")
    except (ValueError, OSError) as e:
        # A bad argument, found before anything ran: the error and the
        # --help hint, status 2, as argparse's own argument errors.
        command.error(str(e))


if __name__ == "__main__":
    sys.exit(main())
