# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""FlashInfer b12x NVFP4 MoE experts (SM120/SM121) and their weight preparation.

``process_weights_after_loading`` turns a loaded ModelOpt NVFP4 layer into
what FlashInfer's b12x MoE (``B12xMoEWrapper``, called as
``flashinfer_b12x_call`` describes) reads, in bounded memory::

    checkpoint layout                         b12x layout
    w13_weight        [E, 2I, H/2] [w1; w3]   -> [w3; w1]          (in place)
    w13_weight_scale  [E, 2I, H/16] linear    -> reorder, 128x4 swizzle
    w13_weight_scale_2 [E, 2] (w1, w3)        -> (w3, w1); s_w1 -> g1_alphas
    w2_weight_scale   [E, H, I/16] linear     -> 128x4 swizzle
    w2_weight_scale_2 [E]                     -> x s_w3 / s_w1 -> g2_alphas
    (new) quant_config.w1_scale / w2_scale    the swizzled scales
    (new) w1_sf_mma / w2_sf_mma               their MMA-layout views (no copy)
    (new) _fc2_input_scale [E]                1: FC2 input quantized dynamically

0. validate: scales finite and positive (block scales finite), before any
   write;
1. fold: only in ``"fold"`` mode (upstream's contract): every global scale
   is multiplied into its FP8 block scales, chunk by chunk, and set to 1.
   Default ``global_scale_mode="alpha"``: nothing; the per-expert global
   scales become the kernel's alphas and no block scale is ever rewritten.
   An expert whose w1 (gate) and w3 (up) global scales differ gets
   w1_alpha = s_gate and w2_alpha = s_w2 * s_up / s_gate: SiLU-and-mul is
   linear in up, and FC2's input is quantized dynamically;
2. reorder (gated only): ``reorder_w1w3_to_w3w1`` on the weight and the
   linear scales (the [E, 2] global and input scales' columns follow),
   before any swizzle (a half swap is only valid on the
   swizzled layout when I is a multiple of 128);
3. swizzle: in place, 128 rows at a time, padding included (the scale
   parameters are created with room for it: ``swizzles_block_scales``);
4. MMA-layout views of the swizzled scales, alphas, FC2 input scale.

Every step allocates at most ``max_transient_bytes``. (Scale parameters
made without room for the padding get a new padded tensor instead.)

(Over 500 lines: the preparation steps, their recovery and the call they
prepare for are one contract, kept in one place; FlashInfer specifics live
in ``flashinfer_b12x_call``.)
"""

from __future__ import annotations

import functools
import importlib.util
import logging
from collections.abc import Callable

import torch

from vllm.model_executor.layers.fused_moe.activation import MoEActivation
from vllm.model_executor.layers.fused_moe.config import (
    FusedMoEConfig,
    FusedMoEQuantConfig,
)
from vllm.model_executor.layers.fused_moe.experts.flashinfer_b12x_call import (
    b12x_w4a4_config_problems,
    flashinfer_takes_input_global_scale,
    make_b12x_wrapper,
    warn_fold_fallback,
)
from vllm.model_executor.layers.fused_moe.experts.flashinfer_b12x_restore import (
    fold_to,
    replace_parameter,
    reset_load_layout,
    restore_exactly,
)
from vllm.model_executor.layers.fused_moe.modular_kernel import (
    FusedMoEExperts,
    Support,
)
from vllm.model_executor.layers.fused_moe.weight_prep_state import (
    PrepStatus,
    check_load_layout,
    get_prep_state,
    load_layout_ok,
)
from vllm.model_executor.layers.quantization.utils.blockscale_checks import (
    check_blockscale_values,
)
from vllm.model_executor.layers.quantization.utils.blockscale_swizzle import (
    swizzle_blockscale_bounded,
)
from vllm.model_executor.layers.quantization.utils.bounded_chunks import (
    DEFAULT_MAX_TRANSIENT_BYTES,
    moe_prep_threads,
)
from vllm.model_executor.layers.quantization.utils.flashinfer_fp4_moe import (
    reorder_w1w3_to_w3w1,
)
from vllm.model_executor.layers.quantization.utils.nvfp4_utils import (
    blockscale_mma_layout_view,
)

logger = logging.getLogger(__name__)

__all__ = [
    "GLOBAL_SCALE_MODES",
    "check_global_scales",
    "FlashInferB12xExperts",
    "is_flashinfer_b12x_moe_available",
    "recorded_prep_step",
]

#: How the weights' per-expert global scales reach the kernel (see
#: ``FlashInferB12xExperts.global_scale_mode``).
GLOBAL_SCALE_MODES = ("alpha", "fold")


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
        from flashinfer import B12xMoEWrapper  # noqa: F401
    except ImportError as e:
        return Support.no(f"flashinfer has no B12xMoEWrapper ({e})")
    return Support.yes()


def is_flashinfer_b12x_moe_available() -> Support:
    """The one gate of the b12x kernel: SM120/121, CUDA 13+, flashinfer's
    ``B12xMoEWrapper`` importable. Truthy, or falsy with the reason."""
    return _flashinfer_b12x_support()


def recorded_prep_step(experts, layer, state, steps) -> Callable[[], None]:
    """The last of ``steps`` as a recorded step, for every b12x experts class
    (W4A4 and W4A16): runs each step of ``steps`` not yet done, in order,
    records it once the device has finished it (``state.mark_done``),
    and marks the layer PREPARED after ``finalize``. Validation runs while
    the layer is still LOADING: a ValueError leaves it loadable and
    untouched. Holds the layer's lock."""

    def step() -> None:
        # Read once: no torch call (a tensor attribute is one) between a
        # step's last write and its record, where an interrupt could land.
        device = layer.w13_weight.device
        with state.lock:
            if state.status is PrepStatus.PREPARED:
                state.check_unchanged(layer)
                return
            if state.status is PrepStatus.RESTORING:
                experts.restore_load_layout(layer)
            if state.status is PrepStatus.LOADING:
                state.check_not_torn()
                check_load_layout(layer, experts.moe_config)
                name, validate = steps[0]
                validate()
                state.load_w3w1 = bool(getattr(layer, "w13_loaded_as_w3w1", False))
                state.mark_done(name, device, begin=PrepStatus.PREPARING)
            for name, fn in steps:
                if name not in state.done:
                    fn()
                    state.mark_done(name, device)
            if steps[-1][0] == "finalize":
                state.status = PrepStatus.PREPARED
                state.plans = {}
                state.writes_since_prepared = False
                state.record_prepared(layer)

    return step


def check_global_scales(
    layer: torch.nn.Module,
    first_expert: int,
    suffixes: tuple[str, ...] = ("weight_scale_2", "input_scale"),
) -> None:
    """ValueError naming the parameter, expert and shard of a global or input
    scale (``suffixes``: which of them; W4A16 reads no input scales) that is
    not finite and positive (scales set in memory, not loaded)."""
    first = "w3" if getattr(layer, "w13_loaded_as_w3w1", False) else "w1"
    shards = {"w13": (first, "w1" if first == "w3" else "w3"), "w2": ("w2",)}
    for prefix in ("w13", "w2"):
        for suffix in suffixes:
            name = f"{prefix}_{suffix}"
            t = getattr(layer, name, None)
            if t is None:
                continue
            values = t.detach().float().reshape(t.shape[0], -1)  # [E, G], tiny
            bad = ~(torch.isfinite(values) & (values > 0))
            if bool(bad.any()):
                e, g = (int(i) for i in bad.nonzero()[0])
                shard = shards[prefix][g] if values.shape[1] > 1 else prefix
                raise ValueError(
                    f"{name} of expert {first_expert + e} ({shard}) is "
                    f"{values[e, g].item()}: global and input scales must be "
                    "finite and positive"
                )


class FlashInferB12xExperts(FusedMoEExperts):
    """NVFP4 W4A4 experts on FlashInfer's b12x kernel (SM120/SM121).

    Activations are BF16 and quantized inside the kernel; the output is
    BF16. Supports ``silu`` (gated) and ``relu2``. No expert parallelism.
    What FlashInfer's W4A4 kernel cannot run is refused when the experts are
    created (:meth:`check_kernel_config`), not at the first forward.

    ``max_num_tokens``: None (default) calls FlashInfer eagerly; an int
    makes the call CUDA-graph capturable (FlashInfer's workspaces and output
    buffer for that many tokens are allocated at the first call; the output
    of ``apply`` is then that buffer, valid until the layer's next call).
    """

    name = "flashinfer_b12x"
    wants_w3w1 = True
    swizzles_block_scales = True

    def __init__(
        self,
        moe_config: FusedMoEConfig,
        quant_config: FusedMoEQuantConfig,
        *,
        max_transient_bytes: int = DEFAULT_MAX_TRANSIENT_BYTES,
        global_scale_mode: str = "alpha",
        max_num_tokens: int | None = None,
    ):
        super().__init__(moe_config, quant_config)
        if global_scale_mode not in GLOBAL_SCALE_MODES:
            raise ValueError(
                f"global_scale_mode must be one of {GLOBAL_SCALE_MODES}, got "
                f"{global_scale_mode!r}"
            )
        if max_num_tokens is not None and (
            isinstance(max_num_tokens, bool)
            or not isinstance(max_num_tokens, int)
            or max_num_tokens < 1
        ):
            raise ValueError(
                f"max_num_tokens must be a positive int or None, got {max_num_tokens!r}"
            )
        self.check_kernel_config(moe_config)
        self.max_transient_bytes = max_transient_bytes
        self.max_num_tokens = max_num_tokens
        #: FlashInfer's B12xMoEWrapper for this layer, built on the first
        #: apply (it needs the device); it keeps its weight views and folded
        #: alpha while the tensors it was given stay the same.
        self._wrapper = None
        #: "alpha" (default): each expert's weight global scale is the
        #: kernel's w1_alpha / w2_alpha and the FP8 block scales stay as
        #: loaded (exact). "fold": upstream's contract, the global scales
        #: folded into the block scales (rounded again in FP8) and alpha 1.
        self.global_scale_mode = global_scale_mode
        #: MMA-layout views [32, 4, M/128, 4, K/64, E] of the swizzled block
        #: scales (``quant_config.w1_scale`` / ``w2_scale``), what the kernel
        #: reads; set by process_weights_after_loading.
        self.w1_sf_mma: torch.Tensor | None = None
        self.w2_sf_mma: torch.Tensor | None = None
        #: FC2 input global scale [E] float32, all 1 (the kernel quantizes the
        #: FC2 input dynamically): ``quant_config.a2_gscale`` itself when the
        #: config has one, else a new tensor. Set by
        #: process_weights_after_loading, required by apply.
        self._fc2_input_scale: torch.Tensor | None = None
        #: FC1 input global scale [E] float32, all 1 (dynamic quantization,
        #: as before FlashInfer had the argument), made once by finalize in
        #: "alpha" mode: ``w1_alpha`` is then the weight's scale alone.
        #: None in "fold" mode (``w1_alpha`` = 1 plays both roles).
        self._fc1_input_scale: torch.Tensor | None = None

    @classmethod
    def check_kernel_config(cls, moe: FusedMoEConfig) -> None:
        """ValueError listing what FlashInfer's W4A4 b12x kernel (0.7.4)
        cannot run in ``moe``: BF16 activations, hidden size a multiple of
        128, intermediate size a multiple of 16, silu or relu2, no expert
        parallelism."""
        problems = b12x_w4a4_config_problems(moe)
        if problems:
            raise ValueError(
                f"MoE backend {cls.name!r} (FlashInfer b12x, W4A4) cannot run this "
                "layer: " + "; ".join(problems)
            )

    @classmethod
    def supports_unfolded_alpha(cls) -> Support:
        """Whether the kernel takes ``input_global_scale`` (FlashInfer >=
        0.6.17), so that ``w1_alpha`` can carry the weight's global scale
        without also scaling the FC1 input quantization."""
        return flashinfer_takes_input_global_scale()

    @property
    def effective_global_scale_mode(self) -> str:
        """``global_scale_mode``, or "fold" where the kernel cannot take an
        unfolded alpha (an older FlashInfer; logged once, with the reason)."""
        if self.global_scale_mode == "alpha":
            support = self.supports_unfolded_alpha()
            if not support:
                warn_fold_fallback(support.reason)
                return "fold"
        return self.global_scale_mode

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
        padded swizzled scales replace their parameter (a view of the same
        storage when it was made with room). Skips the reorder when the
        loader already placed w13 as [w3; w1] (``layer.w13_loaded_as_w3w1``).

        Safe to call again: on a prepared layer it changes nothing; after an
        exception it resumes (steps done are skipped, the interrupted one
        continues from its last whole chunk) and gives the bytes of an
        uninterrupted preparation. See ``weight_prep_state``.
        """
        # One thread setting for the whole preparation (see moe_prep_threads):
        # switching it per step would cost a thread-team restart each time.
        with get_prep_state(layer).lock, moe_prep_threads(layer.w13_weight.device):
            for _, step in self.preparation_steps(layer):
                step()

    def _scale_geometry(self, prefix: str) -> tuple[int, int, int]:
        moe = self.moe_config
        if prefix == "w13":
            return moe.num_experts, moe.w13_rows, moe.hidden_dim // 16
        inter = moe.intermediate_size_per_partition
        return moe.num_experts, moe.hidden_dim, inter // 16

    def preparation_steps(
        self, layer: torch.nn.Module
    ) -> list[tuple[str, Callable[[], None]]]:
        """The preparation as named steps, run in order by
        ``process_weights_after_loading`` (benchmarks time them one by one):
        ``validate``, ``fold``, ``reorder``, ``swizzle``, ``finalize``.

        Each step records itself in ``layer.weight_prep_state`` when done and
        is skipped when already done, so running the list again (or after an
        exception) completes the preparation without repeating anything.
        """
        cap = self.max_transient_bytes
        moe = self.moe_config
        e = moe.num_experts
        state = get_prep_state(layer)
        first_expert = getattr(layer, "_first_expert", 0)

        @torch.no_grad()
        def validate() -> None:
            # Before any write: bad scales leave the layer as loaded.
            check_global_scales(layer, first_expert)
            for name in ("w13_weight_scale", "w2_weight_scale"):
                check_blockscale_values(name, getattr(layer, name),
                                        first_expert=first_expert,
                                        max_transient_bytes=cap)  # fmt: skip

        @torch.no_grad()
        def fold() -> None:
            mode = self.effective_global_scale_mode
            for prefix in ("w13", "w2"):
                name = f"{prefix}_weight_scale"
                loaded = getattr(layer, f"{prefix}_weight_scale_2").reshape(e, -1)
                if mode == "fold":
                    # Upstream's contract: each expert's global scale (w1's and
                    # w3's own for w13) into its FP8 block scales; then it is 1.
                    target, after = loaded, 1.0
                elif name in state.folds:
                    target, after = torch.ones_like(loaded), None  # undo a fold
                else:
                    # "alpha": no block scale is rewritten. The global scales
                    # stay as loaded and become the kernel's alphas; an expert
                    # whose gate and up global scales differ carries the
                    # ratio s_up / s_gate in its FC2 alpha (_kernel_alphas).
                    continue
                fold_to(self, layer, state, prefix, target, after)

        @torch.no_grad()
        def reorder() -> None:
            # [w1; w3] -> [w3; w1] on the weight and the linear scales.
            if moe.is_act_and_mul and not getattr(layer, "w13_loaded_as_w3w1", False):
                reorder_w1w3_to_w3w1(
                    layer.w13_weight, layer.w13_weight_scale, dim=-2,
                    max_transient_bytes=cap, progress=state.progress_of("reorder"),
                )  # fmt: skip
            layer.w13_loaded_as_w3w1 = moe.is_act_and_mul

        @torch.no_grad()
        def swizzle() -> None:
            for prefix in ("w13", "w2"):
                name = f"{prefix}_weight_scale"
                n_e, r, c = self._scale_geometry(prefix)
                scale = getattr(layer, name)
                if tuple(scale.shape) != (n_e, r, c):
                    continue  # already replaced by its padded swizzled view
                swizzled = swizzle_blockscale_bounded(
                    scale, max_transient_bytes=cap,
                    storage_has_room=state.has_storage_room(name, scale),
                    progress=state.progress_of(f"swizzle.{name}"),
                )  # fmt: skip
                if swizzled.untyped_storage().data_ptr() != (
                    scale.untyped_storage().data_ptr()
                ):
                    # A new padded result: made for the padded layout.
                    state.record_storage_room(name, swizzled)
                replace_parameter(layer, name, swizzled)

        @torch.no_grad()
        def finalize() -> None:
            self._bind_prepared(layer)

        steps = [("validate", validate), ("fold", fold), ("reorder", reorder),
                 ("swizzle", swizzle), ("finalize", finalize)]  # fmt: skip
        return [
            (name, self._recorded(layer, state, steps[: i + 1]))
            for i, (name, _) in enumerate(steps)
        ]

    def _kernel_alphas(
        self, layer: torch.nn.Module
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The kernel's per-expert ``(w1_alpha, w2_alpha)``, each [E] float32,
        new tensors (tiny) computed from the prepared layer's global scales.

        ``w1_alpha`` is the gate's global scale (w1; the only row group of a
        non-gated layer). For gated experts whose up (w3) global scale
        differs, FC1 then computes ``up * s_gate / s_up``; SiLU-and-mul is
        linear in up, so the factor ``s_up / s_gate`` moves to FC2's output:
        ``w2_alpha = s_w2 * s_up / s_gate``. The FC2 input is quantized
        dynamically (global scale 1), so its scaling changes nothing else.
        After a fold every global scale is 1 and so are both alphas.
        """
        moe = self.moe_config
        e = moe.num_experts
        s13 = layer.w13_weight_scale_2.reshape(e, -1)  # [E, G]
        s2 = layer.w2_weight_scale_2.reshape(e)
        if not moe.is_act_and_mul:
            return s13[:, 0].contiguous(), s2.contiguous()
        # The [E, 2] columns stay in the order the layer was loaded in
        # (column g = row group g at load): [w3, w1] when w3 was placed first.
        up_col = 0 if get_prep_state(layer).load_w3w1 else 1
        s_up, s_gate = s13[:, up_col], s13[:, 1 - up_col]
        return s_gate.contiguous(), s2 * (s_up / s_gate)  # x / x is exactly 1

    def _bind_prepared(self, layer: torch.nn.Module) -> None:
        """The kernel's views of a prepared layer's parameters (no copy)."""
        qc = self.quant_config
        moe = self.moe_config
        e, h, rows = moe.num_experts, moe.hidden_dim, moe.w13_rows
        inter = moe.intermediate_size_per_partition
        # The config holds the swizzled scales; the kernel reads them through
        # MMA-layout views (no copy).
        qc.w1_scale = layer.w13_weight_scale
        qc.w2_scale = layer.w2_weight_scale
        self.w1_sf_mma = blockscale_mma_layout_view(qc.w1_scale, rows, h, e)
        self.w2_sf_mma = blockscale_mma_layout_view(qc.w2_scale, h, inter, e)
        qc.g1_alphas, qc.g2_alphas = self._kernel_alphas(layer)
        # The kernel quantizes the FC2 input dynamically: its global scale
        # is 1. Upstream hands the kernel the config's FC2 input scale
        # filled with 1; without one, a new [E] tensor of ones.
        ones = functools.partial(torch.ones, e, dtype=torch.float32,
                                 device=layer.w13_weight.device)  # fmt: skip
        if qc.a2_gscale is not None:
            qc.a2_gscale.fill_(1.0)
            self._fc2_input_scale = qc.a2_gscale
        else:
            self._fc2_input_scale = ones()
        alpha = self.effective_global_scale_mode == "alpha"
        self._fc1_input_scale = ones() if alpha else None

    def _drop_prepared(self) -> None:
        qc = self.quant_config
        qc.w1_scale = qc.w2_scale = qc.g1_alphas = qc.g2_alphas = None
        self.w1_sf_mma = self.w2_sf_mma = None
        self._fc2_input_scale = self._fc1_input_scale = None

    def _recorded(self, layer, state, steps):
        return recorded_prep_step(self, layer, state, steps)

    def restore_load_layout(self, layer: torch.nn.Module) -> None:
        """Return the layer, from any state, to the layout ``weight_loader``
        writes, in place and within the cap, so that new weights can be
        loaded into it (RL weight updates, sleep-mode wake-up).

        A step of an interrupted preparation that had started is finished (a
        step never started is not run: a preparation that failed, e.g. on a
        cap too small, does not block a reload); then the steps done are
        undone: the swizzled scales are unswizzled in place (their
        parameters become linear [E, R, C] views of the same storage), a
        reorder is undone when the layer was loaded as [w1; w3], and the
        global scale parameters get their loaded values back. A fold stays
        (``weight_prep_state.folds`` records it; the next preparation folds
        only what changed). The kernel's views are dropped: ``forward``
        refuses until the layer is prepared again. Resumable after an
        exception like the preparation.

        Where the bytes cannot be trusted (parameters modified, replaced or
        converted since the preparation, e.g. ``layer.to(torch.bfloat16)``)
        or the exact restore fails, the parameters get the load layout's
        shapes and dtypes (reusing their storage where it fits) and the
        layer is marked torn: preparing it is refused until a complete
        reload. Holds the layer's lock.
        """
        state = get_prep_state(layer)
        with state.lock:
            if state.status is PrepStatus.LOADING:
                if not load_layout_ok(layer, self.moe_config):
                    reset_load_layout(
                        self, layer, state, "parameters were replaced or converted"
                    )
                return
            changed = (
                state.changed(layer) if state.status is PrepStatus.PREPARED else {}
            )
            if changed:
                why = f"parameters changed after the preparation: {sorted(changed)}"
                reset_load_layout(self, layer, state, why)
                return
            try:
                restore_exactly(self, layer, state)
            except Exception as err:  # noqa: BLE001 - the layer is reset, torn
                logger.warning("restoring the MoE layer's load layout failed (%s); "
                               "the layer needs a complete reload", err)  # fmt: skip
                reset_load_layout(
                    self, layer, state, f"restoring the load layout failed: {err}"
                )

    def _check_prepared(self) -> None:
        if self._fc2_input_scale is None:
            raise RuntimeError(
                f"{type(self).__name__}.apply called before "
                "process_weights_after_loading: _fc2_input_scale is unset"
            )

    # -- compute --------------------------------------------------------------
    def apply(self, hidden_states, w1, w2, topk_weights, topk_ids):
        """One call of FlashInfer's b12x W4A4 MoE on the prepared layer.

        Creates nothing per call here, and nothing new in FlashInfer's caches
        once the first call has built the wrapper's weight views: every
        tensor handed over (alphas, scales, FC1/FC2 input scales) was made
        once by the preparation (see ``flashinfer_b12x_call``).
        """
        self._check_prepared()
        if self._wrapper is None:
            self._wrapper = make_b12x_wrapper(
                self.moe_config, hidden_states.device, self.max_num_tokens
            )
        qc = self.quant_config
        extra = {}
        if self._fc1_input_scale is not None:
            # The FC1 input keeps its own (dynamic, global 1) quantization;
            # w1_alpha is then the weight's global scale alone.
            extra["input_global_scale"] = self._fc1_input_scale
        return self._wrapper.run(
            hidden_states,
            w1,
            self.w1_sf_mma,
            w2,
            self.w2_sf_mma,
            topk_ids.to(torch.int32),  # fused_topk's ids are int32: no copy
            topk_weights.float(),  # float32 already: no copy
            w1_alpha=qc.g1_alphas,
            w2_alpha=qc.g2_alphas,
            fc2_input_scale=self._fc2_input_scale,
            **extra,
        )
