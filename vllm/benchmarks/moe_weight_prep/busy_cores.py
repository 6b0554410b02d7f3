# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Contention for benchmarks: processes that keep cores busy meanwhile.

A real start-up prepares weights in several worker processes at once.
``busy_cores(n)`` starts ``n`` torch processes, each copying 32 MiB buffers in
1 MiB chunks forever (memory traffic and a busy core, like another worker
preparing its shard).
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
from collections.abc import Iterator

from vllm.utils.process_lifetime import die_with_parent
from vllm.utils.signal_utils import children_ignore_sigint

__all__ = ["busy_cores"]

_START_TIMEOUT_S = 120.0


def _copy_forever(ready, threads: int, parent_pid: int, lifeline) -> None:
    # Runs in the child process.
    die_with_parent(parent_pid, lifeline)
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

    ``n == 0`` starts nothing. Returns once every process runs; they are
    spawned (the parent may already run OpenMP threads) and end with the
    block (also on an exception or Ctrl-C), or at once when this process
    dies by any signal (:func:`vllm.utils.process_lifetime.die_with_parent`;
    enter the block in a thread that outlives it).
    """
    if n < 0:
        raise ValueError(f"busy cores must be >= 0, got {n}")
    if n == 0:
        yield 0
        return
    ctx = mp.get_context("spawn")
    procs = []
    # The busy processes hold the read end; this process holds the write
    # end until the block ends, or dies (then they read end of file).
    lifeline, keep_alive = ctx.Pipe(duplex=False)
    try:
        for _ in range(n):
            ready = ctx.Event()
            proc = ctx.Process(
                target=_copy_forever,
                args=(ready, threads, os.getpid(), lifeline),
                daemon=True,
            )
            with children_ignore_sigint():  # Ctrl-C is the parent's
                proc.start()
            procs.append((proc, ready))
        lifeline.close()
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
        lifeline.close()
        keep_alive.close()
