# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Signals and child processes: Ctrl-C is the parent's to handle."""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator

__all__ = ["children_ignore_sigint"]


@contextlib.contextmanager
def children_ignore_sigint() -> Iterator[None]:
    """Processes started inside this block ignore SIGINT for their lifetime.

    Ctrl-C in a terminal sends SIGINT to the whole foreground process group,
    so spawned workers would each raise KeyboardInterrupt and print their
    own tracebacks (often from the middle of ``import torch``). A disposition
    of SIG_IGN survives fork and exec, and a Python child that starts with
    SIGINT ignored installs no KeyboardInterrupt handler: the parent alone
    sees the interrupt and stops its children (they must be stopped by their
    owner, e.g. terminated in a ``finally``).

    The parent ignores SIGINT while the block runs, so keep it to starting
    processes (milliseconds). Outside the main thread (where handlers cannot
    be changed) this does nothing.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
