# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Contention for benchmarks: processes that keep cores busy meanwhile.

A real start-up prepares weights in several worker processes at once, so the
preparation rarely has the machine to itself. ``busy_cores(n)`` starts ``n``
processes, each a torch process on one intra-op thread (``threads`` to
change it) that copies 32 MiB buffers in 1 MiB chunks forever (memory
traffic and a busy core, like another worker preparing its shard), waits
until every one is running, and stops them all when the block exits (also
on an exception or Ctrl-C).
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
from collections.abc import Iterator

from vllm.utils.signal_utils import children_ignore_sigint

__all__ = ["busy_cores"]

_START_TIMEOUT_S = 120.0


def _copy_forever(ready, threads: int) -> None:  # runs in the child process
    import torch

    torch.set_num_threads(threads)
    src = torch.ones(32 << 20, dtype=torch.uint8)
    dst = torch.empty_like(src)
    ready.set()
    step = 1 << 20
    while True:
        for start in range(0, src.numel(), step):
            dst[start : start + step].copy_(src[start : start + step])


@contextlib.contextmanager
def busy_cores(n: int, threads: int = 1) -> Iterator[int]:
    """Keep ``n`` cores busy while the block runs; yields ``n``. Each busy
    process copies on ``threads`` intra-op threads (2 on a 2-core machine:
    a neighbour that itself runs parallel operations, the worst case for
    code that does too).

    ``n == 0`` starts nothing. Processes are spawned (not forked: the parent
    may already run OpenMP threads) as daemons, so they cannot outlive this
    process even if the block is killed.
    """
    if n < 0:
        raise ValueError(f"busy cores must be >= 0, got {n}")
    if n == 0:
        yield 0
        return
    ctx = mp.get_context("spawn")
    procs = []
    try:
        for _ in range(n):
            ready = ctx.Event()
            proc = ctx.Process(target=_copy_forever, args=(ready, threads),
                               daemon=True)  # fmt: skip
            with children_ignore_sigint():  # Ctrl-C is the parent's
                proc.start()
            procs.append((proc, ready))
        for _, ready in procs:
            if not ready.wait(_START_TIMEOUT_S):
                raise RuntimeError(
                    f"a busy process did not start within {_START_TIMEOUT_S:.0f} s"
                )
        yield n
    finally:
        for proc, _ in procs:
            proc.terminate()
        for proc, _ in procs:
            proc.join(10)
