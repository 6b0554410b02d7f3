# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""FlashInfer 0.7.4's W4A16 runtime layout (b12x, ``quant_mode="w4a16"``)
in pure torch: packing the weights, the block scales and the global scale into
it and back, and the weights the kernel multiplies read from it."""

from __future__ import annotations

import math

import torch

from vllm.model_executor.layers.quantization.utils.nvfp4_format import (
    FLOAT8_E4M3_MAX,
    NVFP4_BLOCK_SIZE,
    e2m1_decode,
    pack_fp4,
    unpack_fp4,
)

__all__ = [
    "W4A16_GLOBAL_SCALE_FACTOR",
    "W4A16_TILE_K",
    "W4A16_TILE_N",
    "w4a16_alpha",
    "w4a16_blockscale_inverse_table",
    "w4a16_blockscale_table",
    "w4a16_blockscale_values",
    "w4a16_dequantize",
    "w4a16_global_scale",
    "w4a16_pack_blockscale",
    "w4a16_pack_weight",
    "w4a16_scale_exponent",
    "w4a16_unpack_blockscale",
    "w4a16_unpack_weight",
]

# The layout.
#
# Per expert, a weight [N, K] (N output rows, K the reduction) becomes:
#
# * codes: int32 [K/16, (N/64) * 128], tiles of 16 (k) x 64 (n) codes, tile
#   (kt, nt) at words [kt, nt*128 : nt*128+128]. With n = nt*64 + warp*16 +
#   c*8 + col and k = kt*16 + ab*8 + tr*2 + h, word col*16 + tr*4 + warp of
#   the tile holds, nibble by nibble (slot 0 lowest), the codes
#   (h, c, ab) = (0,0,0) (0,0,1) (0,1,0) (0,1,1) (1,0,0) ... (1,1,1):
#
#       slot:  0      1       2      3       4        5        6        7
#       k:     2tr    2tr+8   2tr    2tr+8   2tr+1    2tr+9    2tr+1    2tr+9
#       n:     col1   col1    col2   col2    col1     col1     col2     col2
#       (col1 = warp*16 + col, col2 = col1 + 8, in tile coordinates)
#
# * block scales: [K/16, N] bytes, transposed, each 64 columns permuted
#   (an 8x8 transpose, then [0, 2, 1, 3] within each 4: output column
#   p <- row _W4A16_SCALE_ROWS[p]) and re-encoded: the E4M3 value v times
#   2^x (x: :func:`w4a16_scale_exponent`) times 2^7 as an FP16 number, whose
#   bits 14..7 are the byte; values under 2 (v * 2^x < 2^-6) become 0.
# * global scale: the dequantization-direction scale_2 times 2^119 / 2^x.
#
# ``rotate`` = r takes output row j from input row (j + r) % N: with r = I a
# [w3; w1] (up; gate) w13 becomes the kernel's [w1; w3] (gate; up).

#: Rows (output channels) and K elements of one W4A16 tile.
W4A16_TILE_N = 64
W4A16_TILE_K = 16
#: 2^119 = 2^(126 - 7): the kernel reads E2M1 codes placed in BF16 bits
#: (exponent bias difference 126) and block scales carried times 2^7.
W4A16_GLOBAL_SCALE_FACTOR = 2.0**119


def _w4a16_scale_rows() -> list[int]:
    rows = []
    for p in range(W4A16_TILE_N):
        q = 4 * (p // 4) + (0, 2, 1, 3)[p % 4]  # [0, 2, 1, 3] within each 4
        rows.append(8 * (q % 8) + q // 8)  # the 8x8 transpose
    return rows


#: Output column p of each 64 of a packed W4A16 block-scale row comes from
#: input row _W4A16_SCALE_ROWS[p] of those 64; row r went to column
#: _W4A16_SCALE_COLS[r] (the inverse).
_W4A16_SCALE_ROWS = _w4a16_scale_rows()
_W4A16_SCALE_COLS = [_W4A16_SCALE_ROWS.index(r) for r in range(W4A16_TILE_N)]


def _check_w4a16_rows(name: str, n: int, rotate: int) -> None:
    if n % W4A16_TILE_N != 0:
        raise ValueError(
            f"{name}: W4A16 needs the rows (N = {n}) to be a multiple of {W4A16_TILE_N}"
        )
    if not 0 <= rotate < max(n, 1):
        raise ValueError(f"{name}: rotate must be in [0, {n}), got {rotate}")


def w4a16_pack_weight(weight: torch.Tensor, rotate: int = 0) -> torch.Tensor:
    """Packed FP4 weights uint8 [E, N, K/2] -> W4A16 codes int32
    [E, K/16, (N/64) * 128] (see the layout above); a new tensor.

    N must be a multiple of 64 and K of 16. Output row j is input row
    (j + rotate) % N."""
    e, n, half_k = weight.shape
    k = 2 * half_k
    _check_w4a16_rows("weight", n, rotate)
    if k % W4A16_TILE_K != 0:
        raise ValueError(f"weight: W4A16 needs K = {k} to be a multiple of 16")
    codes = unpack_fp4(weight)  # [E, N, K]
    if rotate:
        codes = torch.roll(codes, -rotate, dims=1)
    kt, nt = k // W4A16_TILE_K, n // W4A16_TILE_N
    # [e, nt, warp, c, col, kt, ab, tr, h] -> [e, kt, nt, col, tr, warp, h, c, ab]
    tiles = codes.view(e, nt, 4, 2, 8, kt, 2, 4, 2).permute(0, 5, 1, 4, 7, 2, 8, 3, 6)
    return pack_fp4(tiles.reshape(e, kt, -1)).view(torch.int32)


def w4a16_unpack_weight(packed: torch.Tensor, rotate: int = 0) -> torch.Tensor:
    """Inverse of :func:`w4a16_pack_weight`: int32 [E, K/16, (N/64) * 128]
    -> uint8 [E, N, K/2]; a new tensor."""
    e, kt, words = packed.shape
    nt = words // 128
    n = nt * W4A16_TILE_N
    _check_w4a16_rows("packed", n, rotate)
    codes = unpack_fp4(packed.contiguous().view(torch.uint8))
    rows = codes.view(e, kt, nt, 8, 4, 4, 2, 2, 2).permute(0, 2, 5, 7, 3, 1, 8, 4, 6)
    rows = rows.reshape(e, n, kt * W4A16_TILE_K)
    if rotate:
        rows = torch.roll(rows, rotate, dims=1)
    return pack_fp4(rows)


def w4a16_scale_exponent(scale: torch.Tensor) -> int:
    """X of the power-of-two factor 2^x FlashInfer applies to one weight's
    block scales (all experts): the largest x with max * 2^x <= 448, or 0
    when the largest scale is 0 or 448. Read on the raw bytes (E4M3 order is
    byte order for non-negative scales), as FlashInfer does."""
    if scale.numel() == 0:
        return 0
    top = scale.reshape(-1).view(torch.uint8).max().view(torch.float8_e4m3fn)
    mx = float(top.float()) * 2**7
    if 0.0 < mx < FLOAT8_E4M3_MAX * 2**7:
        return int(math.floor(math.log2((FLOAT8_E4M3_MAX * 2**7) / mx)))
    return 0


def w4a16_blockscale_table(exponent: int, device=None) -> torch.Tensor:
    """uint8 [256]: the packed byte of each E4M3 block-scale byte for factor
    2^exponent: FP16 bits 14..7 of v * 2^exponent * 2^7, 0 under 2."""
    v = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    x = v * 2.0**exponent * 2**7
    x = torch.where(x < 2, torch.zeros_like(x), x)
    bits = x.to(torch.float16).view(torch.int16) >> 7
    return (bits & 0xFF).to(torch.uint8).to(device)


def w4a16_blockscale_inverse_table(exponent: int, device=None) -> torch.Tensor:
    """uint8 [256]: the E4M3 byte each packed block-scale byte decodes to for
    factor 2^exponent (inverse of :func:`w4a16_blockscale_table` on the
    bytes it produces; a flushed scale, byte 0, decodes to 0)."""
    packed = torch.arange(256, dtype=torch.uint8)
    v = w4a16_blockscale_values(packed) / (2.0**exponent * 2**7)
    return v.to(torch.float8_e4m3fn).view(torch.uint8).to(device)


def w4a16_blockscale_values(packed_scale: torch.Tensor) -> torch.Tensor:
    """float32 of the packed scale bytes as the kernel multiplies them: the
    FP16 number whose bits 14..7 are the byte (v * 2^x * 2^7, or 0)."""
    bits = packed_scale.view(torch.uint8).to(torch.int16) << 7
    return bits.view(torch.float16).float()


def w4a16_pack_blockscale(
    scale: torch.Tensor, exponent: int, rotate: int = 0
) -> torch.Tensor:
    """Linear E4M3 block scales [E, N, K/16] -> the W4A16 packed scales
    float8_e4m3fn-typed bytes [E, K/16, N] (see the layout above); new."""
    e, n, c = scale.shape
    _check_w4a16_rows("scale", n, rotate)
    b = scale.view(torch.uint8)
    if rotate:
        b = torch.roll(b, -rotate, dims=1)
    rows = torch.tensor(_W4A16_SCALE_ROWS, device=scale.device)
    t = b.transpose(1, 2).reshape(e, c, n // W4A16_TILE_N, W4A16_TILE_N)[..., rows]
    table = w4a16_blockscale_table(exponent, scale.device)
    return table[t.long()].reshape(e, c, n).view(torch.float8_e4m3fn)


def w4a16_unpack_blockscale(
    packed_scale: torch.Tensor, exponent: int, rotate: int = 0
) -> torch.Tensor:
    """Inverse of :func:`w4a16_pack_blockscale` up to the flush (a flushed
    scale comes back 0): [E, K/16, N] -> float8_e4m3fn [E, N, K/16]; new."""
    e, c, n = packed_scale.shape
    _check_w4a16_rows("packed_scale", n, rotate)
    table = w4a16_blockscale_inverse_table(exponent, packed_scale.device)
    b = table[packed_scale.view(torch.uint8).long()]
    cols = torch.tensor(_W4A16_SCALE_COLS, device=b.device)
    b = b.reshape(e, c, n // W4A16_TILE_N, W4A16_TILE_N)[..., cols]
    b = b.reshape(e, c, n).transpose(1, 2)
    if rotate:
        b = torch.roll(b, rotate, dims=1)
    return b.contiguous().view(torch.float8_e4m3fn)


def w4a16_global_scale(
    global_scale: torch.Tensor, exponent: int, source_format: str = "modelopt"
) -> torch.Tensor:
    """The kernel's per-expert global scale, float32: ``scale_2 * 2^119 /
    2^exponent``. ``source_format="modelopt"`` takes ``weight_scale_2``
    (dequantization direction); ``"compressed_tensors"`` takes
    ``weight_global_scale`` (quantization direction) and inverts it."""
    if source_format == "compressed_tensors":
        g = 1.0 / global_scale.float()
    elif source_format == "modelopt":
        g = global_scale.float()
    else:
        raise ValueError(
            "source_format must be 'modelopt' or 'compressed_tensors', got "
            f"{source_format!r}"
        )
    return g * W4A16_GLOBAL_SCALE_FACTOR / 2.0**exponent


def w4a16_dequantize(packed: torch.Tensor, packed_scale: torch.Tensor) -> torch.Tensor:
    """The weights the kernel multiplies, before its per-expert alpha
    (:func:`w4a16_alpha`), read from the packed layout alone: float32
    [E, N, K] (rows in the packed order), e2m1 * block scale value (a flushed
    scale is 0; the others are v * 2^x * 2^7)."""
    codes = unpack_fp4(w4a16_unpack_weight(packed))  # [E, N, K]
    cols = torch.tensor(_W4A16_SCALE_COLS, device=packed.device)
    e, c, n = packed_scale.shape
    s = packed_scale.view(torch.uint8).reshape(e, c, n // W4A16_TILE_N, -1)
    s = w4a16_blockscale_values(s[..., cols].reshape(e, c, n)).transpose(1, 2)
    w = e2m1_decode(codes).unflatten(-1, (-1, NVFP4_BLOCK_SIZE)) * s.unsqueeze(-1)
    return w.flatten(-2)


def w4a16_alpha(packed_global: torch.Tensor) -> torch.Tensor:
    """The multiplier of a GEMM's output on :func:`w4a16_dequantize`'s
    weights: ``packed_global * 2^-126`` (= scale_2 * 2^-7 / 2^x), float32."""
    return packed_global.float() * 2.0**-126
