# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""FlashInfer's W4A16 (b12x) layout of NVFP4 MoE weights, made in place in
bounded memory. (About 560 lines: weights and scales, forward and back, share
one chunk plan and are best read together.)

The layout is defined once, whole-tensor, in
:mod:`~vllm.model_executor.layers.quantization.utils.flashinfer_w4a16_layout`
(``w4a16_pack_weight``, ``w4a16_pack_blockscale``); the functions here write
the same bytes into the loaded tensors' own storage::

    weight uint8 [E, N, K/2]          -> int32 [E, K/16, (N/64) * 128]
    block scale fp8 [E, N, K/16]      -> fp8   [E, K/16, N]

Each is a transposition of tiles (16 x 64 codes = 512 B for weights, 64
scales = 64 B for block scales) plus a fixed rearrangement inside a tile,
done two ways:

A. Experts that fit the buffer, a few at a time: their rows are gathered
   (rotated by ``rotate``) into the buffer, rearranged there, and written
   back with one permuted copy. Weights: 8 "planes" of int64 words (rows
   ``warp*16 + c*8 + col`` for each (warp, c)) on which four word-parallel
   bit steps move every nibble (see :func:`_shuffle_planes`). Scales: rows
   permuted, transposed into an int32 index, re-encoded by a 256-entry
   table (``index_select``) straight into place.
B. Larger experts: the same per strip of 64 rows, in place (the strip's
   tiles in strip order), then the strip/tile transposition by
   cycle-following (:class:`TileCyclePlan`), any expert size within the cap.

Every chunk reads what it needs before its single write, so an exception
raised by one of its operations leaves it done or untouched and a
``ChunkProgress`` resumes the call. The inverse functions (a reload) run
path B backwards, using the reference per strip.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from vllm.model_executor.layers.quantization.utils.bounded_chunks import (
    DEFAULT_MAX_TRANSIENT_BYTES,
    ChunkProgress,
    check_cap,
    run_chunks,
    tile_bytes,
)
from vllm.model_executor.layers.quantization.utils.flashinfer_w4a16_layout import (
    _W4A16_SCALE_ROWS,
    W4A16_TILE_K,
    W4A16_TILE_N,
    w4a16_blockscale_inverse_table,
    w4a16_blockscale_table,
)
from vllm.model_executor.layers.quantization.utils.inplace_tile_permutation import (
    TileCyclePlan,
)

__all__ = [
    "pack_w4a16_blockscale_",
    "repack_w4a16_weight_",
    "unpack_w4a16_blockscale_",
    "unrepack_w4a16_weight_",
    "w4a16_min_transient_bytes",
]

_WEIGHT_TILE = 512  # bytes of one 16 x 64 tile of codes
_SCALE_TILE = W4A16_TILE_N  # bytes of 64 scales
# int64 masks of the bit steps (signed where bit 63 is set).
_NIBBLE_MASK = 0x00000000F0F0F0F0
_EVEN_BYTES = 0x00FF00FF00FF00FF
_MID_UNIT = 0x00000000FFFF0000
_LOW_WORD = 0x00000000FFFFFFFF


def _check(name: str, t: object, dtype: torch.dtype) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype != dtype or t.dim() != 3 or not t.is_contiguous():
        raise ValueError(
            f"{name} must be a contiguous {dtype} [E, R, C] tensor, got "
            f"{t.dtype} of shape {tuple(t.shape)}, stride {t.stride()}"
        )
    if t.data_ptr() % 8 != 0:
        raise ValueError(f"{name} must start at an 8-byte aligned address")
    return t


def _check_rotate(name: str, n: int, rotate: int) -> None:
    if n % W4A16_TILE_N != 0:
        raise ValueError(
            f"{name}: W4A16 needs the rows (N = {n}) to be a multiple of 64"
        )
    if not 0 <= rotate < max(n, 1) or rotate % W4A16_TILE_N != 0:
        raise ValueError(
            f"{name}: rotate must be a multiple of 64 in [0, {n}), got {rotate} "
            "(rotate a [w3; w1] weight by I % 64 != 0 with the half swap first)"
        )


def _overhead(n: int) -> int:
    """Bytes of the small index vectors a call keeps beside its chunks
    (row and strip offsets of one expert, the scale permutation, ...)."""
    return 32 * n + 4096


def _budget(cap: int, device: torch.device, n: int) -> int:
    """What the chunks of a call on experts of ``n`` rows may allocate:
    the cap (at most the device's tile size) less :func:`_overhead`."""
    return min(cap, max(tile_bytes(device), 1)) - _overhead(n)


# --- the rearrangement inside a tile of codes ------------------------------------


def _delta_swap(
    x: torch.Tensor, y: torch.Tensor, t: torch.Tensor, shift: int, mask: int
) -> None:
    """Exchange the bits of ``y`` under ``mask`` with those of ``x``
    ``shift`` above them (``y`` may be ``x``: a swap inside each word).
    ``t``: scratch of ``x``'s shape. Six whole-tensor operations."""
    torch.bitwise_right_shift(x, shift, out=t)
    t.bitwise_xor_(y)
    t.bitwise_and_(mask)
    y.bitwise_xor_(t)
    t.bitwise_left_shift_(shift)
    x.bitwise_xor_(t)


def _shuffle_planes(
    planes: torch.Tensor, scratch: torch.Tensor, inverse: bool = False
) -> None:
    """Turn 8 planes of source words into 8 planes of output words, in place
    (``inverse``: back). Every step is an involution, so the inverse runs
    the same four steps in the reverse order.

    ``planes`` int64 [8, M]: plane (wl, c, wh) (index wl*4 + c*2 + wh) holds
    8-byte row chunks of rows ``warp*16 + c*8 + col`` (warp = wh*2 + wl):
    byte ``ab*4 + tr`` holds the codes k = ab*8 + tr*2 (low nibble) and + 1.
    Afterwards plane (tr, wh) (index tr*2 + wh, the same slot) holds the
    output words [word(tr, warp=2wh), word(tr, warp=2wh+1)] of the layout
    (nibbles (h, c, ab) per int32 word), so that the planes, in order, are
    the 8 words of a 64-byte output block. ``scratch``: int64, >= 4M.

    Each step is one delta swap over half of the planes at a time (36 torch
    calls in all, whatever M): the calls, not the bytes, dominate a small
    chunk, so they are made as large as the scratch allows.
    """
    m = planes.shape[1]
    p = planes.view(2, 2, 2 * m)  # [wl, c, (wh, M)]
    t = scratch[: 4 * m].view(2, 2 * m)
    halves = planes.view(2, 4 * m)

    def nibbles() -> None:
        # In each word (ab=0, h=1) <-> (ab=1, h=0): byte h*4 + tr then holds
        # the codes ab = 0, 1 of k = tr*2 + h.
        for x in halves:
            _delta_swap(x, x, t.view(-1), 28, _NIBBLE_MASK)

    def interleave() -> None:
        # c = 0 (a) and c = 1 (b) by bytes: a's odd bytes <-> b's even ones,
        # so a holds the even bytes of both (tr = 0, 2), b the odd ones.
        _delta_swap(p[:, 0], p[:, 1], t, 8, _EVEN_BYTES)

    def units() -> None:
        # Middle 16-bit units swapped: each int32 half is one output word.
        for x in halves:
            _delta_swap(x, x, t.view(-1), 16, _MID_UNIT)

    def warps() -> None:
        # Words of warps 2wh and 2wh+1 paired: low halves together, high ones
        # (wl = 1's low half <-> wl = 0's high half).
        _delta_swap(p[0], p[1], t, 32, _LOW_WORD)

    steps = [nibbles, interleave, units, warps]
    for step in reversed(steps) if inverse else steps:
        step()


def _as_planes(strips: torch.Tensor) -> torch.Tensor:
    """int64 strips [u, 64 rows, kt] as [wl, c, wh, u, col, kt] (a view):
    row warp*16 + c*8 + col, warp = wh*2 + wl."""
    u, _, kt = strips.shape
    return strips.view(u, 2, 2, 2, 8, kt).permute(2, 3, 1, 0, 4, 5)


class _Planes:
    """Scratch for ``units`` strips of code rows as 8 planes of words
    (:func:`_shuffle_planes`): 1.5 strip bytes per unit plus its row index."""

    def __init__(self, rows: torch.Tensor, units: int, kt: int):
        dev = rows.device
        self.rows, self.kt = rows, kt
        self.planes = torch.empty(units * 64 * kt, dtype=torch.int64, device=dev)
        self.scratch = torch.empty(units * 32 * kt, dtype=torch.int64, device=dev)
        self.idx = torch.empty(64 * units, dtype=torch.int64, device=dev)
        # row warp*16 + c*8 + col of a strip, by (plane (wl, c, wh), col)
        off = torch.arange(64, dtype=torch.int64, device=dev).view(2, 2, 2, 8)
        self.off = off.permute(1, 2, 0, 3).reshape(8, 1, 8)

    @staticmethod
    def nbytes(units: int, kt: int) -> int:
        return units * (64 * kt * 8 * 3 // 2 + 512)

    def view(self, u: int) -> torch.Tensor:
        """The first ``u`` units of planes: [8, u*8*kt]."""
        return self.planes[: u * 64 * self.kt].view(8, -1)

    def fill(self, pieces: list[torch.Tensor]) -> torch.Tensor:
        """Copy the strips of ``pieces`` (int64 [u_i, 64, kt] views of the
        rows, in unit order) into the planes and shuffle: planes [8, u*8*kt]
        of output words (nothing is written to the rows)."""
        u = sum(piece.shape[0] for piece in pieces)
        view = self.view(u)
        dst = view.view(2, 2, 2, u, 8, self.kt)
        u0 = 0
        for piece in pieces:  # row copies, runs of kt words
            dst[:, :, :, u0 : u0 + piece.shape[0]].copy_(_as_planes(piece))
            u0 += piece.shape[0]
        _shuffle_planes(view, self.scratch)
        return view

    def drain(
        self, bases: torch.Tensor, load: Callable[[torch.Tensor], None]
    ) -> Callable[[], object]:
        """The inverse: ``load(planes)`` fills planes [8, u*8*kt] with output
        words; unshuffled, they are for the strips whose first rows are
        ``bases`` [u]. Returns that write (one ``index_copy_``, the only one,
        from the planes)."""
        u = bases.numel()
        view = self.view(u)
        load(view)
        _shuffle_planes(view, self.scratch, inverse=True)
        ix = self.idx[: 64 * u].view(8, u, 8)
        torch.add(bases.view(1, u, 1), self.off, out=ix)
        return lambda: self.rows.index_copy_(0, ix.view(-1), view.view(-1, self.kt))


# --- plans ------------------------------------------------------------------------


class _Plan:
    """The chunks of one bounded call: ``run(idx)`` for idx in range(len),
    each returning its write (see ``run_chunks``)."""

    def __init__(self) -> None:
        self.chunks: list[Callable[[], Callable[[], object] | None]] = []

    def __len__(self) -> int:
        return len(self.chunks)

    def run(self, idx: int) -> Callable[[], object] | None:
        return self.chunks[idx]()


def _run(
    t: torch.Tensor, make_plan: Callable[[], _Plan], progress: ChunkProgress | None
) -> None:
    """Build a call's plan (all its buffers) and run its chunks."""
    with torch.no_grad():
        plan = make_plan()
        run_chunks(len(plan), plan.run, progress)


def _tile_source(nt: int, kt: int, rs: int, inverse: bool) -> torch.Tensor:
    """int64 [nt*kt]: for each final tile position, where that tile is now.

    Forward: strip order (s*kt + k) -> packed order (k*nt + j), output strip
    j taken from strip (j + rs) % nt. Inverse: back."""
    q = torch.arange(nt * kt, dtype=torch.int64)
    if not inverse:
        k, j = q // nt, q % nt
        return ((j + rs) % nt) * kt + k
    s, k = q // kt, q % kt
    return k * nt + (s - rs) % nt


def _plan_bytes(tiles: int) -> int:
    # the source permutation (8 B a tile) and the plan's two index lists
    # (at most 2 entries a tile each), allocated while the plan is built
    return 40 * tiles


def _add_cycles(
    plan: _Plan,
    words: torch.Tensor,
    e: int,
    nt: int,
    kt: int,
    rs: int,
    tile: int,
    room: int,
    inverse: bool,
) -> None:
    """Append the cycle-following chunks of every expert of ``words``."""
    per = (room - _plan_bytes(nt * kt)) // (tile + 16)
    cycles = TileCyclePlan(_tile_source(nt, kt, rs, inverse), max(2, per), words.device)
    if cycles.num_chunks == 0:
        return
    width = tile // 8
    flat = words.view(torch.uint8).reshape(-1)
    tiles = flat.view(torch.int64).view(e * nt * kt, width)
    k = cycles.largest
    buf = torch.empty((k, width), dtype=torch.int64, device=words.device)
    isrc = torch.empty(k, dtype=torch.int64, device=words.device)
    idst = torch.empty(k, dtype=torch.int64, device=words.device)
    for g in range(e):
        for c in range(cycles.num_chunks):
            plan.chunks.append(
                functools.partial(cycles.apply_chunk, tiles, g, c, buf, isrc, idst)
            )


def _scale_unit_bytes(span: int, c: int) -> int:
    # rows (1 B a scale), the int32 index (4 B), the row indices (16 B a row)
    return span * (5 * c + 16)


def w4a16_min_transient_bytes(n: int, k: int, scale: bool = False) -> int:
    """The smallest cap the bounded W4A16 functions accept for a [E, N, K/2]
    weight (``scale=False``) or its [E, N, K/16] block scales: one strip of
    64 rows with its scratch and the cycle plan of one expert with a buffer
    of two tiles (less is needed when a whole expert fits)."""
    tiles = (n // W4A16_TILE_N) * (k // W4A16_TILE_K)
    if scale:
        strip, tile = _scale_unit_bytes(W4A16_TILE_N, k // 16), _SCALE_TILE
    else:
        strip, tile = _Planes.nbytes(1, k // 16), _WEIGHT_TILE
    return strip + _plan_bytes(tiles) + 2 * (tile + 16) + _overhead(n)


def _check_budget(name: str, n: int, k: int, budget: int, scale: bool) -> None:
    need = w4a16_min_transient_bytes(n, k, scale)
    if budget + _overhead(n) < need:
        raise ValueError(
            f"max_transient_bytes={budget + _overhead(n)} is below what the "
            "W4A16 preparation "
            f"of {name} [., {n}, .] with K = {k} needs at the least ({need} "
            "bytes: one strip of 64 rows and the cycle plan of one expert)"
        )


def _strip_units(budget: int, per_unit: int, total: int) -> int:
    """Strips per chunk: up to half the budget (the rest for the cycles)."""
    return max(1, min(total, (budget // 2) // per_unit))


def _geometry(name: str, t: torch.Tensor, rotate: int, per_row: int):
    e, n, c = t.shape
    k = c * per_row
    _check_rotate(name, n, rotate)
    if k % W4A16_TILE_K != 0:
        raise ValueError(f"{name}: W4A16 needs K = {k} to be a multiple of 16")
    return e, n, k, n // W4A16_TILE_N, k // W4A16_TILE_K


# --- weights -------------------------------------------------------------------


def _weight_plan(weight: torch.Tensor, rotate: int, cap: int, inverse: bool) -> _Plan:
    e, n, k, nt, kt = _geometry("weight", weight, rotate, 2)
    budget = _budget(check_cap(cap), weight.device, n)
    dev = weight.device
    plan = _Plan()
    if weight.numel() == 0:
        return plan
    rows = weight.view(torch.int64).view(e * n, kt)
    words = weight.view(torch.int64)
    per_expert = _Planes.nbytes(nt, kt) + 16 * nt
    if per_expert <= budget:  # A: whole experts, rotated on the way
        g = min(e, budget // per_expert)
        work = _Planes(rows, g * nt, kt)
        out = words.view(e, kt, nt, 8, 4, 2)
        expert_strips = words.view(e, nt, 64, kt)
        rs = rotate // 64
        rolled = (torch.arange(nt, device=dev) * 64 + rotate) % n

        def experts(e0: int, ge: int) -> Callable[[], object]:
            dst = out[e0 : e0 + ge]
            if not inverse:
                # output strip j of each expert is strip (j + rs) % nt
                src = expert_strips[e0 : e0 + ge]
                if rs:
                    pieces = [q for x in range(ge) for q in (src[x, rs:], src[x, :rs])]
                else:
                    pieces = [src.reshape(ge * nt, 64, kt)]
                view = _expert_view(work.fill(pieces), ge, nt, kt)
                return lambda: dst.copy_(view)  # the only write
            first = torch.arange(e0, e0 + ge, device=dev).view(-1, 1) * n
            bases = (first + rolled.view(1, -1)).view(-1)
            return work.drain(bases, lambda p: _expert_view(p, ge, nt, kt).copy_(dst))

        for e0 in range(0, e, g):
            plan.chunks.append(functools.partial(experts, e0, min(g, e - e0)))
        return plan
    # B: strips in place (tiles in strip order) and the tile transposition
    _check_budget("weight", n, k, budget, scale=False)
    g = _strip_units(budget, _Planes.nbytes(1, kt), e * nt)
    work = _Planes(rows, g, kt)
    out = words.view(e * nt, kt, 8, 4, 2)

    all_strips = words.view(e * nt, 64, kt)

    def strips(s0: int, gs: int) -> Callable[[], object]:
        dst = out[s0 : s0 + gs]
        if not inverse:
            view = _strip_view(work.fill([all_strips[s0 : s0 + gs]]), gs, kt)
            return lambda: dst.copy_(view)  # the only write
        bases = torch.arange(s0, s0 + gs, device=dev) * 64
        return work.drain(bases, lambda p: _strip_view(p, gs, kt).copy_(dst))

    room = budget - _Planes.nbytes(g, kt)
    if inverse:
        _add_cycles(plan, weight, e, nt, kt, rotate // 64, _WEIGHT_TILE, room, True)
    for s0 in range(0, e * nt, g):
        plan.chunks.append(functools.partial(strips, s0, min(g, e * nt - s0)))
    if not inverse:
        _add_cycles(plan, weight, e, nt, kt, rotate // 64, _WEIGHT_TILE, room, False)
    return plan


def _expert_view(planes: torch.Tensor, ge: int, nt: int, kt: int) -> torch.Tensor:
    """Planes of ``ge`` whole experts as [ge, kt, nt, col, tr, wh] words."""
    return planes.view(4, 2, ge, nt, 8, kt).permute(2, 5, 3, 4, 0, 1)


def _strip_view(planes: torch.Tensor, gs: int, kt: int) -> torch.Tensor:
    """Planes of ``gs`` strips as [gs, kt, col, tr, wh] words."""
    return planes.view(4, 2, gs, 8, kt).permute(2, 4, 3, 0, 1)


def repack_w4a16_weight_(
    weight: torch.Tensor,
    *,
    rotate: int = 0,
    max_transient_bytes: int = DEFAULT_MAX_TRANSIENT_BYTES,
    progress: ChunkProgress | None = None,
) -> torch.Tensor:
    """Rewrite packed FP4 weights uint8 [E, N, K/2] into the W4A16 codes
    layout in place; return the int32 [E, K/16, (N/64) * 128] view of the
    same storage (the bytes of ``w4a16_pack_weight(weight, rotate)``).

    ``rotate`` (a multiple of 64): output row j is input row (j + rotate) % N.
    At most ``min(max_transient_bytes, 2 MiB on CPU / 16 MiB on CUDA)`` is
    allocated, all before the first write; experts larger than that go strip
    by strip (ValueError below :func:`w4a16_min_transient_bytes`).
    ``progress`` resumes an interrupted call (same tensor, rotate and cap).
    """
    _check("weight", weight, torch.uint8)
    _run(
        weight,
        lambda: _weight_plan(weight, rotate, max_transient_bytes, False),
        progress,
    )
    e, n, half_k = weight.shape
    return weight.view(torch.int32).view(e, 2 * half_k // 16, n // 64 * 128)


def unrepack_w4a16_weight_(
    weight: torch.Tensor,
    *,
    rotate: int = 0,
    max_transient_bytes: int = DEFAULT_MAX_TRANSIENT_BYTES,
    progress: ChunkProgress | None = None,
) -> torch.Tensor:
    """Undo :func:`repack_w4a16_weight_` in place: ``weight`` is the uint8
    [E, N, K/2] tensor whose storage holds the W4A16 codes; returns it with
    the loaded bytes back. Same memory and chunks, run backwards."""
    _check("weight", weight, torch.uint8)
    _run(
        weight,
        lambda: _weight_plan(weight, rotate, max_transient_bytes, True),
        progress,
    )
    return weight


# --- block scales -----------------------------------------------------------------


def _scale_plan(
    scale: torch.Tensor, exponent: int, rotate: int, cap: int, inverse: bool
) -> _Plan:
    e, n, k, nt, c = _geometry("scale", scale, rotate, 16)
    budget = _budget(check_cap(cap), scale.device, n)
    dev = scale.device
    plan = _Plan()
    if scale.numel() == 0:
        return plan
    flat = scale.view(torch.uint8).view(-1)
    rows = flat.view(e * n, c)
    if inverse:
        table = w4a16_blockscale_inverse_table(exponent, dev)
    else:
        table = w4a16_blockscale_table(exponent, dev)
    perm = torch.tensor(_W4A16_SCALE_ROWS, dtype=torch.int64, device=dev)
    whole = _scale_unit_bytes(n, c) <= budget
    if whole:  # A: whole experts
        units, span, count = min(e, budget // _scale_unit_bytes(n, c)), n, e
        strip = torch.arange(nt, device=dev).view(-1, 1) * 64
        base = ((strip + perm + rotate) % n).reshape(1, n)
    else:  # B: strips in place, then the tile transposition
        _check_budget("scale", n, k, budget, scale=True)
        units = _strip_units(budget, _scale_unit_bytes(W4A16_TILE_N, c), e * nt)
        span, count, base = W4A16_TILE_N, e * nt, perm.view(1, -1)
    rowbuf = torch.empty((units * span, c), dtype=torch.uint8, device=dev)
    index = torch.empty(units * span * c, dtype=torch.int32, device=dev)
    ridx = torch.empty(units * span, dtype=torch.int64, device=dev)

    def chunk(u0: int, gu: int) -> Callable[[], object]:
        first = torch.arange(u0, u0 + gu, device=dev).view(-1, 1) * span
        r = ridx[: gu * span]
        torch.add(first, base, out=r.view(gu, span))
        ix = index[: gu * span * c]
        rb = rowbuf[: gu * span]
        dst = flat[u0 * span * c : (u0 + gu) * span * c]
        if not inverse:
            torch.index_select(rows, 0, r, out=rb)
            ix.view(gu, c, span).copy_(rb.view(gu, span, c).transpose(1, 2))
            return lambda: torch.index_select(table, 0, ix, out=dst)  # the only write
        else:
            ix.copy_(dst)
            # the re-encoded scales, by (unit, column, row) in rb's bytes
            torch.index_select(table, 0, ix, out=rb.view(-1))
            ix.view(gu, span, c).copy_(rb.view(gu, c, span).transpose(1, 2))
            rb.view(-1).copy_(ix)
            return lambda: rows.index_copy_(0, r, rb)  # the only write

    if inverse and not whole:
        room = budget - units * _scale_unit_bytes(span, c)
        _add_cycles(plan, scale, e, nt, c, rotate // 64, _SCALE_TILE, room, True)
    for u0 in range(0, count, units):
        plan.chunks.append(functools.partial(chunk, u0, min(units, count - u0)))
    if not inverse and not whole:
        room = budget - units * _scale_unit_bytes(span, c)
        _add_cycles(plan, scale, e, nt, c, rotate // 64, _SCALE_TILE, room, False)
    return plan


def pack_w4a16_blockscale_(
    scale: torch.Tensor,
    exponent: int,
    *,
    rotate: int = 0,
    max_transient_bytes: int = DEFAULT_MAX_TRANSIENT_BYTES,
    progress: ChunkProgress | None = None,
) -> torch.Tensor:
    """Rewrite linear block scales float8_e4m3fn [E, N, K/16] into the W4A16
    packed scales in place; return the [E, K/16, N] view of the same storage
    (the bytes of ``w4a16_pack_blockscale(scale, exponent, rotate)``).

    ``exponent``: ``w4a16_scale_exponent`` of the loaded scales (all
    experts), taken before this call. Memory (5 bytes a scale plus 8 a row
    when whole experts fit), chunks and ``progress`` as
    :func:`repack_w4a16_weight_`.
    """
    _check("scale", scale, torch.float8_e4m3fn)
    _run(
        scale,
        lambda: _scale_plan(scale, exponent, rotate, max_transient_bytes, False),
        progress,
    )
    e, n, c = scale.shape
    return scale.view(e, c, n)


def unpack_w4a16_blockscale_(
    scale: torch.Tensor,
    exponent: int,
    *,
    rotate: int = 0,
    max_transient_bytes: int = DEFAULT_MAX_TRANSIENT_BYTES,
    progress: ChunkProgress | None = None,
) -> torch.Tensor:
    """Undo :func:`pack_w4a16_blockscale_` in place up to the flush (a scale
    the packing flushed comes back 0): ``scale`` is the float8_e4m3fn
    [E, N, K/16] tensor whose storage holds the packed scales; returns it."""
    _check("scale", scale, torch.float8_e4m3fn)
    _run(
        scale,
        lambda: _scale_plan(scale, exponent, rotate, max_transient_bytes, True),
        progress,
    )
    return scale
