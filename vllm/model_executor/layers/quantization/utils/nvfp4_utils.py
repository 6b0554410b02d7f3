# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""NVFP4 block-scale layout helpers: the 128x4 swizzle."""

import torch

__all__ = ["swizzle_blockscale"]


def swizzle_blockscale(scale: torch.Tensor) -> torch.Tensor:
    """Rearrange block scales [R, C] or [E, R, C] into the 128x4 layout.

    Rows are padded with zeros to a multiple of 128 and columns to a multiple
    of 4; each group is viewed as (R/128, 4, 32, C/4, 4), i.e. row
    ``r = m_tile * 128 + inner_m * 32 + outer_m`` and column
    ``c = k_tile * 4 + inner_k``, and stored in the order
    (m_tile, k_tile, outer_m, inner_m, inner_k): each 128x4 tile becomes 512
    contiguous bytes, row ``outer_m`` of the tile holding the 16 scales
    (inner_m, inner_k).

    Returns a new contiguous tensor of shape [Rp, Cp] or [E, Rp, Cp] (the
    same dtype), whose bytes are the swizzled layout.
    """
    if scale.dim() not in (2, 3):
        raise ValueError(
            f"scale must be [R, C] or [E, R, C], got shape {tuple(scale.shape)}"
        )
    batched = scale if scale.dim() == 3 else scale.unsqueeze(0)
    e, r, c = batched.shape
    rp, cp = (r + 127) // 128 * 128, (c + 3) // 4 * 4
    if (rp, cp) != (r, c):
        padded = batched.new_zeros((e, rp, cp))
        padded[:, :r, :c] = batched
    else:
        padded = batched
    tiles = padded.view(e, rp // 128, 4, 32, cp // 4, 4)
    out = tiles.permute(0, 1, 4, 3, 2, 5).contiguous().view(e, rp, cp)
    return out if scale.dim() == 3 else out.squeeze(0)
