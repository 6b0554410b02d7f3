# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Which NVFP4 mode (W4A4 or W4A16) a checkpoint's config declares for each
MoE layer's experts.

Pure functions over already-parsed JSON (the reader opens the files): each
returns an :class:`ExpertModes` that maps one MoE layer (its experts module
name and the names of its expert linear modules) to ``"w4a4"`` or
``"w4a16"`` (:data:`~vllm.model_executor.layers.quantization.modelopt.
NVFP4_QUANT_MODES`), or raises a ValueError naming the file and the key.

ModelOpt (``hf_quant_config.json`` ``quantization``, or ``config.json``
``quantization_config``)::

    quant_algo: "NVFP4"            every layer W4A4
    quant_algo: "W4A16_NVFP4"      every layer W4A16
    quant_algo: "MIXED_PRECISION"  per module, from
    quantized_layers: {"model.layers.3.mlp.experts": {"quant_algo": "W4A16_NVFP4"},
                       "model.layers.3.self_attn.q_proj": {"quant_algo": "FP8"}, ...}

  A layer's experts are declared by the experts module's entry and/or by one
  entry per expert linear module (``...experts.7.down_proj``); all that are
  present must agree, and without a module entry every linear must have one.
  Entries for other modules may name any algorithm (FP8 attention, ...): they
  are not read here. ``quantized_layers`` outside MIXED_PRECISION, or an
  experts entry that is not NVFP4 / W4A16_NVFP4, is an error.

compressed-tensors (``config.json`` ``quantization_config``)::

    config_groups: {name: {targets: [...], weights: {...},
                           input_activations: {...} | null, format: ...}}

  An NVFP4 group (``nvfp4-pack-quantized``, 4-bit float weights in
  ``tensor_group`` blocks of 16) is W4A16 when ``input_activations`` is null
  and W4A4 when it is NVFP4 too. Each expert linear module takes the group
  whose targets match it best, as compressed-tensors does: an exact module
  name, then a ``re:`` pattern (``re.match``), then the class ``Linear``.
  Two groups matching at the same rank, a layer whose linears disagree, an
  expert that is ignored, unmatched or matched by a non-NVFP4 group: errors.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "MIXED_PRECISION",
    "MODELOPT_NVFP4_ALGOS",
    "W4A4",
    "W4A16",
    "ExpertModes",
    "compressed_tensors_expert_modes",
    "modelopt_expert_modes",
]

W4A4 = "w4a4"
W4A16 = "w4a16"
#: ModelOpt ``quant_algo`` values of NVFP4 experts -> quant mode.
MODELOPT_NVFP4_ALGOS = {"NVFP4": W4A4, "W4A16_NVFP4": W4A16}
MIXED_PRECISION = "MIXED_PRECISION"
_NVFP4_FORMAT = "nvfp4-pack-quantized"
_GROUP_SIZE = 16


@dataclass(frozen=True)
class ExpertModes:
    """The mode of each MoE layer's experts, as a config file declares it.

    ``mode_of(experts_module, linears)`` takes the experts module name
    (``model.layers.3.mlp.experts``) and the names of its expert linear
    modules (``model.layers.3.mlp.experts.0.gate_proj``, ...) and returns
    ``"w4a4"`` or ``"w4a16"``; ValueError naming ``path`` and the key
    otherwise.
    """

    path: Path
    _resolve: Callable[[str, list[str]], str]

    def mode_of(self, experts_module: str, linears: Iterable[str]) -> str:
        return self._resolve(experts_module, sorted(set(linears)))


def _algo(entry: object, path: Path, key: str) -> str:
    """The ``quant_algo`` string of a ModelOpt entry (a dict with one, or the
    string itself), upper-cased."""
    if isinstance(entry, dict):
        algo = entry.get("quant_algo")
        key = f"{key}.quant_algo"
    else:
        algo = entry
    if not isinstance(algo, str) or not algo:
        raise ValueError(f"{path}: {key} must be an algorithm name, got {algo!r}")
    return algo.upper()


def _check_group_size(entry: dict, path: Path, key: str) -> None:
    size = entry.get("group_size", _GROUP_SIZE)
    if size != _GROUP_SIZE:
        raise ValueError(
            f"{path}: {key}.group_size is {size!r}; NVFP4 blocks are 16 elements"
        )


def _nvfp4_mode(algo: str, path: Path, key: str, what: str) -> str:
    if algo not in MODELOPT_NVFP4_ALGOS:
        raise ValueError(
            f"{path}: unsupported ModelOpt quant_algo {algo!r} at {key} for "
            f"{what} (expected one of {sorted(MODELOPT_NVFP4_ALGOS)})"
        )
    return MODELOPT_NVFP4_ALGOS[algo]


def modelopt_expert_modes(quant: dict, path: Path, key: str) -> ExpertModes:
    """The modes a ModelOpt quantization dict declares.

    Args:
        quant: the dict holding ``quant_algo`` (``hf_quant_config.json``'s
            ``quantization``, or ``config.json``'s ``quantization_config``).
        path: the file, for messages.
        key: where ``quant`` sits in that file (``"quantization"``), for
            messages.
    """
    algo = _algo(quant.get("quant_algo"), path, f"{key}.quant_algo")
    layers = quant.get("quantized_layers")
    if algo != MIXED_PRECISION:
        mode = _nvfp4_mode(algo, path, f"{key}.quant_algo", "the checkpoint")
        if layers is not None:
            raise ValueError(
                f"{path}: {key}.quantized_layers is given but {key}.quant_algo is "
                f"{algo!r}; per-module algorithms need quant_algo "
                f"{MIXED_PRECISION!r}"
            )
        _check_group_size(quant, path, key)
        return ExpertModes(path, lambda module, linears: mode)
    if not isinstance(layers, dict) or not layers:
        raise ValueError(
            f"{path}: quant_algo {MIXED_PRECISION!r} needs {key}.quantized_layers, "
            f"a JSON object of module name -> algorithm; got {type(layers).__name__}"
        )
    entries_key = f"{key}.quantized_layers"

    def declared(name: str) -> str | None:
        if name not in layers:
            return None
        entry = layers[name]
        where = f"{entries_key}[{name!r}]"
        algo = _algo(entry, path, where)
        if isinstance(entry, dict):
            _check_group_size(entry, path, where)
        return _nvfp4_mode(algo, path, f"{where}.quant_algo", "routed experts")

    def resolve(module: str, linears: list[str]) -> str:
        found = {}
        for name in [module, *linears]:
            mode = declared(name)
            if mode is not None:
                found[name] = mode
        if not found:
            raise ValueError(
                f"{path}: {entries_key} has no entry for {module} (nor its expert "
                f"linears, e.g. {linears[0] if linears else module}): its experts "
                "are not declared NVFP4"
            )
        if module not in found:
            missing = [n for n in linears if n not in found]
            if missing:
                raise ValueError(
                    f"{path}: {entries_key} declares some of {module}'s expert "
                    f"linears but not {missing[0]} ({len(missing)} missing), "
                    f"and has no entry for {module}"
                )
        modes = set(found.values())
        if len(modes) > 1:
            first = next(iter(found))
            other = next(n for n, m in found.items() if m != found[first])
            raise ValueError(
                f"{path}: {entries_key} contradicts itself for {module}: "
                f"{first!r} is {found[first]}, {other!r} is {found[other]}"
            )
        return modes.pop()

    return ExpertModes(path, resolve)


# --- compressed-tensors -------------------------------------------------------


def _is_nvfp4_scheme(scheme: object) -> bool:
    return (
        isinstance(scheme, dict)
        and scheme.get("num_bits") == 4
        and scheme.get("type") == "float"
        and scheme.get("strategy") == "tensor_group"
        and scheme.get("group_size") == _GROUP_SIZE
    )


@dataclass(frozen=True)
class _Group:
    name: str
    targets: tuple[str, ...]
    mode: str | None  # None: not an NVFP4 group


def _targets(value: object, path: Path, key: str) -> tuple[str, ...]:
    if not isinstance(value, list) or not all(isinstance(t, str) for t in value):
        raise ValueError(f"{path}: {key} must be a list of strings, got {value!r}")
    for t in value:
        if t.startswith("re:"):
            try:
                re.compile(t[3:])
            except re.error as e:
                raise ValueError(f"{path}: {key}: bad pattern {t!r} ({e})") from None
    return tuple(value)


def _ct_group(name: str, group: object, fmt: object, path: Path, key: str) -> _Group:
    where = f"{key}.config_groups[{name!r}]"
    if not isinstance(group, dict):
        raise ValueError(f"{path}: {where} must be a JSON object")
    targets = _targets(group.get("targets"), path, f"{where}.targets")
    fmt = group.get("format") or fmt
    if fmt != _NVFP4_FORMAT:
        return _Group(name, targets, None)
    if not _is_nvfp4_scheme(group.get("weights")):
        raise ValueError(
            f"{path}: {where}.weights is {group.get('weights')!r}; format "
            f"{_NVFP4_FORMAT!r} needs num_bits 4, type float, strategy "
            "tensor_group, group_size 16"
        )
    if "input_activations" not in group:
        raise ValueError(
            f"{path}: {where} has no input_activations: null for W4A16 "
            "(weight-only), or the NVFP4 scheme for W4A4"
        )
    acts = group["input_activations"]
    if acts is None:
        return _Group(name, targets, W4A16)
    if _is_nvfp4_scheme(acts):
        return _Group(name, targets, W4A4)
    raise ValueError(
        f"{path}: {where}.input_activations is {acts!r}; expected null (W4A16) "
        "or NVFP4 (num_bits 4, type float, tensor_group, group_size 16: W4A4)"
    )


def _match_rank(target: str, name: str) -> int | None:
    """0: the exact module name, 1: a ``re:`` pattern, 2: the class Linear
    (every expert projection is one); None: no match."""
    if target == name:
        return 0
    if target.startswith("re:"):
        return 1 if re.match(target[3:], name) else None
    return 2 if target == "Linear" else None


def compressed_tensors_expert_modes(qc: dict, path: Path, key: str) -> ExpertModes:
    """The modes a compressed-tensors ``quantization_config`` declares.

    Args:
        qc: ``config.json``'s ``quantization_config``.
        path, key: the file and ``qc``'s key in it, for messages.
    """
    groups_value = qc.get("config_groups")
    if not isinstance(groups_value, dict) or not groups_value:
        raise ValueError(f"{path}: {key}.config_groups must be a non-empty object")
    groups = [
        _ct_group(n, g, qc.get("format"), path, key) for n, g in groups_value.items()
    ]
    ignore = _targets(qc.get("ignore", []), path, f"{key}.ignore")
    modes = {g.mode for g in groups if g.mode is not None}
    if not modes:
        raise ValueError(
            f"{path}: no group of {key}.config_groups is {_NVFP4_FORMAT!r}"
        )
    groups_key = f"{key}.config_groups"

    def linear_mode(name: str) -> str:
        for t in ignore:
            if _match_rank(t, name) is not None:
                raise ValueError(
                    f"{path}: {key}.ignore entry {t!r} excludes the expert "
                    f"linear {name}: it is not NVFP4"
                )
        best: dict[int, list[_Group]] = {}
        for g in groups:
            ranks = [r for t in g.targets if (r := _match_rank(t, name)) is not None]
            if ranks:
                best.setdefault(min(ranks), []).append(g)
        if not best:
            raise ValueError(
                f"{path}: no target of {groups_key} matches the expert linear {name}"
            )
        top = best[min(best)]
        if len(top) > 1:
            raise ValueError(
                f"{path}: {groups_key} {top[0].name!r} and {top[1].name!r} both "
                f"target {name} equally specifically"
            )
        g = top[0]
        if g.mode is None:
            raise ValueError(
                f"{path}: {groups_key}[{g.name!r}] targets the expert linear {name} "
                f"but is not {_NVFP4_FORMAT!r}"
            )
        return g.mode

    def resolve(module: str, linears: list[str]) -> str:
        found: dict[str, list[str]] = {}
        for name in linears:
            found.setdefault(linear_mode(name), []).append(name)
        if len(found) > 1:
            a, b = (found[m][0] for m in sorted(found))
            raise ValueError(
                f"{path}: {groups_key} gives {module}'s expert linears different "
                f"modes: {a} is {sorted(found)[0]}, {b} is {sorted(found)[1]}"
            )
        if not found:
            raise ValueError(f"{path}: {module} has no expert linears to match")
        return next(iter(found))

    return ExpertModes(path, resolve)
