# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Every tensor a loaded vLLM model reaches, by path, with its layout, a digest
of its bytes and its address, for exact comparisons between loads, reloads and
processes (the records are JSON-serialisable).

Reached: each module's parameters, buffers and plain tensor attributes (the
experts' derived tensors ``refill_derived`` keeps on the layer), and, below a
module's ``quant_method``, every vLLM or FlashInfer object it holds (the
modular kernel, its experts object with their MMA views and alphas, quant
configs) and their lists, tuples and dicts.
"""

import dataclasses
import hashlib
from typing import Any

import torch

__all__ = ["TensorRecord", "differences", "reachable_tensors", "records"]

# Objects walked below a module: vLLM's layers' helpers and FlashInfer's
# prepared-weight records; not configs (no tensors, and they reach the world).
_WALKED = ("vllm.model_executor.", "flashinfer.")

# [shape, stride, dtype, storage offset, sha256 of the bytes, data_ptr]: a
# list, as it comes back from JSON
TensorRecord = list


def reachable_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Path -> tensor for every tensor reachable from ``model``: modules by
    their ``named_modules`` names, then what their attributes hold, each
    object under the first path that reaches it."""
    out: dict[str, torch.Tensor] = {}
    modules = dict(model.named_modules())
    seen = {id(m) for m in modules.values()}
    for prefix, module in modules.items():
        attrs = [
            *module._parameters.items(),
            *module._buffers.items(),
            *(
                (k, v)
                for k, v in vars(module).items()
                if k not in ("_parameters", "_buffers", "_modules")
            ),
        ]
        for name, value in attrs:
            _walk(value, f"{prefix}.{name}" if prefix else name, out, seen)
    return out


def _children(obj: Any) -> list[tuple[str, Any]]:
    if isinstance(obj, (list, tuple)):
        return [(str(i), v) for i, v in enumerate(obj)]
    if isinstance(obj, dict):
        return [(str(k), v) for k, v in obj.items()]
    if isinstance(obj, torch.nn.Module):
        return []  # walked by its own name
    if type(obj).__module__.startswith(_WALKED):
        if dataclasses.is_dataclass(obj):
            return [(f.name, getattr(obj, f.name)) for f in dataclasses.fields(obj)]
        return list(getattr(obj, "__dict__", {}).items())
    return []


def _walk(obj: Any, path: str, out: dict, seen: set[int]) -> None:
    if isinstance(obj, torch.Tensor):
        out.setdefault(path, obj)
        return
    if obj is None or id(obj) in seen:
        return
    seen.add(id(obj))
    for name, child in _children(obj):
        _walk(child, f"{path}.{name}", out, seen)


def _record(t: torch.Tensor) -> TensorRecord:
    data = t.detach().contiguous().reshape(-1).view(torch.uint8)
    digest = hashlib.sha256(data.numpy()).hexdigest()
    return [
        list(t.shape),
        list(t.stride()),
        str(t.dtype),
        t.storage_offset(),
        digest,
        t.data_ptr(),
    ]


def records(model: torch.nn.Module) -> dict[str, TensorRecord]:
    """Path -> [shape, stride, dtype, storage offset, sha256, data_ptr] of
    every reachable tensor (meta tensors left out)."""
    return {
        path: _record(t)
        for path, t in reachable_tensors(model).items()
        if not t.is_meta
    }


def differences(
    actual: dict[str, TensorRecord],
    expected: dict[str, TensorRecord],
    *,
    addresses: bool = False,
) -> list[str]:
    """What differs between two ``records``: paths only in one, layouts,
    bytes, and (with ``addresses``) data_ptrs; empty when equal."""
    out = [f"only in actual: {p}" for p in sorted(actual.keys() - expected.keys())]
    out += [f"only in expected: {p}" for p in sorted(expected.keys() - actual.keys())]
    for path in sorted(actual.keys() & expected.keys()):
        a, e = actual[path], expected[path]
        if a[:4] != e[:4]:
            out.append(f"{path}: layout {a[:4]} != {e[:4]}")
        elif a[4] != e[4]:
            out.append(f"{path}: bytes differ")
        if addresses and a[5] != e[5]:
            out.append(f"{path}: moved")
    return out
