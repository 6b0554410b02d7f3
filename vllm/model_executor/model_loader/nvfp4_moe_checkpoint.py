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

Expert tensors are named ``<prefix>.layers.<L>.<mlp|mixer>.experts.<e>.<proj>.
<suffix>`` with ``proj`` in gate_proj (w1), up_proj (w3; w1 for non-gated
experts) and down_proj (w2). Tensors are streamed one at a time with
``safetensors.safe_open``, following ``model.safetensors.index.json`` across
shards; nothing reads a whole file into memory.
"""

from __future__ import annotations

import json
import os
import re
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from tqdm import tqdm

from vllm.model_executor.layers.quantization.utils.nvfp4_utils import (
    global_scale_from_compressed_tensors,
    global_scale_to_modelopt,
)

__all__ = ["MODELOPT", "COMPRESSED_TENSORS", "NVFP4MoECheckpoint"]

MODELOPT = "modelopt"
COMPRESSED_TENSORS = "compressed-tensors"

_EXPERT_RE = re.compile(
    r"^(?P<prefix>.*\.layers)\.(?P<layer>\d+)\.(?P<block>mlp|mixer)\.experts\."
    r"(?P<expert>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.(?P<suffix>\w+)$"
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


def _read_json(path: Path) -> dict:
    try:
        with open(path) as f:
            return json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None


def detect_nvfp4_format(model_dir: Path) -> str:
    """``MODELOPT`` or ``COMPRESSED_TENSORS``; ValueError naming the file and
    the algorithm when the checkpoint is not NVFP4."""
    hf_quant = model_dir / "hf_quant_config.json"
    if hf_quant.exists():
        quant = _read_json(hf_quant).get("quantization", {})
        algo = quant.get("quant_algo")
        if str(algo).upper() != "NVFP4":
            raise ValueError(
                f"{hf_quant}: unsupported ModelOpt quant_algo {algo!r} (expected NVFP4)"
            )
        return MODELOPT
    config_path = model_dir / "config.json"
    if not config_path.exists():
        raise ValueError(f"{model_dir}: no config.json")
    qc = _read_json(config_path).get("quantization_config")
    if not qc:
        raise ValueError(
            f"{config_path}: no quantization_config: not an NVFP4 checkpoint"
        )
    method = qc.get("quant_method")
    if method == "modelopt":
        algo = qc.get("quant_algo", qc.get("quantization", {}).get("quant_algo"))
        if str(algo).upper() != "NVFP4":
            raise ValueError(
                f"{config_path}: unsupported ModelOpt quant_algo {algo!r} "
                "(expected NVFP4)"
            )
        return MODELOPT
    if method == "compressed-tensors":
        formats = {qc.get("format")} | {
            g.get("format") for g in qc.get("config_groups", {}).values()
        }
        if "nvfp4-pack-quantized" in formats:
            return COMPRESSED_TENSORS
        raise ValueError(
            f"{config_path}: unsupported compressed-tensors format "
            f"{sorted(f for f in formats if f)} (expected nvfp4-pack-quantized)"
        )
    raise ValueError(f"{config_path}: unsupported quantization method {method!r}")


@dataclass(frozen=True)
class _ExpertTensor:
    name: str
    layer: int
    expert: int
    proj: str
    suffix: str


class NVFP4MoECheckpoint:
    """An NVFP4 MoE checkpoint directory: its config, format and expert tensors.

    Args:
        model_dir: directory with ``config.json``, the quantization config and
            ``*.safetensors`` (with ``model.safetensors.index.json`` when
            sharded).
    """

    def __init__(self, model_dir: str | os.PathLike):
        self.model_dir = Path(model_dir)
        if not self.model_dir.is_dir():
            raise ValueError(f"{self.model_dir}: not a directory")
        self.format = detect_nvfp4_format(self.model_dir)
        config = _read_json(self.model_dir / "config.json")
        self.config = config
        self.text_config = config.get("text_config", config)
        self.weight_map = self._weight_map()
        self._experts: dict[int, list[_ExpertTensor]] = defaultdict(list)
        for name in self.weight_map:
            m = _EXPERT_RE.match(name)
            if m:
                self._experts[int(m["layer"])].append(
                    _ExpertTensor(
                        name, int(m["layer"]), int(m["expert"]), m["proj"], m["suffix"]
                    )  # fmt: skip
                )
        if not self._experts:
            raise ValueError(f"{self.model_dir}: no routed-expert tensors found")

    # -- geometry ---------------------------------------------------------------
    def _cfg(self, *keys: str) -> int:
        for key in keys:
            if key in self.text_config:
                return int(self.text_config[key])
        raise ValueError(f"{self.model_dir / 'config.json'}: none of {keys} is set")

    @property
    def num_experts(self) -> int:
        return self._cfg("num_experts", "n_routed_experts", "num_local_experts")

    @property
    def top_k(self) -> int:
        return self._cfg("num_experts_per_tok", "moe_topk")

    @property
    def hidden_size(self) -> int:
        return self._cfg("hidden_size")

    @property
    def intermediate_size(self) -> int:
        return self._cfg("moe_intermediate_size", "intermediate_size")

    @property
    def activation(self) -> str:
        """ "silu" (gated) unless the experts have no gate_proj (then relu2)."""
        layer = next(iter(self._experts.values()))
        return "silu" if any(t.proj == "gate_proj" for t in layer) else "relu2"

    @property
    def moe_layers(self) -> list[int]:
        """Indices of the decoder layers that hold routed experts."""
        return sorted(self._experts)

    # -- reading ------------------------------------------------------------------
    def _weight_map(self) -> dict[str, str]:
        index = self.model_dir / "model.safetensors.index.json"
        if index.exists():
            wm = _read_json(index).get("weight_map")
            if not isinstance(wm, dict):
                raise ValueError(f"{index}: no weight_map")
            for file in set(wm.values()):
                if not (self.model_dir / file).exists():
                    raise ValueError(f"{index}: shard {file} is missing")
            return wm
        files = sorted(self.model_dir.glob("*.safetensors"))
        if not files:
            raise ValueError(f"{self.model_dir}: no *.safetensors files")
        wm = {}
        for path in files:
            for name in self._keys(path):
                wm[name] = path.name
        return wm

    @staticmethod
    def _keys(path: Path) -> list[str]:
        try:
            with safe_open(path, framework="pt", device="cpu") as f:
                return list(f.keys())
        except Exception as e:  # safetensors raises its own error types
            raise ValueError(f"{path}: not a readable safetensors file ({e})") from None

    def _expected(
        self, layer_idx: int, gated: bool
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

    def _check_layer(self, layer_idx: int) -> dict[tuple[int, str, str], str]:
        if layer_idx not in self._experts:
            raise ValueError(
                f"{self.model_dir}: layer {layer_idx} has no routed experts; MoE "
                f"layers are {self.moe_layers}"
            )
        found = {(t.expert, t.proj, t.suffix): t.name for t in self._experts[layer_idx]}
        n_found = 1 + max(e for e, _, _ in found)
        if n_found != self.num_experts:
            raise ValueError(
                f"{self.model_dir}: layer {layer_idx} has tensors for {n_found} "
                f"experts but config.json says {self.num_experts}"
            )
        gated = self.activation == "silu"
        prefix = self._experts[layer_idx][0].name.split(".experts.")[0]
        for e, proj, suffix, required in self._expected(layer_idx, gated):
            if required and (e, proj, suffix) not in found:
                raise ValueError(
                    f"{self.model_dir}: missing tensor "
                    f"{prefix}.experts.{e}.{proj}.{suffix} (layer {layer_idx})"
                )
        return found

    def iter_layer_tensors(
        self, layer_idx: int, experts: range | None = None, progress: bool = False
    ) -> Iterator[tuple[str, int, str, str, torch.Tensor]]:
        """Yield ``(name, expert, proj, param_suffix, tensor)`` for every expert
        tensor of ``layer_idx`` (optionally only ``experts``), one at a time,
        in file order. Global scales come out in ModelOpt's dequantization
        direction whatever the format."""
        found = self._check_layer(layer_idx)
        suffixes = _SUFFIXES[self.format]
        by_file: dict[str, list[tuple[int, str, str, str]]] = defaultdict(list)
        for (e, proj, suffix), name in found.items():
            if suffix in suffixes and (experts is None or e in experts):
                by_file[self.weight_map[name]].append((e, proj, suffix, name))
        total = sum(len(v) for v in by_file.values())
        bar = tqdm(total=total, desc=f"layer {layer_idx}", unit="tensor",
                   disable=not progress, leave=False)  # fmt: skip
        with bar:
            for file, items in sorted(by_file.items()):
                path = self.model_dir / file
                try:
                    handle = safe_open(path, framework="pt", device="cpu")
                except Exception as e:
                    raise ValueError(
                        f"{path}: cannot open ({e}); needed for {items[0][3]}"
                    ) from None
                with handle as f:
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
        self, layer: torch.nn.Module, layer_idx: int, progress: bool = False
    ):
        """Load decoder layer ``layer_idx``'s experts into ``layer`` (a
        ``FusedMoE``) through its ``weight_loader``. Checks the geometry
        first; every tensor is checked by the loader (shape, dtype)."""
        if layer.global_num_experts != self.num_experts:
            raise ValueError(
                f"{self.model_dir}: config.json has {self.num_experts} experts, the "
                f"layer {layer.global_num_experts}"
            )
        gated = layer.activation.is_gated
        if gated != (self.activation == "silu"):
            raise ValueError(
                f"{self.model_dir}: checkpoint experts are {self.activation}, the "
                f"layer is {layer.activation.value}"
            )
        shard_of = {"gate_proj": "w1", "up_proj": "w3" if gated else "w1",
                    "down_proj": "w2"}  # fmt: skip
        first = layer.ep_rank * layer.local_num_experts
        owned = range(first, first + layer.local_num_experts)
        for name, e, proj, suffix, tensor in self.iter_layer_tensors(
            layer_idx, owned, progress
        ):
            shard = shard_of[proj]
            prefix = "w2" if shard == "w2" else "w13"
            param = getattr(layer, f"{prefix}_{suffix}")
            layer.weight_loader(param, tensor, name, shard, e)
