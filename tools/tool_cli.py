# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""What the tools' commands share: one error a user reads as one line (exit
2), subprocesses failing into it, and the argument parser."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

__all__ = ["ROOT", "ToolError", "command", "parser", "run"]

ROOT = Path(__file__).resolve().parents[1]


class ToolError(ValueError):
    """A tool cannot go on; the message names release, file and definition."""


def run(
    cmd: Sequence[str], what: str, env: dict | None = None, strip=True, **kw
) -> str:
    """``cmd``'s stdout (``strip``: stripped); ToolError with what it said
    first on a failure."""
    env = {**os.environ, **(env or {})}
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, **kw)
    if done.returncode:
        said = (done.stderr + done.stdout).splitlines()
        said = [s for s in said if s.strip() and not s.startswith("hint:")]
        raise ToolError(f"{what}: {(said or [f'exit {done.returncode}'])[0]}")
    return done.stdout.strip() if strip else done.stdout


def parser(doc: str, releases: bool = True) -> argparse.ArgumentParser:
    """A parser described by ``doc``'s first line (with ``--release V``)."""
    p = argparse.ArgumentParser(description=doc.split("\n")[0])
    if releases:
        p.add_argument("--release", action="append", help="default: every one")
    return p


def command(prog: str, body: Callable[[], int | None]) -> int:
    """``body()``'s exit status (0 for None); a ToolError (any ValueError) or
    OSError printed as one line on stderr, exit 2."""
    try:
        return body() or 0
    except (ValueError, OSError) as exc:
        message = " ".join(str(exc).split())
    except KeyboardInterrupt:
        message = "interrupted (nothing finished was left half-written)"
    print(f"{prog}: error: {message}", file=sys.stderr)
    return 2
