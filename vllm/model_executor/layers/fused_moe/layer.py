# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""``FusedMoE``: a Mixture-of-Experts layer with NVFP4 experts."""

from __future__ import annotations

import contextlib
import math
import zlib
from collections.abc import Iterator
from typing import Any

import torch

from vllm.distributed import (
    check_ranks_agree,
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_world_size,
    model_parallel_is_initialized,
    tensor_model_parallel_all_reduce,
)
from vllm.model_executor.layers.fused_moe.activation import MoEActivation
from vllm.model_executor.layers.fused_moe.config import (
    DEFAULT_MAX_NUM_TOKENS,
    FusedMoEConfig,
    FusedMoEParallelConfig,
)
from vllm.model_executor.layers.fused_moe.fused_moe import fused_topk
from vllm.model_executor.layers.fused_moe.weight_prep_guard import (
    after_copy,
    copy_facts,
    get_prep_state,
    note_converted,
)
from vllm.model_executor.layers.fused_moe.weight_prep_state import (
    PrepStatus,
)
from vllm.model_executor.layers.fused_moe.weight_prep_state_dict import (
    adopt_extra_state,
    layout_extra_state,
    state_dict_problem,
)
from vllm.model_executor.layers.quantization.utils.blockscale_checks import (
    check_blockscale_values,
)
from vllm.model_executor.layers.quantization.utils.nvfp4_moe_load_layout import (
    reload_slots,
)

__all__ = ["FusedMoE"]


class FusedMoE(torch.nn.Module):
    """A MoE layer: routing plus E experts (FC1, activation, FC2).

    Build, load, prepare, run::

        layer = FusedMoE(num_experts=E, top_k=K, hidden_size=H,
                         intermediate_size=I, activation="silu",
                         quant_config=ModelOptNvFp4Config.for_mode(),
                         moe_backend="flashinfer_b12x_emulated")
        ...  # load w13_weight, w13_weight_scale, ... (see the quant method)
        layer.quant_method.process_weights_after_loading(layer)
        out = layer(hidden_states, router_logits)  # [T, H] BF16

    Args:
        intermediate_size: I of the whole model; the layer holds
            I / tp_size of it.
        moe_backend: ``"flashinfer_b12x"`` (SM120/121 GPUs) or
            ``"flashinfer_b12x_emulated"`` (torch, any device). Asking for a
            backend that cannot run here raises ValueError with the reason.
        experts_kwargs: extra options of the experts class (e.g.
            ``max_transient_bytes``, ``global_scale_mode``, or
            ``bf16_activations`` for the emulation).
        max_num_tokens: the most tokens one forward takes (the kernel's
            CUDA-graph buffers are sized for it).
        renormalize: renormalize the top-k routing weights to sum to 1.
        tp_rank, tp_size: tensor parallelism along I (the loader shards).
            Default: this process's place in the tensor-parallel group when
            ``vllm.distributed.initialize_model_parallel`` has run, else a
            single process (0, 1).
        ep_rank, ep_size: expert parallelism; this rank owns global experts
            [ep_rank * E / ep_size, (ep_rank + 1) * E / ep_size). Default
            (0, 1).
        enable_expert_parallel: shard the experts, not I, over the
            tensor-parallel ranks (as upstream): ep_rank, ep_size = the
            resolved tp_rank, tp_size, and each expert's I stays whole
            (tp_size 1 for the experts).
        reduce_results: all-reduce the output over the tensor-parallel group
            (``tensor_model_parallel_all_reduce``), so every rank returns the
            whole layer's output; otherwise each returns its partial sum.
            Needs the group, of the layer's parallel size.
        place_w3w1_at_load: make ``weight_loader`` write w3 into the first
            half of w13 so the preparation skips the reorder (default: what
            the backend wants; True for the b12x backends). Code that copies
            checkpoint-layout tensors straight into the parameters must pass
            False.
    """

    def __init__(
        self,
        num_experts: int,
        top_k: int,
        hidden_size: int,
        intermediate_size: int,
        activation: MoEActivation | str = MoEActivation.SILU,
        quant_config: Any = None,
        moe_backend: str = "flashinfer_b12x",
        params_dtype: torch.dtype = torch.bfloat16,
        device: torch.device | str | None = None,
        renormalize: bool = True,
        tp_rank: int | None = None,
        tp_size: int | None = None,
        ep_rank: int | None = None,
        ep_size: int | None = None,
        enable_expert_parallel: bool = False,
        reduce_results: bool = False,
        place_w3w1_at_load: bool | None = None,
        experts_kwargs: dict[str, Any] | None = None,
        max_num_tokens: int = DEFAULT_MAX_NUM_TOKENS,
        prefix: str = "",
    ):
        super().__init__()
        if quant_config is None:
            raise ValueError(
                "FusedMoE in this tree supports NVFP4 experts only: pass "
                "quant_config=ModelOptNvFp4Config.for_mode()"
            )
        tp_rank, tp_size, ep_rank, ep_size = _resolve_parallelism(
            tp_rank, tp_size, ep_rank, ep_size, enable_expert_parallel
        )
        if reduce_results and tp_size * ep_size > 1:
            _check_reduce_group(tp_size * ep_size)
        self.reduce_results = reduce_results
        self.enable_expert_parallel = bool(enable_expert_parallel)
        self._ranks_agree = False  # checked at the first reducing forward
        if intermediate_size % tp_size != 0:
            raise ValueError(
                f"intermediate_size {intermediate_size} is not divisible by "
                f"tp_size {tp_size}"
            )
        if not 0 <= tp_rank < tp_size:
            raise ValueError(f"tp_rank must be in [0, {tp_size}), got {tp_rank}")
        if num_experts % ep_size != 0 or not 0 <= ep_rank < ep_size:
            raise ValueError(
                f"expert parallelism needs ep_size ({ep_size}) to divide "
                f"num_experts ({num_experts}) and 0 <= ep_rank < ep_size, got "
                f"ep_rank {ep_rank}"
            )
        device = torch.device(
            device if device is not None else torch.get_default_device()
        )
        self.global_num_experts = num_experts
        self.ep_rank, self.ep_size = ep_rank, ep_size
        self.local_num_experts = num_experts // ep_size
        # This rank owns the contiguous global experts [first, first + local).
        self._first_expert = ep_rank * self.local_num_experts
        self.moe_config = FusedMoEConfig(
            num_experts=num_experts,
            experts_per_token=top_k,
            hidden_dim=hidden_size,
            intermediate_size=intermediate_size,
            num_local_experts=self.local_num_experts,
            activation=MoEActivation.from_str(activation),
            moe_parallel_config=FusedMoEParallelConfig(
                tp_size=tp_size,
                tp_rank=tp_rank,
                ep_size=ep_size,
                ep_rank=ep_rank,
                use_ep=ep_size > 1,
            ),
            in_dtype=params_dtype,
            device=device,
            moe_backend=moe_backend,
            max_num_tokens=max_num_tokens,
        )
        self.top_k = top_k
        self.renormalize = renormalize
        self.params_dtype = params_dtype
        self.moe_backend = moe_backend
        self.prefix = prefix
        #: int32 [global experts]: this rank's index of each, -1 for the
        #: experts of other ranks; None when this rank holds all of them.
        expert_map = None
        if ep_size > 1:
            expert_map = torch.full(
                (num_experts,), -1, dtype=torch.int32, device=device
            )
            first, n = self._first_expert, self.local_num_experts
            expert_map[first : first + n] = torch.arange(
                n, dtype=torch.int32, device=device
            )
        self.register_buffer("expert_map", expert_map, persistent=False)
        # The quant method selects the backend: ValueError with the reason
        # when it cannot run this layer here (or with these experts_kwargs).
        self.quant_method = quant_config.get_quant_method(self, prefix)
        self.quant_method.set_experts_kwargs(dict(experts_kwargs or {}))
        # Backends that want [w3; w1] get it from the loader: w3 goes to the
        # first half directly and the preparation skips the reorder.
        if place_w3w1_at_load is None:
            place_w3w1_at_load = True
        #: w13 rows hold [w3; w1] (set at load, or by the reorder).
        self.w13_loaded_as_w3w1 = bool(place_w3w1_at_load) and self.activation.is_gated
        # Upstream also passes weight_loader=self.weight_loader, set on each
        # parameter; not here: a bound method on a parameter of the same layer
        # is a reference cycle, and a dropped layer's weights would then wait
        # for the garbage collector. Loaders call layer.weight_loader.
        with torch.device(device):
            self.quant_method.create_weights(
                layer=self,
                num_experts=self.local_num_experts,
                hidden_size=hidden_size,
                intermediate_size_per_partition=intermediate_size // tp_size,
                params_dtype=params_dtype,
            )

    @property
    def activation(self) -> MoEActivation:
        return self.moe_config.activation

    # -- loading ------------------------------------------------------------------
    def map_global_expert(self, expert_id: int) -> int | None:
        """Local index of global expert ``expert_id``; None if not owned."""
        if not 0 <= expert_id < self.global_num_experts:
            raise ValueError(
                f"expert_id {expert_id} is out of range for "
                f"{self.global_num_experts} experts"
            )
        local = expert_id - self._first_expert
        return local if 0 <= local < self.local_num_experts else None

    def _w13_row_group(self, shard_id: str) -> int:
        """Which half of w13 a shard goes to: 0 = first rows, 1 = second."""
        if not self.activation.is_gated:
            if shard_id != "w1":
                raise ValueError(
                    f"non-gated experts have only w1 and w2 shards, got {shard_id!r}"
                )
            return 0
        first = "w3" if self.w13_loaded_as_w3w1 else "w1"
        return 0 if shard_id == first else 1

    @contextlib.contextmanager
    def loading_weights(self) -> Iterator[FusedMoE]:
        """Hold the layer for a load of many ``weight_loader`` calls::

            with layer.loading_weights():
                for ...: layer.weight_loader(...)

        No preparation, restore or forward of this layer (from another
        thread) runs inside the block, so none sees half of the new weights;
        an exception leaving the block after anything was written marks the
        layer torn (a reload is all or nothing: see ``weight_prep_state``).
        Re-entrant."""
        state = get_prep_state(self)
        with state.lock:
            try:
                yield self
            except BaseException:
                if state.writes_since_prepared and not state.torn:
                    state.mark_torn(reload_slots(self.moe_config), "a reload failed")
                raise

    def weight_loader(
        self,
        param: torch.nn.Parameter,
        loaded_weight: torch.Tensor,
        weight_name: str,
        shard_id: str,
        expert_id: int,
    ) -> bool:
        """Copy one checkpoint tensor of one expert into ``param``.

        ``shard_id`` is ``"w1"`` (gate_proj; up_proj of non-gated experts),
        ``"w3"`` (up_proj) or ``"w2"`` (down_proj). w1 goes to the first I
        rows of ``w13_*`` and w3 to the second (the other way round when the
        layer places [w3; w1] at load); per-shard scalar scales go to the
        matching column of the [E, 2] tensors (column g = row group g).
        Tensor parallelism takes rows ``tp_rank * I/tp`` of w1/w3 and the
        matching columns of w2. Returns False, loading nothing, for an expert
        this rank does not own (expert parallelism).

        Reloading into a prepared layer (RL weight updates, sleep-mode
        wake-up) is supported: the first call returns the layer to its load
        layout, in place and within the preparation's cap
        (``quant_method.restore_load_layout``), so the new weights land where
        a fresh layer would have them; prepare again afterwards. ``param``
        may be the parameter object of the prepared layer.

        Raises ValueError naming ``weight_name`` on a shape or dtype mismatch,
        a global or input scale that is not finite and positive, or a block
        scale that is NaN or negative; nothing is written then.
        """
        state = get_prep_state(self)
        with state.lock:  # never beside a preparation, restore or forward
            try:
                slot = self._load_one(
                    param, loaded_weight, weight_name, shard_id, expert_id, state
                )
            except BaseException:
                if state.writes_since_prepared:
                    # Part of this reload is written: all or nothing.
                    state.mark_torn(
                        reload_slots(self.moe_config),
                        f"a reload failed at {weight_name}",
                    )
                raise
            if slot is None:
                return False
            name, local, group = slot
            state.clear_slot(name, local, group)
            folds = state.folds.get(name)
            if folds is not None:  # new block scales: nothing folded into them
                folds[local, group] = 1.0
            return True

    def _load_one(
        self, param, loaded_weight, weight_name, shard_id, expert_id, state
    ) -> tuple[str, int, int] | None:
        """weight_loader's work: the (name, local expert, row group) written,
        or None for an expert of another rank."""
        if shard_id not in ("w1", "w2", "w3"):
            raise ValueError(f"shard_id must be w1, w2 or w3, got {shard_id!r}")
        name = next((n for n, p in self.named_parameters() if p is param), None)
        if name is None:
            raise ValueError(f"{weight_name}: the parameter is not one of this layer's")
        if name.startswith("w13_") == (shard_id == "w2"):
            raise ValueError(f"{weight_name}: shard {shard_id} cannot go into {name}")
        local = self.map_global_expert(expert_id)
        if local is None:
            return None
        tp, rank = self.moe_config.tp_size, self.moe_config.tp_rank
        src = loaded_weight
        scalar = name.endswith(("_weight_scale_2", "_input_scale"))
        if scalar and (src.numel() != 1 or not src.is_floating_point()):
            raise ValueError(
                f"{weight_name}: expected a floating scalar for {name}, got "
                f"{src.dtype} of shape {tuple(src.shape)}"
            )
        if scalar:
            value = float(src.reshape(()).float())
            if not (math.isfinite(value) and value > 0):
                raise ValueError(
                    f"{weight_name}: {name} of expert {expert_id} is {value}; "
                    "global and input scales must be finite and positive"
                )
        elif name.endswith("_weight_scale") and src.dtype == param.dtype:
            check_blockscale_values(
                weight_name, src.reshape(1, -1), first_expert=expert_id
            )
        # A prepared layer goes back to the load layout before anything lands.
        self.quant_method.restore_load_layout(self)
        param = getattr(self, name)
        group = self._w13_row_group(shard_id) if name.startswith("w13_") else 0
        if scalar:
            dest = param.data[local]
            if name.startswith("w13_"):
                dest = dest[group]
            state.writes_since_prepared = True
            dest.copy_(src.reshape(()).float())
            return name, local, group
        if src.dtype != param.dtype:
            raise ValueError(
                f"{weight_name}: expected dtype {param.dtype} for {name}, got "
                f"{src.dtype}"
            )
        if name.startswith("w13_"):
            rows = self.moe_config.intermediate_size_per_partition
            want = (rows * tp, param.shape[2])
            if tuple(src.shape) != want:
                raise ValueError(
                    f"{weight_name}: expected shape {want} for {name}[{shard_id}], got "
                    f"{tuple(src.shape)}"
                )
            dest = param.data[local, group * rows : (group + 1) * rows]
            state.writes_since_prepared = True
            dest.copy_(src.narrow(0, rank * rows, rows))
        else:
            cols = param.shape[2]
            want = (param.shape[1], cols * tp)
            if tuple(src.shape) != want:
                raise ValueError(
                    f"{weight_name}: expected shape {want} for {name}, got "
                    f"{tuple(src.shape)}"
                )
            state.writes_since_prepared = True
            param.data[local].copy_(src.narrow(1, rank * cols, cols))
        return name, local, group

    def forward(
        self, hidden_states: torch.Tensor, router_logits: torch.Tensor
    ) -> torch.Tensor:
        """[T, H] floating-point activations (computed in ``params_dtype``),
        [T, E] floating-point router logits (E: the global number of experts)
        -> [T, H]. TypeError / ValueError naming the argument otherwise. With
        ``reduce_results`` on a split layer, the first call checks that every
        rank of the group built the same layer (ValueError on every rank)."""
        self._check_forward_inputs(hidden_states, router_logits)
        parallel = self.moe_config.tp_size * self.ep_size > 1
        if self.reduce_results and parallel and not self._ranks_agree:
            check_ranks_agree(
                f"FusedMoE {self.prefix or ''}".strip(), self._parallel_signature()
            )
            self._ranks_agree = True
        topk_weights, topk_ids = fused_topk(
            hidden_states, router_logits, self.top_k, self.renormalize
        )
        out = self.quant_method.apply(
            self, hidden_states.to(self.params_dtype), topk_weights, topk_ids
        )
        if self.reduce_results and parallel:
            # Each rank holds a partial sum (its slice of I, or its experts).
            out = tensor_model_parallel_all_reduce(out)
        return out

    def _check_forward_inputs(self, hidden_states, router_logits) -> None:
        h, e = self.moe_config.hidden_dim, self.global_num_experts
        for name, t in (
            ("hidden_states", hidden_states),
            ("router_logits", router_logits),
        ):
            if not isinstance(t, torch.Tensor):
                raise TypeError(
                    f"{name} must be a torch.Tensor, got {type(t).__name__}"
                )
            if not t.is_floating_point():
                raise TypeError(f"{name} must be floating point, got {t.dtype}")
        if hidden_states.dim() != 2 or hidden_states.shape[1] != h:
            raise ValueError(
                f"hidden_states must be [T, {h}] (hidden_size {h}), got "
                f"{tuple(hidden_states.shape)}"
            )
        t = hidden_states.shape[0]
        if tuple(router_logits.shape) != (t, e):
            raise ValueError(
                f"router_logits must be [T, {e}] = [{t}, {e}] (T tokens of "
                f"hidden_states, {e} global experts), got "
                f"{tuple(router_logits.shape)}"
            )
        if router_logits.device != hidden_states.device:
            raise ValueError(
                f"router_logits is on {router_logits.device}, hidden_states on "
                f"{hidden_states.device}"
            )

    def _parallel_signature(self) -> dict[str, int]:
        """What every rank of a reducing group must agree on (ranks aside),
        and this rank's place (``tp_rank``/``ep_rank``: must differ)."""
        moe = self.moe_config
        return {
            "num_experts": self.global_num_experts,
            "hidden_size": moe.hidden_dim,
            "intermediate_size": moe.intermediate_size,
            "top_k": self.top_k,
            "activation": list(MoEActivation).index(moe.activation),
            "renormalize": int(self.renormalize),
            "tp_size": moe.tp_size,
            "ep_size": self.ep_size,
            "enable_expert_parallel": int(self.enable_expert_parallel),
            "reduce_results": int(self.reduce_results),
            "params_dtype": zlib.crc32(str(self.params_dtype).encode()),
            "moe_backend": zlib.crc32(self.moe_backend.encode()),
            "rank:tp_rank": moe.tp_rank,
            "rank:ep_rank": self.ep_rank,
        }

    def _apply(self, fn, recurse=True):
        # .to(), .half(), ...: the parameters may be new tensors now, which
        # the experts' next apply checks once (a conversion is refused).
        out = super()._apply(fn, recurse)
        note_converted(self)
        return out

    # -- copies and state dicts: the layout travels with the tensors ------------
    def __getstate__(self) -> dict:
        d = super().__getstate__()
        state = d.get("weight_prep_state")
        if state is not None:
            with state.lock:
                d["_prep_copy_facts"] = copy_facts(state, self)
        return d

    def __setstate__(self, d: dict) -> None:
        facts = d.pop("_prep_copy_facts", None)
        super().__setstate__(d)
        state = getattr(self, "weight_prep_state", None)
        if facts is not None and state is not None:
            if state.status is PrepStatus.PREPARED:
                # The kernel's views of the copy's own parameters.
                self.quant_method.experts.bind_prepared(self)
            after_copy(state, self, facts)

    def get_extra_state(self) -> dict:
        """The layout of the parameters' bytes, saved in ``state_dict()``
        beside them (see ``weight_prep_state_dict.layout_extra_state``)."""
        return layout_extra_state(self)

    def set_extra_state(self, extra: Any) -> None:
        # Called by Module._load_from_state_dict after the parameters were
        # copied; _load_from_state_dict below checked ``extra`` first.
        adopt_extra_state(self, extra)

    def _load_from_state_dict(
        self,
        state_dict,
        prefix,
        local_metadata,
        strict,
        missing_keys,
        unexpected_keys,
        error_msgs,
    ):
        state = get_prep_state(self)
        with state.lock:
            problem = state_dict_problem(self, state_dict, prefix)
            if problem:
                error_msgs.append(f"FusedMoE {prefix or '(root)'}: {problem}")
                return
            if state_dict[prefix + "_extra_state"]["status"] != "prepared":
                # Into the load layout first (from any state), as weight_loader.
                self.quant_method.restore_load_layout(self)
                state.torn = {}
            super()._load_from_state_dict(
                state_dict,
                prefix,
                local_metadata,
                strict,
                missing_keys,
                unexpected_keys,
                error_msgs,
            )


def _resolve_parallelism(tp_rank, tp_size, ep_rank, ep_size, enable_ep):
    """(tp_rank, tp_size, ep_rank, ep_size) of a layer from its arguments and
    the tensor-parallel group, if any (see ``FusedMoE``)."""
    if (tp_rank is None) != (tp_size is None):
        raise ValueError("give tp_rank and tp_size together, or neither")
    if (ep_rank is None) != (ep_size is None):
        raise ValueError("give ep_rank and ep_size together, or neither")
    if tp_size is None:
        if model_parallel_is_initialized():
            tp_rank = get_tensor_model_parallel_rank()
            tp_size = get_tensor_model_parallel_world_size()
        else:
            tp_rank, tp_size = 0, 1
    if enable_ep:
        if ep_size is not None:
            raise ValueError(
                "enable_expert_parallel takes the expert-parallel rank and size "
                "from the tensor-parallel ones: do not also give ep_rank/ep_size"
            )
        return 0, 1, tp_rank, tp_size
    if ep_size is None:
        ep_rank, ep_size = 0, 1
    return tp_rank, tp_size, ep_rank, ep_size


def _check_reduce_group(parallel_size: int) -> None:
    if not model_parallel_is_initialized():
        raise ValueError(
            "reduce_results=True with a parallel layer needs the tensor-parallel "
            "group: call vllm.distributed.initialize_model_parallel first"
        )
    group = get_tensor_model_parallel_world_size()
    if group != parallel_size:
        raise ValueError(
            f"reduce_results=True: the layer is split {parallel_size} ways but the "
            f"tensor-parallel group has {group} ranks"
        )
