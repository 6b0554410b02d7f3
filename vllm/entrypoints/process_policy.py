# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Process-wide settings a command sets around a weight preparation: Ctrl-C
held back to the end of the block, and torch's intra-op threads on CPU.

Library code leaves both alone (they belong to whoever owns the process);
the commands that prepare weights themselves (``vllm bench moe-weight-prep``,
the checkpoint writer, the kernel benchmarks) enter :func:`preparing_weights`.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator

import torch

__all__ = [
    "PREP_CPU_THREADS",
    "deferred_sigint",
    "intra_op_threads",
    "preparing_weights",
]

#: Intra-op threads of a weight preparation on CPU. The bounded steps issue
#: many short operations on cache-sized chunks, and each parallel one waits
#: for its slowest thread: a Qwen3.6-35B-A3B layer on a 2-core machine with
#: one busy process took 41.7 ms on one thread, 70.2 ms on two (25.5 ms on
#: two, 36.9 ms on one, when quiet; the design page's "Threads").
PREP_CPU_THREADS = 1


class _Latch:
    def __init__(self) -> None:
        self.pending = False

    def handler(self, signum, frame) -> None:
        self.pending = True


@contextlib.contextmanager
def deferred_sigint() -> Iterator[None]:
    """Hold SIGINT back while the block runs; raise KeyboardInterrupt as it
    ends if one came (chained to any exception already leaving it, which is
    not lost). Only where SIGINT raises (Python's handler or another callable
    is installed) and in the main thread; elsewhere a no-op, so a process
    that ignores SIGINT keeps ignoring it."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.getsignal(signal.SIGINT)
    if not callable(previous):
        yield
        return
    latch = _Latch()
    signal.signal(signal.SIGINT, latch.handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        if latch.pending:
            raise KeyboardInterrupt


@contextlib.contextmanager
def intra_op_threads(n: int) -> Iterator[None]:
    """torch on ``n`` intra-op threads while the block runs, the previous
    setting after (0: leave torch's setting)."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"intra-op threads must be an int >= 0, got {n!r}")
    previous = torch.get_num_threads()
    if n == 0 or n == previous:
        yield
        return
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


@contextlib.contextmanager
def preparing_weights(
    device: torch.device | str, threads: int = PREP_CPU_THREADS
) -> Iterator[None]:
    """A command's policy around one weight preparation: Ctrl-C lands only
    when the block ends (:func:`deferred_sigint`), and on a CPU the work runs
    on ``threads`` intra-op threads (:func:`intra_op_threads`)."""
    cpu = torch.device(device).type == "cpu"
    with deferred_sigint(), intra_op_threads(threads if cpu else 0):
        yield
