# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The API of the modules the branch changes, release against fork (griffe),
for test_interfaces.py: every definition of a changed module in the release
(public ones, and private ones the fork keeps) still in the fork with a
compatible signature (griffe's breaking changes: a parameter removed,
renamed, moved, made required, a default changed, a kind changed; the same
for the private functions a base class calls), and every name upstream's
own modules import from a changed module still bound there.
"""

from __future__ import annotations

import ast
from collections.abc import Sequence
from pathlib import Path

import griffe

from fork_branch import top_names  # tools/, on sys.path in tests/upstream
from fork_manifest import load_manifest

__all__ = ["changed_paths", "differences", "importer_differences"]


def changed_paths(version: str | None = None) -> list[str]:
    """The release's files the branch edits (not its new files), in order."""
    manifest = load_manifest()
    if version is not None:
        manifest.release(version)
    entries = manifest.entries(version=version)
    return list(dict.fromkeys(e.path for e in entries if not e.new))


def _module(root: Path, path: str) -> griffe.Module:
    name = path.removesuffix(".py").removesuffix("/__init__").replace("/", ".")
    file = root / path
    return griffe.visit(name, filepath=file, code=file.read_text(encoding="utf-8"))


def _signature(f: griffe.Function) -> list[tuple]:
    return [(p.name, p.kind, p.default) for p in f.parameters]


def _text(signature: list[tuple]) -> str:
    return "(" + ", ".join(n + (f"={d}" if d else "") for n, _, d in signature) + ")"


def _private(old: griffe.Object, new: griffe.Object, out: list[str]) -> None:
    """Private functions (hooks a base class calls) griffe's check skips:
    the release's parameters first, anything added keyword-only or optional."""
    for name, o in old.members.items():
        n = new.members.get(name)
        if o.is_alias or n is None or n.is_alias:
            continue
        if o.is_class and n.is_class:
            _private(o, n, out)
        elif name.startswith("_") and o.is_function and n.is_function:
            old_sig, new_sig = _signature(o), _signature(n)
            extra = list(n.parameters)[len(old_sig) :]
            if new_sig[: len(old_sig)] != old_sig or any(
                p.default is None and p.kind.value.startswith("positional")
                for p in extra
            ):
                out.append(f"{o.path}: {_text(old_sig)} is now {_text(new_sig)}")


def differences(upstream: Path, fork: Path, paths: Sequence[str]) -> list[str]:
    """Each incompatibility of the fork's modules ``paths`` with upstream's."""
    out: list[str] = []
    for path in paths:
        old, new = _module(upstream, path), _module(fork, path)
        for b in griffe.find_breaking_changes(old, new):
            value = getattr(b.old_value, "name", b.old_value)
            detail = f" ({value})" if b.kind.name.startswith("PARAMETER") else ""
            out.append(f"{b.obj.path}: {b.kind.value}{detail}")
        _private(old, new, out)
    return out


def importer_differences(upstream: Path, fork: Path, paths: Sequence[str]) -> list[str]:
    """Each ``from M import n`` in upstream's vllm/ (M a module of ``paths``)
    whose ``n`` the fork's M no longer binds."""
    modules = {p.removesuffix(".py").replace("/", "."): p for p in paths}
    bound = {
        m: top_names((fork / p).read_text(encoding="utf-8")) for m, p in modules.items()
    }
    out = []
    for file in sorted((upstream / "vllm").rglob("*.py")):
        text = file.read_text(encoding="utf-8", errors="replace")
        if not any(m in text for m in modules):
            continue
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ImportFrom) and node.module in modules:
                for a in node.names:
                    if not {a.name, "*"} & bound[node.module]:
                        where = f"{file.relative_to(upstream)}:{node.lineno}"
                        out.append(f"{where}: imports {a.name} from {node.module}")
    return out
