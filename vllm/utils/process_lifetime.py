# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Child processes and temporary directories that do not outlive their parent.

A parent killed by a signal (SIGTERM's default action, SIGKILL, a crash)
runs no ``finally`` and no ``atexit``: its ``daemon`` children and its
temporary directories would stay. Two helpers close that gap::

    parent                                  child (spawned)
    ------                                  ---------------
    recv, send = ctx.Pipe(duplex=False)
    start child with (os.getpid(), recv)    die_with_parent(parent_pid, recv)
    keep ``send`` open while it lives         - PR_SET_PDEATHSIG(SIGKILL)
                                              - parent already gone? exit
                                              - thread: EOF on ``recv`` -> exit

    with removed_even_if_killed(tmp):       a reaper process (own session,
        ...                                 ignores SIGINT/SIGTERM/SIGHUP)
                                            removes ``tmp`` at EOF on its
                                            stdin: the block's end or the
                                            parent's death, whichever first

``PR_SET_PDEATHSIG`` (Linux) kills the child even when its main thread
holds the GIL in a long C call; the lifeline thread covers systems without
``prctl``. Caveat of the former: Linux sends the signal when the parent
*thread* that started the child exits, so start children from a thread that
outlives them (the main thread, or the one that waits for them).
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import os
import shutil
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from multiprocessing.connection import Connection

__all__ = ["die_with_parent", "removed_even_if_killed", "watch_lifeline"]

_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def _set_parent_death_signal(sig: int) -> bool:
    """``prctl(PR_SET_PDEATHSIG, sig)``; False where unavailable."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        return libc.prctl(_PR_SET_PDEATHSIG, sig, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def watch_lifeline(lifeline: Connection) -> threading.Thread:
    """Start a daemon thread that ends this process (``os._exit(1)``) when
    ``lifeline`` (the read end of a pipe whose write end only the parent
    holds) reports end of file: the parent closed it or died."""

    def watch() -> None:
        try:
            while True:
                lifeline.recv_bytes()
        except (EOFError, OSError):
            pass
        os._exit(1)

    thread = threading.Thread(target=watch, name="parent-lifeline", daemon=True)
    thread.start()
    return thread


def die_with_parent(parent_pid: int, lifeline: Connection | None = None) -> None:
    """Call first thing in a child process: it is killed (SIGKILL) as soon
    as its parent, ``parent_pid``, dies by any signal, and exits at once if
    the parent is already gone. ``lifeline``: see :func:`watch_lifeline`.
    """
    _set_parent_death_signal(signal.SIGKILL)
    # The parent may have died before the prctl: then this process has been
    # handed to another (init or a subreaper) already.
    if os.getppid() != parent_pid:
        os._exit(1)
    if lifeline is not None:
        watch_lifeline(lifeline)


# Runs in its own interpreter (-S: no site import, starts in milliseconds).
_REAPER = """
import os, shutil, signal, sys, time
for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
    signal.signal(s, signal.SIG_IGN)
while sys.stdin.buffer.read(65536):
    pass
# A child still dying may write into the directory once more: retry briefly.
deadline = time.monotonic() + 10
while os.path.lexists(sys.argv[1]) and time.monotonic() < deadline:
    shutil.rmtree(sys.argv[1], ignore_errors=True)
    time.sleep(0.05)
"""


@contextlib.contextmanager
def removed_even_if_killed(path: str | os.PathLike) -> Iterator[str]:
    """Remove the directory ``path`` and all in it when the block ends, or,
    if this process dies inside it by any signal (SIGKILL included), right
    after its death. A reaper process in its own session (so a signal to this process
    group does not reach it) waits on a pipe from this process and removes
    ``path`` at end of file. Yields ``path`` as a string."""
    path = os.fspath(path)
    try:
        reaper = subprocess.Popen(
            [sys.executable, "-S", "-c", _REAPER, path],
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
    except BaseException:
        shutil.rmtree(path, ignore_errors=True)
        raise
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)
        reaper.stdin.close()
        try:
            reaper.wait(30)
        except subprocess.TimeoutExpired:
            reaper.kill()
            reaper.wait()
