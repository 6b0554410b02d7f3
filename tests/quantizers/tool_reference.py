# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""What a quantizer computed in memory, kept to compare the tree against:
per MoE layer, the tool's own dequantization of its expert weights and the
outputs of the tool's own function on :func:`~tests.quantizers.tiny_moe.
expert_inputs`, in four variants. Tool-independent: each tool's module
(``llmcompressor_tool``, ``modelopt_tool``) fills it in.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from tests.quantizers.tiny_moe import TinyMoE

__all__ = [
    "BF16_ACTIVATIONS",
    "BF16_GATE_UP_SWAPPED",
    "GATE_UP_SWAPPED",
    "GLOBAL_SCALE_ONE",
    "TOOL",
    "LayerReference",
    "QuantizedCase",
]

#: The tool's function as quantized: W4A4 (its NVFP4 activation quantizer
#: at the calibrated input scales in front of each GEMM) or weight-only.
TOOL = "tool"
#: The tool's function with its weights as quantized and BF16 activations
#: (the reference the tool's own W4A4 error is measured against).
BF16_ACTIVATIONS = "bf16_activations"
#: The tool's W4A4 function with every activation global scale 1 (W4A4
#: only): what a layer that ignores the calibrated scales computes.
GLOBAL_SCALE_ONE = "global_scale_one"
#: The tool's function (``TOOL``) with gate and up swapped:
#: ``silu(up) * gate``.
GATE_UP_SWAPPED = "gate_up_swapped"
#: ``BF16_ACTIVATIONS`` with gate and up swapped.
BF16_GATE_UP_SWAPPED = "bf16_gate_up_swapped"


@dataclass
class LayerReference:
    """One MoE layer as the tool holds it in memory.

    ``w13`` float32 [E, 2I, H] in [gate; up] order and ``w2`` float32
    [E, H, I]: the tool's own dequantization of its quantized weights.
    ``outputs[std][variant]``: BF16 [T, H], the tool's function on the
    inputs at ``std``, for every variant above (``GLOBAL_SCALE_ONE`` for W4A4
    only; for W4A16 ``BF16_ACTIVATIONS`` is ``TOOL``).
    """

    w13: torch.Tensor
    w2: torch.Tensor
    outputs: dict[float, dict[str, torch.Tensor]] = field(default_factory=dict)


@dataclass
class QuantizedCase:
    """A tiny model quantized by one tool with one scheme, its checkpoint
    written to ``checkpoint`` (sharded when ``sharded``), and what the tool
    held in memory before writing it. ``mode`` is what the experts are:
    ``"w4a4"`` or ``"w4a16"``. ``seconds``: quantizing, the references and
    the export together."""

    tool: str
    model: TinyMoE
    scheme: str
    mode: str
    checkpoint: Path
    sharded: bool
    layers: dict[int, LayerReference]
    seconds: float
