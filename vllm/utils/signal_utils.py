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

    Ctrl-C signals the whole foreground process group; SIG_IGN survives fork
    and exec, so the parent alone sees the interrupt, and must stop its
    children itself (e.g. in a ``finally``). The parent ignores SIGINT while
    the block runs: keep it to starting processes. Outside the main thread
    (where handlers cannot be changed) a no-op.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
