# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Read the routed-expert tensors of NVFP4 MoE checkpoints into ``FusedMoE``.

Two on-disk conventions are understood:

* ModelOpt NVFP4 (``hf_quant_config.json`` with ``quant_algo: NVFP4``, or a
  ``config.json`` ``quantization_config`` with ``quant_method: modelopt``):
  per expert and projection ``weight`` (uint8, packed E2M1), ``weight_scale``
  (float8_e4m3fn), ``weight_scale_2`` and ``input_scale`` (float32,
  DEQUANTIZATION direction, ``amax / (448 * 6)``).
* compressed-tensors ``nvfp4-pack-quantized``: ``weight_packed``,
  ``weight_scale``, ``weight_global_scale`` and ``input_global_scale``, the
  global scales in the QUANTIZATION direction; they are inverted on load.

Each MoE layer is W4A4 (NVFP4 activations too) or W4A16 (weight-only, BF16
activations), as the config declares it: ModelOpt ``quant_algo`` ``NVFP4`` /
``W4A16_NVFP4``, or ``MIXED_PRECISION`` with per-module ``quantized_layers``;
compressed-tensors config groups with ``input_activations: null`` for W4A16
(:mod:`~vllm.model_executor.model_loader.nvfp4_moe_quant_modes`).
:meth:`NVFP4MoECheckpoint.quant_config` gives the config to build each
layer with; a W4A16 layer's input scales, if a file has them, are not read.

Expert tensors are named ``<module>.experts.<e>.<proj>.<suffix>`` with
``proj`` in gate_proj (w1), up_proj (w3; w1 for non-gated experts) and
down_proj (w2); ``<module>`` is a decoder layer (``model.layers.<L>.mlp``,
``backbone.layers.<L>.mixer``, ...) or another MoE block, listed apart
(``mtp.layers.0.mlp``). Tensors are streamed one at a time with
``safetensors.safe_open``, following ``model.safetensors.index.json`` across
shards; nothing reads a whole file into memory. Every file is opened first
(no-follow, below the checkpoint directory) and checked through its
descriptor, which is what is then read: no check-then-open race.
"""

from __future__ import annotations

import os
import re
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path

import torch
from tqdm import tqdm

from vllm.model_executor.layers.quantization.utils.nvfp4_format import (
    global_scale_from_compressed_tensors,
    global_scale_to_modelopt,
)
from vllm.model_executor.model_loader.checkpoint_files import (
    get_dict as _get_dict,
)
from vllm.model_executor.model_loader.checkpoint_files import (
    read_json as _read_json,
)
from vllm.model_executor.model_loader.checkpoint_files import (
    safe_open_inside as _safe_open_inside,
)
from vllm.model_executor.model_loader.moe_routing import (
    MoERouting,
    moe_routing_from_config,
)
from vllm.model_executor.model_loader.nvfp4_moe_quant_modes import (
    W4A16,
    ExpertModes,
    compressed_tensors_expert_modes,
    modelopt_expert_modes,
)

__all__ = ["MODELOPT", "COMPRESSED_TENSORS", "NVFP4MoECheckpoint"]

MODELOPT = "modelopt"
COMPRESSED_TENSORS = "compressed-tensors"

_EXPERT_RE = re.compile(
    r"^(?P<module>.+)\.experts\.(?P<expert>[0-9]+)\."
    r"(?P<proj>gate_proj|up_proj|down_proj)\.(?P<suffix>[A-Za-z0-9_]+)$"
)
# The decoder stacks of the models this reader serves (Qwen3 MoE, Qwen3.5,
# Nemotron-H, DeepSeek, Mixtral-style): their MoE modules are the numbered
# decoder layers. Experts anywhere else (``mtp.layers.0.mlp``: the
# multi-token-prediction block of Qwen3-Next-style checkpoints) are listed
# by their module name and never taken for a decoder layer.
_DECODER_RE = re.compile(
    r"^(?:model|backbone|model\.language_model|language_model\.model)\.layers\."
    r"(?P<layer>[0-9]+)\.(?:mlp|mixer)$"
)
# checkpoint suffix -> (FusedMoE parameter suffix, required)
_SUFFIXES = {
    MODELOPT: {
        "weight": ("weight", True),
        "weight_scale": ("weight_scale", True),
        "weight_scale_2": ("weight_scale_2", True),
        "input_scale": ("input_scale", False),
    },
    COMPRESSED_TENSORS: {
        "weight_packed": ("weight", True),
        "weight_scale": ("weight_scale", True),
        "weight_global_scale": ("weight_scale_2", True),
        "input_global_scale": ("input_scale", False),
    },
}


def detect_nvfp4_format(model_dir: Path) -> tuple[str, ExpertModes]:
    """``(MODELOPT or COMPRESSED_TENSORS, the experts' declared modes)``;
    ValueError naming the file and key when the checkpoint is not NVFP4 (W4A4
    or W4A16) or its declaration is malformed (see
    :mod:`~vllm.model_executor.model_loader.nvfp4_moe_quant_modes`)."""
    hf_quant = model_dir / "hf_quant_config.json"
    if hf_quant.exists() or hf_quant.is_symlink():
        quant = _get_dict(_read_json(hf_quant), "quantization", hf_quant, {})
        return MODELOPT, modelopt_expert_modes(quant, hf_quant, "quantization")
    config_path = model_dir / "config.json"
    if not (config_path.exists() or config_path.is_symlink()):
        raise ValueError(f"{model_dir}: no config.json")
    config = _read_json(config_path)
    if not config.get("quantization_config"):
        raise ValueError(
            f"{config_path}: no quantization_config: not an NVFP4 checkpoint"
        )
    qc = _get_dict(config, "quantization_config", config_path)
    method = qc.get("quant_method")
    if method == "modelopt":
        key = "quantization_config"
        if "quant_algo" not in qc and "quantization" in qc:
            qc = _get_dict(qc, "quantization", config_path)
            key += ".quantization"
        return MODELOPT, modelopt_expert_modes(qc, config_path, key)
    if method == "compressed-tensors":
        modes = compressed_tensors_expert_modes(qc, config_path, "quantization_config")
        return COMPRESSED_TENSORS, modes
    raise ValueError(f"{config_path}: unsupported quantization method {method!r}")


class NVFP4MoECheckpoint:
    """An NVFP4 MoE checkpoint directory: its config, format and expert tensors.

    Args:
        model_dir: directory with ``config.json``, the quantization config and
            ``*.safetensors`` (with ``model.safetensors.index.json`` when
            sharded).

    Expert tensors are grouped by their full module name (the part before
    ``.experts.``). The decoder layers' modules (``model.layers.<L>.mlp``,
    ``backbone.layers.<L>.mixer``, ...) are :attr:`moe_layers`, by index;
    experts of any other module (``mtp.layers.0.mlp``) are
    :attr:`other_moe_modules`, by name, never merged into a decoder layer.
    A non-canonical index (``experts.01``), a second tensor for the same
    (layer, expert, projection, suffix) or one decoder layer with experts
    under two modules is a ValueError naming the tensors and their files.
    """

    def __init__(self, model_dir: str | os.PathLike):
        self.model_dir = Path(model_dir)
        if not self.model_dir.is_dir():
            raise ValueError(f"{self.model_dir}: not a directory")
        self.format, declared = detect_nvfp4_format(self.model_dir)
        config_path = self.model_dir / "config.json"
        config = _read_json(config_path)
        self.config = config
        self.text_config = _get_dict(config, "text_config", config_path, config)
        self.weight_map = self._weight_map()
        # module -> {(expert, proj, suffix): tensor name}; decoder layer -> module
        self._modules: dict[str, dict[tuple[int, str, str], str]] = {}
        self._layers: dict[int, str] = {}
        self._parse_expert_names()
        self._check_geometry()
        self._declared = declared
        self._quant_modes = {
            idx: self._resolve_quant_mode(idx) for idx in self.moe_layers
        }

    # -- names --------------------------------------------------------------------
    def _where(self, name: str) -> str:
        return f"{name} (in {self.weight_map[name]})"

    def _parse_expert_names(self) -> None:
        firsts: dict[tuple[int | str, int, str, str], str] = {}
        layer_modules: dict[int, dict[str, str]] = defaultdict(dict)
        for name in self.weight_map:
            m = _EXPERT_RE.match(name)
            if not m:
                continue
            module, expert = m["module"], m["expert"]
            for part in (*module.split("."), expert):
                if part.isascii() and part.isdigit() and part != str(int(part)):
                    raise ValueError(
                        f"{self.model_dir}: tensor {self._where(name)} has the "
                        f"non-canonical index {part!r} (write {int(part)})"
                    )
            decoder = _DECODER_RE.match(module)
            owner: int | str = int(decoder["layer"]) if decoder else module
            key = (owner, int(expert), m["proj"], m["suffix"])
            if key in firsts:
                what = f"layer {owner}" if decoder else f"module {owner}"
                raise ValueError(
                    f"{self.model_dir}: {self._where(name)} is a second tensor "
                    f"for {what}, expert {expert}, {m['proj']}.{m['suffix']}, "
                    f"after {self._where(firsts[key])}"
                )
            firsts[key] = name
            self._modules.setdefault(module, {})[key[1:]] = name
            if decoder:
                layer_modules[owner].setdefault(module, name)
        for layer_idx, modules in sorted(layer_modules.items()):
            if len(modules) > 1:
                examples = " and ".join(self._where(n) for n in modules.values())
                raise ValueError(
                    f"{self.model_dir}: decoder layer {layer_idx} has routed "
                    f"experts under {len(modules)} modules ({', '.join(modules)}): "
                    f"{examples}"
                )
            self._layers[layer_idx] = next(iter(modules))
        if not self._layers:
            others = f" (only in {self.other_moe_modules})" if self._modules else ""
            raise ValueError(
                f"{self.model_dir}: no routed-expert tensors in decoder layers{others}"
            )

    # -- geometry ---------------------------------------------------------------
    def _cfg(self, *keys: str) -> int:
        path = self.model_dir / "config.json"
        for key in keys:
            if key in self.text_config:
                value = self.text_config[key]
                if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                    raise ValueError(
                        f"{path}: {key} must be a positive integer, got {value!r}"
                    )
                return value
        raise ValueError(f"{path}: none of {keys} is set")

    def _check_geometry(self) -> None:
        """config.json's sizes against the tensors, before anyone allocates a
        layer of that size: the expert count against the expert tensors of
        every MoE layer, H and I against one expert's tensor headers."""
        path = self.model_dir / "config.json"
        e = self.num_experts
        for layer_idx, module in self._layers.items():
            found = 1 + max(ex for ex, _, _ in self._modules[module])
            if found != e:
                raise ValueError(
                    f"{path}: says {e} experts, but layer {layer_idx} of the "
                    f"checkpoint has tensors for {found}"
                )
        h, i = self.hidden_size, self.intermediate_size
        weight = "weight" if self.format == MODELOPT else "weight_packed"
        layer = self._modules[self._layers[self.moe_layers[0]]]
        for (expert, proj, suffix), name in layer.items():
            if expert != 0 or suffix != weight:
                continue
            want = (h, i // 2) if proj == "down_proj" else (i, h // 2)
            got = self._header_shape(name)
            if got != want:
                raise ValueError(
                    f"{path}: hidden_size {h} and intermediate size {i} mean "
                    f"{name} has shape {want}, the checkpoint has {got}"
                )

    def _header_shape(self, name: str) -> tuple[int, ...]:
        file = self.model_dir / self.weight_map[name]
        with _safe_open_inside(file, self.model_dir, name) as f:
            try:
                return tuple(f.get_slice(name).get_shape())
            except Exception as e:  # safetensors raises its own error types
                raise ValueError(
                    f"{file}: cannot read the header of {name} ({e})"
                ) from None

    @property
    def num_experts(self) -> int:
        return self._cfg("num_experts", "n_routed_experts", "num_local_experts")

    @property
    def top_k(self) -> int:
        return self._cfg("num_experts_per_tok", "moe_topk")

    @property
    def routing(self) -> MoERouting:
        """The router the config declares (``norm_topk_prob`` as
        ``renormalize``, per architecture: :mod:`~vllm.model_executor.
        model_loader.moe_routing`); ``FusedMoE(**ckpt.routing.layer_kwargs(),
        ...)``. ValueError naming config.json and the key where it is not the
        softmax top-k routing ``FusedMoE`` computes, or is not declared."""
        model_type = self.text_config.get("model_type", self.config.get("model_type"))
        config = {"model_type": model_type, **self.text_config}
        return moe_routing_from_config(
            config, self.top_k, str(self.model_dir / "config.json")
        )

    @property
    def hidden_size(self) -> int:
        return self._cfg("hidden_size")

    @property
    def intermediate_size(self) -> int:
        return self._cfg("moe_intermediate_size", "intermediate_size")

    @property
    def activation(self) -> str:
        """ "silu" (gated) unless the experts have no gate_proj (then relu2)."""
        layer = self._modules[self._layers[self.moe_layers[0]]]
        return "silu" if any(p == "gate_proj" for _, p, _ in layer) else "relu2"

    @property
    def moe_layers(self) -> list[int]:
        """Indices of the decoder layers that hold routed experts."""
        return sorted(self._layers)

    @property
    def other_moe_modules(self) -> list[str]:
        """Modules outside the decoder layers that hold routed experts (e.g.
        ``mtp.layers.0.mlp``), by name; load one with
        ``load_layer(layer, name)``."""
        decoder = set(self._layers.values())
        return sorted(m for m in self._modules if m not in decoder)

    # -- quantization mode ------------------------------------------------------
    def _module(self, layer_idx: int | str) -> str:
        """The module holding decoder layer ``layer_idx``'s experts, or the
        module named ``layer_idx`` (one of :attr:`other_moe_modules`)."""
        if isinstance(layer_idx, str) and layer_idx in self._modules:
            return layer_idx
        if not isinstance(layer_idx, str) and layer_idx in self._layers:
            return self._layers[layer_idx]
        raise ValueError(
            f"{self.model_dir}: layer {layer_idx!r} has no routed experts; MoE "
            f"layers are {self.moe_layers}, other MoE modules "
            f"{self.other_moe_modules}"
        )

    def _resolve_quant_mode(self, layer_idx: int | str) -> str:
        """A MoE layer's mode from the config's declaration, resolved for the
        layer's experts module and every expert linear in the files."""
        module = self._module(layer_idx)
        linears = {n.rsplit(".", 1)[0] for n in self._modules[module].values()}
        return self._declared.mode_of(module + ".experts", linears)

    def quant_mode(self, layer_idx: int | str) -> str:
        """``"w4a4"`` or ``"w4a16"``: what the checkpoint declares for the
        experts of MoE layer ``layer_idx`` (or of the module named so)."""
        if layer_idx not in self._quant_modes:
            self._quant_modes[layer_idx] = self._resolve_quant_mode(layer_idx)
        return self._quant_modes[layer_idx]

    def quant_config(self, layer_idx: int | str):
        """A ``ModelOptNvFp4Config`` with the ``quant_mode`` the checkpoint
        declares for MoE layer ``layer_idx`` (a new object per call): what a
        ``FusedMoE`` for that layer is built with before ``load_layer``."""
        from vllm.model_executor.layers.quantization.modelopt import (
            ModelOptNvFp4Config,
        )

        return ModelOptNvFp4Config.for_mode(self.quant_mode(layer_idx))

    # -- reading ------------------------------------------------------------------
    def _weight_map(self) -> dict[str, str]:
        index = self.model_dir / "model.safetensors.index.json"
        if index.exists() or index.is_symlink():
            wm = _get_dict(_read_json(index, self.model_dir), "weight_map", index)
            for name, file in wm.items():
                if not isinstance(file, str) or not file:
                    raise ValueError(
                        f"{index}: weight_map[{name!r}] must be a file name, got "
                        f"{file!r}"
                    )
            names: dict[str, list[str]] = defaultdict(list)
            for name, file in wm.items():
                names[file].append(name)
            for file in sorted(names):
                if Path(file).is_absolute() or ".." in Path(file).parts:
                    raise ValueError(
                        f"{index}: shard {file!r} must be a path inside the "
                        "checkpoint directory"
                    )
                if not (self.model_dir / file).exists():
                    raise ValueError(f"{index}: shard {file} is missing")
                self._check_shard_header(self.model_dir / file, names[file], index)
            return wm
        files = sorted(self.model_dir.glob("*.safetensors"))
        if not files:
            raise ValueError(f"{self.model_dir}: no *.safetensors files")
        wm = {}
        for path in files:
            for name in self._keys(path):
                if name in wm:
                    raise ValueError(
                        f"{self.model_dir}: tensor {name} is in two shards, "
                        f"{wm[name]} and {path.name}"
                    )
                wm[name] = path.name
        return wm

    def _check_shard_header(self, path: Path, names: list[str], index: Path) -> None:
        """Read a shard's header when the checkpoint opens, before any layer.

        Raises:
            ValueError: naming the shard, where its header does not parse or
                its tensors do not cover the file (safetensors' checks), or
                it lacks a tensor the index places in it.
        """
        with _safe_open_inside(path, self.model_dir, str(index)) as f:
            keys = set(f.keys())
        missing = [n for n in names if n not in keys]
        if missing:
            more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
            raise ValueError(
                f"{index}: {missing[0]}{more} should be in {path.name}, whose "
                "header has no such tensor"
            )

    def _keys(self, path: Path) -> list[str]:
        with _safe_open_inside(path, self.model_dir, "shard") as f:
            return list(f.keys())

    def _expected(
        self, layer_idx: int | str, gated: bool
    ) -> list[tuple[int, str, str, bool]]:
        projs = (
            ("gate_proj", "up_proj", "down_proj") if gated else ("up_proj", "down_proj")
        )
        return [
            (e, proj, suffix, required)
            for e in range(self.num_experts)
            for proj in projs
            for suffix, (_, required) in _SUFFIXES[self.format].items()
        ]

    def _check_layer(self, layer_idx: int | str) -> dict[tuple[int, str, str], str]:
        module = self._module(layer_idx)
        found = self._modules[module]
        n_found = 1 + max(e for e, _, _ in found)
        if n_found != self.num_experts:
            raise ValueError(
                f"{self.model_dir}: layer {layer_idx} has tensors for {n_found} "
                f"experts but config.json says {self.num_experts}"
            )
        gated = self.activation == "silu"
        for e, proj, suffix, required in self._expected(layer_idx, gated):
            if required and (e, proj, suffix) not in found:
                raise ValueError(
                    f"{self.model_dir}: missing tensor "
                    f"{module}.experts.{e}.{proj}.{suffix} (layer {layer_idx})"
                )
        return found

    def iter_layer_tensors(
        self, layer_idx: int | str, experts: range | None = None, progress: bool = False
    ) -> Iterator[tuple[str, int, str, str, torch.Tensor]]:
        """Yield ``(name, expert, proj, param_suffix, tensor)`` for every expert
        tensor of decoder layer ``layer_idx`` (or of the module named so, one
        of :attr:`other_moe_modules`), optionally only ``experts``, one at a
        time, in file order. Global scales come out in ModelOpt's dequantization
        direction whatever the format."""
        found = self._check_layer(layer_idx)
        suffixes = _SUFFIXES[self.format]
        if self.quant_mode(layer_idx) == W4A16:
            # Weight-only: activations stay BF16; an input scale some exports
            # carry is not read at all.
            suffixes = {k: v for k, v in suffixes.items() if v[0] != "input_scale"}
        by_file: dict[str, list[tuple[int, str, str, str]]] = defaultdict(list)
        for (e, proj, suffix), name in found.items():
            if suffix in suffixes and (experts is None or e in experts):
                by_file[self.weight_map[name]].append((e, proj, suffix, name))
        total = sum(len(v) for v in by_file.values())
        bar = tqdm(
            total=total,
            desc=f"layer {layer_idx}",
            unit="tensor",
            disable=not progress,
            leave=False,
        )
        with bar:
            for file, items in sorted(by_file.items()):
                path = self.model_dir / file
                with _safe_open_inside(path, self.model_dir, items[0][3]) as f:
                    for e, proj, suffix, name in items:
                        try:
                            tensor = f.get_tensor(name)
                        except Exception as err:
                            raise ValueError(
                                f"{path}: cannot read tensor {name} ({err})"
                            ) from None
                        param_suffix = suffixes[suffix][0]
                        if self.format == COMPRESSED_TENSORS and param_suffix in (
                            "weight_scale_2",
                            "input_scale",
                        ):
                            tensor = global_scale_to_modelopt(
                                global_scale_from_compressed_tensors(tensor)
                            )
                        yield name, e, proj, param_suffix, tensor
                        bar.update()

    def load_layer(
        self, layer: torch.nn.Module, layer_idx: int | str, progress: bool = False
    ):
        """Load decoder layer ``layer_idx``'s experts (or those of the module
        named so, one of :attr:`other_moe_modules`) into ``layer`` (a
        ``FusedMoE``) through its ``weight_loader``. Checks the geometry
        first; every tensor is checked by the loader (shape, dtype)."""
        if layer.global_num_experts != self.num_experts:
            raise ValueError(
                f"{self.model_dir}: config.json has {self.num_experts} experts, the "
                f"layer {layer.global_num_experts}"
            )
        mode = self.quant_mode(layer_idx)
        layer_mode = getattr(
            getattr(getattr(layer, "quant_method", None), "quant_config", None),
            "quant_mode",
            None,
        )
        if layer_mode != mode:
            raise ValueError(
                f"{self.model_dir}: layer {layer_idx}'s experts are {mode}, the "
                f"layer is built for {layer_mode}: build it with "
                f"quant_config=checkpoint.quant_config({layer_idx})"
            )
        gated = layer.activation.is_gated
        if gated != (self.activation == "silu"):
            raise ValueError(
                f"{self.model_dir}: checkpoint experts are {self.activation}, the "
                f"layer is {layer.activation.value}"
            )
        shard_of = {
            "gate_proj": "w1",
            "up_proj": "w3" if gated else "w1",
            "down_proj": "w2",
        }
        first = layer.ep_rank * layer.local_num_experts
        owned = range(first, first + layer.local_num_experts)
        # One held load: no forward or preparation sees half of it, and an
        # error between two tensors (an unreadable second file, Ctrl-C)
        # after anything was written leaves the layer torn, not a mix.
        with layer.loading_weights():
            for name, e, proj, suffix, tensor in self.iter_layer_tensors(
                layer_idx, owned, progress
            ):
                shard = shard_of[proj]
                prefix = "w2" if shard == "w2" else "w13"
                param = getattr(layer, f"{prefix}_{suffix}")
                try:
                    layer.weight_loader(param, tensor, name, shard, e)
                except ValueError as err:
                    file = self.model_dir / self.weight_map[name]
                    raise ValueError(f"{file}: {err}") from None
