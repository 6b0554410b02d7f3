# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""In-place permutation of equal-size tiles with a small buffer (cycle-following).

A permutation of ``n`` tiles is a product of disjoint cycles
``(p0 p1 ... p_{m-1})`` with ``out[p_i] = in[p_{i+1}]`` (indices mod m). A
buffer of ``T`` tiles applies a whole cycle of ``m <= T`` tiles in one
gather (read every tile of it) and one scatter (write them back in place).
A longer cycle is cut into segments of ``s <= T`` tiles: the segment
``p0 .. p_{s-1}`` gets ``in[p1] .. in[p_{s-1}], in[p0]``, which finishes
``p0 .. p_{s-2}`` and parks the value ``p_{m-1}`` needs at ``p_{s-1}``; what
is left is the cycle ``(p_{s-1} p_s ... p_{m-1})``, of the same form::

    cycle  p0 <- p1 <- p2 <- p3 <- p4 <- p0      (T = 3)
    chunk 1: p0 <- p1, p1 <- p2, p2 <- p0        p0, p1 final; p2 holds in[p0]
    chunk 2: p2 <- p3, p3 <- p4, p4 <- p2        done

A chunk packs segments of different cycles (at most one per cycle) up to
``T`` tiles; it reads all of its tiles into the buffer before its single
write (``index_copy_``), which reads only the buffer, so an exception
leaves it done or untouched and
:class:`ChunkProgress` can resume the sequence. The plan (the cycles, found
once with a visited bitmap) is the same for every group (expert) of a
batched tensor.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

__all__ = ["TileCyclePlan"]


class TileCyclePlan:
    """The chunks that apply ``out[p] = in[source[p]]`` to ``n`` tiles.

    Args:
        source: int64 [n], a permutation of ``0 .. n-1`` (CPU).
        per_chunk: tiles one chunk may hold (the buffer), at least 2.
        device: where the plan's index tensors live (the tiles' device).

    Attributes:
        src, dst: int64 [M]: tile ``dst[j]`` is written with the tile read at
            ``src[j]`` (M = n minus the fixed points, plus one per cut).
        bounds: chunk c covers ``src[bounds[c]:bounds[c+1]]``.
        largest: tiles in the largest chunk.

    """

    def __init__(
        self, source: torch.Tensor, per_chunk: int, device: torch.device | None = None
    ):
        if per_chunk < 2:
            raise ValueError(f"per_chunk must be at least 2 tiles, got {per_chunk}")
        src_of = source.tolist()
        n = len(src_of)
        visited = bytearray(n)
        src: list[int] = []
        dst: list[int] = []
        bounds = [0]
        used = 0
        for start in range(n):
            if visited[start] or src_of[start] == start:
                visited[start] = 1
                continue
            cycle = [start]
            visited[start] = 1
            p = src_of[start]
            while p != start:
                visited[p] = 1
                cycle.append(p)
                p = src_of[p]
            head = 0
            while head < len(cycle) - 1:
                if per_chunk - used < 2:
                    bounds.append(len(src))
                    used = 0
                left = len(cycle) - head
                s = min(left, per_chunk - used)
                seg = cycle[head : head + s]
                dst.extend(seg)
                src.extend(seg[1:])
                src.append(seg[0])
                used += s
                if s == left:
                    break
                head += s - 1  # the parked value's slot heads what is left
                bounds.append(len(src))
                used = 0
        if bounds[-1] != len(src):
            bounds.append(len(src))
        self.n = n
        self.src = torch.tensor(src, dtype=torch.int64, device=device)
        self.dst = torch.tensor(dst, dtype=torch.int64, device=device)
        self.bounds = bounds
        self.largest = max(
            (b - a for a, b in zip(bounds, bounds[1:], strict=False)), default=0
        )

    @property
    def num_chunks(self) -> int:
        return len(self.bounds) - 1

    def index_bytes(self) -> int:
        """Bytes the plan itself holds (its two index tensors)."""
        return 8 * (self.src.numel() + self.dst.numel())

    def apply_chunk(
        self,
        tiles: torch.Tensor,
        group: int,
        chunk: int,
        buf: torch.Tensor,
        isrc: torch.Tensor,
        idst: torch.Tensor,
    ) -> Callable[[], object]:
        """Read chunk ``chunk`` of group ``group`` of ``tiles`` [G * n, W]
        (W words per tile) and return its one write, the ``index_copy_``
        from ``buf`` (run it again: the same bytes). ``buf`` [>= largest, W]
        and ``isrc`` / ``idst`` int64 [>= largest] are reused scratch."""
        a, b = self.bounds[chunk], self.bounds[chunk + 1]
        k = b - a
        offset = group * self.n
        torch.add(self.src[a:b], offset, out=isrc[:k])
        torch.add(self.dst[a:b], offset, out=idst[:k])
        torch.index_select(tiles, 0, isrc[:k], out=buf[:k])
        return lambda: tiles.index_copy_(0, idst[:k], buf[:k])
