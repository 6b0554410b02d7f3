# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The branch's definitions in vLLM's quantization/utils/nvfp4_utils.py."""

import torch


def swizzle_blockscale_(scale: torch.Tensor) -> torch.Tensor:
    """`swizzle_blockscale` in place, one expert at a time, for contiguous
    [E, M, K] scales that need no padding (M % 128 == 0, K % 4 == 0); any
    other `scale` goes to `swizzle_blockscale`, which returns a new tensor."""
    padded = scale.ndim != 3 or scale.shape[1] % 128 or scale.shape[2] % 4
    if padded or not scale.is_contiguous():
        return swizzle_blockscale(scale)
    E, M, K = scale.shape
    expert = torch.empty_like(scale[0])
    for e in range(E):
        expert.copy_(scale[e])
        scale[e].view(M // 128, K // 4, 32, 4, 4).copy_(
            expert.view(M // 128, 4, 32, K // 4, 4).permute(0, 3, 2, 1, 4)
        )
    return scale
