# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""For the lifetime tests: run a parent process that starts children and
prints their pids, kill it, and time how long its children (and watched
paths) survive it."""

import os
import select
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

__all__ = [
    "START_TIMEOUT_S",
    "SURVIVAL_LIMIT_S",
    "is_dead",
    "kill_parent_and_time_survivors",
]

ROOT = Path(__file__).resolve().parents[2]
# "Within a second or two" of the parent's death: measured 0.0-0.1 s; the
# limit leaves room for a machine shared by many jobs (load average 30 on 2
# cores here). Before: the busy process outlived its parent by minutes.
SURVIVAL_LIMIT_S = 5.0
# Starting torch in spawned children on a loaded 2-core machine is slow.
START_TIMEOUT_S = 240.0


def is_dead(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def _pid_lines(buf: bytes) -> list[str]:
    """The lines ``... <pid>`` in ``buf`` (anything else a child or library
    prints, e.g. a blank line, is not one of them)."""
    lines = [line.split() for line in buf.decode(errors="replace").splitlines()]
    return [" ".join(t) for t in lines if t and t[-1].isdigit()]


def _read_lines(proc, count: int) -> list[str]:
    """The first ``count`` lines ``... <pid>`` the parent's children print.
    Read from the descriptor itself: a buffered reader may hold both lines
    after the first readline while ``select`` waits for more."""
    fd, buf = proc.stdout.fileno(), b""
    deadline = time.monotonic() + START_TIMEOUT_S
    while len(_pid_lines(buf.rpartition(b"\n")[0])) < count:
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([fd], [], [], left)[0]:
            raise AssertionError(f"children did not start: {buf!r}")
        chunk = os.read(fd, 4096)
        if not chunk:
            raise AssertionError(f"parent exited: {proc.wait()} {buf!r}")
        buf += chunk
    return _pid_lines(buf.rpartition(b"\n")[0])[:count]


def kill_parent_and_time_survivors(script, children, sig, tmp_path, watch=()):
    """Run ``script`` (which prints ``children`` lines ``... <pid>``), send
    ``sig`` to it once they are up, and return the seconds until every child
    is dead and every path in ``watch`` is gone, or past the limit, what is
    left (a string)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), TMPDIR=str(tmp_path))
    proc = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(script)], stdout=subprocess.PIPE, env=env
    )
    pids: list[int] = []
    try:
        pids = [int(line.split()[-1]) for line in _read_lines(proc, children)]
        os.kill(proc.pid, sig)
        proc.wait(60)
        start = time.monotonic()
        while True:
            watched = [p for pattern in watch for p in tmp_path.glob(pattern)]
            alive = [pid for pid in pids if not is_dead(pid)]
            took = time.monotonic() - start
            if not alive and not watched:
                print(f"survived the parent by {took:.4f} s")  # shown with -s
                return took
            if took > 2 * SURVIVAL_LIMIT_S:
                return f"after {took:.1f} s: alive {alive}, left {watched}"
            time.sleep(0.02)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for pid in pids:  # our own children, by pid, if they survived
            if not is_dead(pid):
                os.kill(pid, signal.SIGKILL)
