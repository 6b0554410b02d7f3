# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""FlashInfer b12x NVFP4 MoE experts (SM120/SM121) and their weight preparation.

``process_weights_after_loading`` turns a loaded ModelOpt NVFP4 layer into
what ``flashinfer.b12x_fused_moe`` reads, in bounded memory::

    checkpoint layout                         b12x layout
    w13_weight        [E, 2I, H/2] [w1; w3]   -> [w3; w1]          (in place)
    w13_weight_scale  [E, 2I, H/16] linear    -> fold, reorder, 128x4 swizzle
    w13_weight_scale_2 [E, 2]                 -> folded into the scales; 1
    w2_weight_scale   [E, H, I/16] linear     -> fold, 128x4 swizzle
    w2_weight_scale_2 [E]                     -> folded; 1
    (new) quant_config.w1_scale / w2_scale    MMA-layout views (no copy)
    (new) g1_alphas, g2_alphas [E]            1 after the fold
    (new) _fc2_input_scale [E]                1: FC2 input quantized dynamically

1. fold: each expert's global scale (and for w13, w1's and w3's own) is
   multiplied into its FP8 block scales on the linear layout, chunk by chunk;
2. reorder (gated only): ``reorder_w1w3_to_w3w1`` on the weight and the
   linear scales, before any swizzle (a half swap is only valid on the
   swizzled layout when I is a multiple of 128);
3. swizzle: in place, 128 rows at a time, padding included (the scale
   parameters are created with room for it: ``swizzles_block_scales``);
4. MMA-layout views of the swizzled scales, alphas, FC2 input scale.

Every step allocates at most ``max_transient_bytes``. (Scale parameters
made without room for the padding get a new padded tensor instead.)
"""

from __future__ import annotations

import functools
import importlib.util
from collections.abc import Callable

import torch

from vllm.model_executor.layers.fused_moe.activation import MoEActivation
from vllm.model_executor.layers.fused_moe.config import (
    FusedMoEConfig,
    FusedMoEQuantConfig,
)
from vllm.model_executor.layers.fused_moe.modular_kernel import (
    FusedMoEExperts,
    Support,
)
from vllm.model_executor.layers.quantization.utils.flashinfer_fp4_moe import (
    DEFAULT_MAX_TRANSIENT_BYTES,
    fold_global_scale_into_blockscale_,
    reorder_w1w3_to_w3w1,
    swizzle_blockscale_bounded,
)
from vllm.model_executor.layers.quantization.utils.nvfp4_utils import (
    blockscale_mma_layout_view,
)

__all__ = ["FlashInferB12xExperts", "is_flashinfer_b12x_moe_available"]


@functools.cache
def _flashinfer_b12x_support() -> Support:
    if not torch.cuda.is_available():
        return Support.no("needs a CUDA device (none is available)")
    major, minor = torch.cuda.get_device_capability()
    if major != 12:
        return Support.no(
            f"needs an SM120/SM121 GPU (compute capability 12.x), found "
            f"{major}.{minor} ({torch.cuda.get_device_name()})"
        )
    cuda = torch.version.cuda or "0"
    if int(cuda.split(".")[0]) < 13:
        return Support.no(f"needs CUDA 13 or newer, torch was built with {cuda}")
    if importlib.util.find_spec("flashinfer") is None:
        return Support.no(
            "needs flashinfer-python (pip install -r requirements/cuda.txt)"
        )
    try:
        from flashinfer import b12x_fused_moe  # noqa: F401
    except ImportError as e:
        return Support.no(f"flashinfer has no b12x_fused_moe ({e})")
    return Support.yes()


def is_flashinfer_b12x_moe_available() -> Support:
    """The one gate of the b12x kernel: SM120/121, CUDA 13+, flashinfer's
    ``b12x_fused_moe`` importable. Truthy, or falsy with the reason."""
    return _flashinfer_b12x_support()


def _replace_parameter(layer: torch.nn.Module, name: str, value: torch.Tensor):
    old = getattr(layer, name)
    if value is old:
        return
    delattr(layer, name)
    layer.register_parameter(
        name, torch.nn.Parameter(value, requires_grad=old.requires_grad)
    )


class FlashInferB12xExperts(FusedMoEExperts):
    """NVFP4 W4A4 experts on FlashInfer's b12x kernel (SM120/SM121).

    Activations are BF16 and quantized inside the kernel; the output is
    BF16. Supports ``silu`` (gated) and ``relu2``. No expert parallelism.
    """

    name = "flashinfer_b12x"
    wants_w3w1 = True
    swizzles_block_scales = True

    def __init__(
        self,
        moe: FusedMoEConfig,
        quant_config: FusedMoEQuantConfig,
        *,
        max_transient_bytes: int = DEFAULT_MAX_TRANSIENT_BYTES,
    ):
        super().__init__(moe, quant_config)
        self.max_transient_bytes = max_transient_bytes
        #: FC2 input global scale [E] float32; set by
        #: process_weights_after_loading, required by apply.
        self._fc2_input_scale: torch.Tensor | None = None

    # -- capability predicates ------------------------------------------------
    @classmethod
    def is_supported_device(cls, device: torch.device) -> Support:
        support = is_flashinfer_b12x_moe_available()
        if support and torch.device(device).type != "cuda":
            return Support.no(f"runs on CUDA devices, not {device}")
        return support

    @classmethod
    def supports_quant_scheme(cls, quant_dtype: str) -> Support:
        if quant_dtype != "nvfp4":
            return Support.no(f"supports NVFP4 weights only, not {quant_dtype!r}")
        return Support.yes()

    @classmethod
    def supports_activation(cls, activation: MoEActivation) -> Support:
        return Support.yes()  # silu and relu2: every MoEActivation

    # -- weight preparation ---------------------------------------------------
    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        """Prepare ``layer``'s NVFP4 parameters for b12x (see module doc).

        Parameters keep their identity where their shape does not change;
        padded swizzled scales replace their parameter. Skips the reorder
        when the loader already placed w13 as [w3; w1]
        (``layer.w13_loaded_as_w3w1``).
        """
        for _, step in self.preparation_steps(layer):
            step()

    def preparation_steps(
        self, layer: torch.nn.Module
    ) -> list[tuple[str, Callable[[], None]]]:
        """The preparation as named steps, run in order by
        ``process_weights_after_loading`` (benchmarks time them one by one):
        ``fold``, ``reorder``, ``swizzle``, ``finalize``."""
        cap = self.max_transient_bytes
        moe = self.moe
        e, h, rows = moe.num_experts, moe.hidden_dim, moe.w13_rows
        inter = moe.intermediate_size_per_partition

        @torch.no_grad()
        def fold() -> None:
            # Each expert's global scale (w1's and w3's own for w13) into its
            # FP8 block scales, on the linear layout; then the global is 1.
            for name in ("w13", "w2"):
                fold_global_scale_into_blockscale_(
                    getattr(layer, f"{name}_weight_scale"),
                    getattr(layer, f"{name}_weight_scale_2"),
                    max_transient_bytes=cap,
                )
                getattr(layer, f"{name}_weight_scale_2").fill_(1.0)

        @torch.no_grad()
        def reorder() -> None:
            # [w1; w3] -> [w3; w1] on the weight and the linear scales.
            if moe.is_act_and_mul and not getattr(layer, "w13_loaded_as_w3w1", False):
                reorder_w1w3_to_w3w1(
                    layer.w13_weight, layer.w13_weight_scale, dim=-2,
                    max_transient_bytes=cap,
                )  # fmt: skip
            layer.w13_loaded_as_w3w1 = moe.is_act_and_mul

        @torch.no_grad()
        def swizzle() -> None:
            for name in ("w13_weight_scale", "w2_weight_scale"):
                swizzled = swizzle_blockscale_bounded(
                    getattr(layer, name), max_transient_bytes=cap
                )
                _replace_parameter(layer, name, swizzled)

        @torch.no_grad()
        def finalize() -> None:
            qc = self.quant_config
            qc.w1_scale = blockscale_mma_layout_view(layer.w13_weight_scale, rows, h, e)
            qc.w2_scale = blockscale_mma_layout_view(layer.w2_weight_scale, h, inter, e)
            qc.g1_alphas = layer.w13_weight_scale_2[:, 0].contiguous()  # [E], tiny
            qc.g2_alphas = layer.w2_weight_scale_2.reshape(e).contiguous()
            # The kernel quantizes the FC1 and FC2 inputs dynamically; static
            # checkpoint input scales are not used by this backend.
            qc.a1_gscale = None
            qc.a2_gscale = None
            self._fc2_input_scale = torch.ones(
                e, dtype=torch.float32, device=layer.w13_weight.device
            )

        return [
            ("fold", fold),
            ("reorder", reorder),
            ("swizzle", swizzle),
            ("finalize", finalize),
        ]

    def _check_prepared(self) -> None:
        if self._fc2_input_scale is None:
            raise RuntimeError(
                f"{type(self).__name__}.apply called before "
                "process_weights_after_loading: _fc2_input_scale is unset"
            )

    # -- compute --------------------------------------------------------------
    def apply(self, hidden_states, w1, w2, topk_weights, topk_ids):
        self._check_prepared()
        from flashinfer import b12x_fused_moe

        qc = self.quant_config
        return b12x_fused_moe(
            hidden_states,
            w1,
            qc.w1_scale,
            w2,
            qc.w2_scale,
            topk_ids.to(torch.int32),
            topk_weights.float(),
            self.moe.num_experts,
            self.moe.experts_per_token,
            w1_alpha=qc.g1_alphas,
            w2_alpha=qc.g2_alphas,
            fc2_input_scale=self._fc2_input_scale,
            activation=self.moe.activation.flashinfer_name,
            quant_mode="nvfp4",
        )
