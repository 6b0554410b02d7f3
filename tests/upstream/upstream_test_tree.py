# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Upstream's test tree in a temporary directory, holding one of this
branch's kernel tests and the helper modules it takes from this repository's
tests/, at their upstream paths; a pytest run of it in a subprocess of this
interpreter, as upstream's CI runs a kernel test (``cd tests && pytest
kernels/moe/<file>``); and the vllm names those files import.

The tree (``lay_out``)::

    <root>/pytest.ini                   stand-in for upstream's pytest
                                        settings (pyproject.toml): empty, it
                                        pins the rootdir; no custom marker is
                                        used
    <root>/tests/__init__.py            \\
    <root>/tests/kernels/__init__.py     > empty, as upstream's
    <root>/tests/kernels/moe/__init__.py/
    <root>/tests/kernels/utils.py       stand-ins for upstream's own helper
    <root>/tests/kernels/moe/utils.py   modules: importing one raises
                                        ImportError (the test must need
                                        neither: this tree's files of those
                                        names are not upstream's)
    <root>/tests/kernels/moe/test_*.py  the branch's test and, at their
    <root>/tests/kernels/moe/*.py       paths, the tests.* modules it imports
                                        (copied; new files upstream)

Upstream's conftest.py files (tests/conftest.py's fixtures,
``workspace_init`` among them) are not laid out: a test needing one of them
errors in the run.

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
    "STAND_INS",
    "ChildRun",
    "VllmName",
    "lay_out",
    "modules_of_test",
    "name_origin",
    "resolve_installed",
    "run_pytest",
    "vllm_names",
]

#: Upstream's own files at paths this repository also has: stand-ins that
#: refuse to be imported.
STAND_INS = ("tests/kernels/utils.py", "tests/kernels/moe/utils.py")
_HERE = Path(__file__).resolve().parent
_PACKAGES = ("tests", "tests/kernels", "tests/kernels/moe")
_STAND_IN = '''\
"""Stand-in for upstream's own {path} (not this repository's file of that
name): the test under run must not import it."""

raise ImportError("{path} is upstream's own helper module: a stand-in here")
'''
_PYTEST_INI = """\
# Stand-in for upstream's pytest settings (pyproject.toml): pins the rootdir.
[pytest]
"""


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
    test first, then sorted). ValueError for a ``tests.*`` module that is
    not a file here, or a relative import (upstream's tests use absolute
    ones)."""
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
            if not (REPO_ROOT / dep).is_file():
                raise ValueError(f"{rel} imports {module}, not a module file here")
            todo.append(dep)
    first, *rest = seen
    return [first, *sorted(rest)]


def lay_out(root: Path, modules: list[str]) -> None:
    """Write the tree of the module docstring under ``root`` with
    ``modules`` (repository-relative paths, from :func:`modules_of_test`)
    copied to the same paths. ValueError if one of them is a stand-in's
    path."""
    if clash := sorted(set(modules) & set(STAND_INS)):
        raise ValueError(f"{', '.join(clash)}: upstream's own files, not the test's")
    (root / "pytest.ini").write_text(_PYTEST_INI)
    for package in _PACKAGES:
        (root / package).mkdir(parents=True, exist_ok=True)
        (root / package / "__init__.py").write_text("")
    for path in STAND_INS:
        (root / path).write_text(_STAND_IN.format(path=path))
    for rel in modules:
        target = root / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text((REPO_ROOT / rel).read_text())


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
