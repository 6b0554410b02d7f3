# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""``current_platform``: the hardware questions vLLM's kernels ask, answered by
torch (CUDA when a device is visible, else CPU)."""

from __future__ import annotations

from typing import NamedTuple

import torch

__all__ = ["DeviceCapability", "Platform", "current_platform"]


class DeviceCapability(NamedTuple):
    major: int
    minor: int

    def to_int(self) -> int:
        """``major * 10 + minor`` (12.0 -> 120)."""
        return self.major * 10 + self.minor


class Platform:
    """The part of vLLM's platform interface the NVFP4 MoE code uses."""

    def is_cuda(self) -> bool:
        return torch.cuda.is_available() and torch.version.cuda is not None

    def is_cuda_alike(self) -> bool:
        return torch.cuda.is_available()

    def is_cpu(self) -> bool:
        return not torch.cuda.is_available()

    def get_device_capability(self, device_id: int = 0) -> DeviceCapability | None:
        if not torch.cuda.is_available():
            return None
        return DeviceCapability(*torch.cuda.get_device_capability(device_id))

    def is_device_capability_family(self, capability: int, device_id: int = 0) -> bool:
        """Whether the device is any ``<major>.x`` of ``capability`` (120: 12.x)."""
        current = self.get_device_capability(device_id)
        return current is not None and current.to_int() // 10 == capability // 10

    def get_device_name(self, device_id: int = 0) -> str:
        if not torch.cuda.is_available():
            return "cpu"
        return torch.cuda.get_device_name(device_id)

    def num_compute_units(self, device_id: int | None = 0) -> int:
        """Streaming multiprocessors of CUDA device ``device_id``."""
        return torch.cuda.get_device_properties(device_id).multi_processor_count

    @property
    def device_name(self) -> str:
        return self.get_device_name()


current_platform = Platform()
