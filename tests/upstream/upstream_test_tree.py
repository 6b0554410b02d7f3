# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""What one of this branch's kernel tests takes from this repository's
tests/ (the ``tests.*`` modules it imports, new files upstream: not
upstream's own helper modules, which the source tree holds), the vllm names
those files import, and a pytest run in a subprocess of this interpreter
(upstream's reload tests run so: upstream_reload_tests.py).

The reworked kernel test itself runs from vLLM's source tree, as upstream's
CI runs it (``cd tests && pytest kernels/moe/<file>``, README "vLLM from
source"), with upstream's real helper modules.

Nothing here imports vllm at module level: the child does, and
:func:`resolve_installed` where a test calls it.
"""

from __future__ import annotations

import ast
import importlib
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pytest_outcomes import OUTCOMES_ENV
from upstream_env import REPO_ROOT, UPSTREAM_VERSION

__all__ = [
    "UPSTREAMS_OWN",
    "ChildRun",
    "VllmName",
    "modules_of_test",
    "name_origin",
    "resolve_installed",
    "run_pytest",
    "vllm_names",
]

#: Upstream's own helper modules, at paths this repository also has: a test
#: imports upstream's (the source tree's), not followed here.
UPSTREAMS_OWN = ("tests/kernels/utils.py", "tests/kernels/moe/utils.py")
_HERE = Path(__file__).resolve().parent


def _imported_modules(tree: ast.Module) -> list[str]:
    """Every module named by an import; ``from package import module`` gives
    ``package.module`` where that is a module file here."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            package = REPO_ROOT / node.module.replace(".", "/")
            if package.is_dir():
                found += [
                    f"{node.module}.{a.name}"
                    for a in node.names
                    if (package / f"{a.name}.py").is_file()
                ]
            else:
                found.append(node.module)
    return found


def modules_of_test(test_relpath: str) -> list[str]:
    """The test file and every ``tests.*`` module it imports, directly or
    through those modules, as paths relative to the repository root (the
    test first, then sorted), upstream's own helper modules
    (:data:`UPSTREAMS_OWN`) left out. ValueError for a ``tests.*`` module
    that is not a file here, or a relative import (upstream's tests use
    absolute ones)."""
    seen: dict[str, None] = {}
    todo = [test_relpath]
    while todo:
        rel = todo.pop()
        if rel in seen:
            continue
        seen[rel] = None
        tree = ast.parse((REPO_ROOT / rel).read_text(), rel)
        if any(isinstance(n, ast.ImportFrom) and n.level for n in ast.walk(tree)):
            raise ValueError(f"{rel} has a relative import")
        for module in _imported_modules(tree):
            if module.split(".")[0] != "tests":
                continue
            dep = module.replace(".", "/") + ".py"
            if dep in UPSTREAMS_OWN:
                continue
            if not (REPO_ROOT / dep).is_file():
                raise ValueError(f"{rel} imports {module}, not a module file here")
            todo.append(dep)
    first, *rest = seen
    return [first, *sorted(rest)]


@dataclass
class ChildRun:
    """A child pytest run: its exit status, the end of its output, and what
    tests/upstream/pytest_outcomes.py recorded (``collected``,
    ``deselected``, ``outcomes``, ``vllm_file``, ``b12x_gate``)."""

    returncode: int
    output: str
    record: dict[str, Any]


def run_pytest(
    root: Path, args: list[str], timeout: float, pythonpath: tuple[Path, ...] = ()
) -> ChildRun:
    """``python -m pytest -p no:cacheprovider -p pytest_outcomes *args`` in
    ``root/tests`` with this interpreter (the installed vllm, or the tree
    first in ``pythonpath``, e.g. the unmodified release; never the
    repository root on ``sys.path``: ``PYTHONPATH`` is ``pythonpath``, this
    directory, for the plugin, then this process's own). Raises RuntimeError
    if the child wrote no record (it did not get to the end of its
    session)."""
    with tempfile.TemporaryDirectory(prefix="pytest-outcomes-") as tmp:
        out = Path(tmp) / "outcomes.json"
        inherited = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join(
                [*map(str, pythonpath), str(_HERE), *inherited]
            ),
            OUTCOMES_ENV: str(out),
        }
        proc = subprocess.run(
            [sys.executable, "-m", "pytest", "-p", "no:cacheprovider"]
            + ["-p", "pytest_outcomes", *args],
            cwd=root / "tests",
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        output = (proc.stdout + proc.stderr)[-6000:]
        if not out.is_file():
            raise RuntimeError(
                f"the child pytest wrote no record (status {proc.returncode}):\n"
                f"{output}"
            )
        record = json.loads(out.read_text())
    return ChildRun(proc.returncode, output, record)


@dataclass(frozen=True)
class VllmName:
    """A name a file takes from vllm: ``module`` (dotted), ``name`` (the
    attribute; "" for the module itself), and where (``path:line``)."""

    module: str
    name: str
    where: str


def vllm_names(relpaths: list[str], root: Path = REPO_ROOT) -> list[VllmName]:
    """Every vllm module and name the files (paths relative to ``root``)
    import: ``from vllm.m import n`` gives (vllm.m, n); ``import vllm.m as
    a`` gives (vllm.m, "") and (vllm.m, x) for each ``a.x`` in the file.
    Relative imports are not followed (:func:`modules_of_test` refuses
    them)."""
    found: list[VllmName] = []
    for rel in relpaths:
        tree = ast.parse((root / rel).read_text(), rel)
        aliases: dict[str, str] = {}
        for node in ast.walk(tree):
            where = f"{rel}:{getattr(node, 'lineno', 0)}"
            if isinstance(node, ast.ImportFrom) and node.module and not node.level:
                if node.module.split(".")[0] == "vllm":
                    for a in node.names:
                        found.append(VllmName(node.module, a.name, where))
            elif isinstance(node, ast.Import):
                for a in node.names:
                    if a.name.split(".")[0] == "vllm":
                        found.append(VllmName(a.name, "", where))
                        if a.asname:
                            aliases[a.asname] = a.name
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id in aliases
            ):
                where = f"{rel}:{node.lineno}"
                found.append(VllmName(aliases[node.value.id], node.attr, where))
    return found


def _module_file(root: Path, module: str) -> Path | None:
    rel = module.replace(".", "/")
    for candidate in (f"{rel}/__init__.py", f"{rel}.py"):
        if (root / candidate).is_file():
            return root / candidate
    return None


def _bound_names(path: Path) -> set[str]:
    """The names a module binds at its top level, in ``if`` and ``try``
    blocks there included: definitions, assignments and imports."""
    names: set[str] = set()
    todo = list(ast.parse(path.read_text(encoding="utf-8"), str(path)).body)
    while todo:
        stmt = todo.pop()
        if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(stmt.name)
        elif isinstance(stmt, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]
            for target in targets:
                names.update(n.id for n in ast.walk(target) if isinstance(n, ast.Name))
        elif isinstance(stmt, (ast.Import, ast.ImportFrom)):
            for a in stmt.names:
                names.add(a.asname or a.name.split(".")[0])
        elif isinstance(stmt, ast.If):
            todo += stmt.body + stmt.orelse
        elif isinstance(stmt, ast.Try):
            todo += stmt.body + stmt.orelse + stmt.finalbody
            todo += [s for h in stmt.handlers for s in h.body]
    return names


def _has(root: Path, name: VllmName) -> bool:
    path = _module_file(root, name.module)
    if path is None:
        return False
    return (
        not name.name
        or name.name in _bound_names(path)
        or _module_file(root, f"{name.module}.{name.name}") is not None
    )


def name_origin(name: VllmName, unmodified: Path, manifest: Any) -> str | None:
    """Whose ``name`` is: the release's (its version, e.g. "0.34.0") where
    the unmodified release's source (the tree under ``unmodified``) binds it,
    "branch" where the branch's manifest (tools/fork_manifest.py's
    ``Manifest``) adds its module (``new``), or names it among the
    definitions it replaces or adds in an upstream module (``replace``,
    ``add``; a class's member by its class) or the variables it adds
    (``envs``); None where it is neither's."""
    if _has(unmodified, name):
        return UPSTREAM_VERSION
    rel = name.module.replace(".", "/")
    paths = (f"{rel}.py", f"{rel}/__init__.py")
    # One entry per PR that touches the file.
    entries = [e for e in manifest.entries(version=UPSTREAM_VERSION) if e.path in paths]
    if any(e.new for e in entries):
        return "branch"
    owned = {q.split(".")[0] for e in entries for q in (*e.replace, *e.add, *e.envs)}
    return "branch" if name.name in owned else None


def resolve_installed(name: VllmName) -> str | None:
    """Import ``name`` from the vllm this process imports (the installed
    one): None where it resolves, else what failed."""
    try:
        module = importlib.import_module(name.module)
    except ImportError as exc:
        return f"import {name.module}: {exc}"
    if not name.name or hasattr(module, name.name):
        return None
    try:
        importlib.import_module(f"{name.module}.{name.name}")
    except ImportError:
        return f"{name.module} has no {name.name}"
    return None
