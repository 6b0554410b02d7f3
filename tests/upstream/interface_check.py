# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The interface check of test_interfaces.py: this branch's modules beside
vLLM the release's, by what they define and what they take from each other.

Three trees are read as source (tools/fork_interfaces.py):

* *upstream*: the unmodified release (``upstream_env.unmodified_tree()``);
* *the fork*: the installed wheel, the release with this branch spliced in
  (what ships: a spliced definition there is the slice's text, its bases
  and helpers upstream's);
* *the slice*: this repository's ``vllm/`` (its stand-ins and harness
  modules, which the fork does not ship).

The fork is also imported in this process (``import vllm`` loads it) for
what source alone cannot say: names a module binds when it runs
(``vllm.envs``' variables, ``vllm.platforms.current_platform``) and the
signatures calls must bind to. Nothing here imports vllm at module level.

The four checks, one function each (the manifest, tools/fork_manifest.toml,
says which definitions are the branch's):

1. :func:`changed_definitions`: each definition the branch ships in a file
   upstream has (spliced, the replaced file's public names, stand-ins)
   against upstream's: signature, class shape.
2. :func:`importer_names`: every name upstream's own modules take from a
   changed module is in the fork's module.
3. :func:`shipped_code_uses`: every name the branch's shipped code takes
   from upstream's modules is in the fork, and its calls bind there.
4. :func:`harness_table`: the slice's other public names at upstream's
   paths, beside upstream's (a Markdown table the design page carries).
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import inspect
import os
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

from upstream_env import REPO_ROOT, SLICE_VLLM, UPSTREAM_VERSION, unmodified_tree

try:  # tests/upstream's pytest.ini puts tools/ on sys.path
    import build_fork_wheel
    import fork_interfaces as fi
except ImportError:  # the slice's own suite (collected, skipped): the root
    from tools import build_fork_wheel
    from tools import fork_interfaces as fi
# tools/fork_splice.py is gone and tools/fork_interfaces.py is griffe-based
# now: the checks below still use the old API until they are ported.
ModuleInfo = _module_name = _stmt_names = None

__all__ = [
    "DOCS_PAGE",
    "TABLE_BEGIN",
    "TABLE_END",
    "TABLE_ENV",
    "Interfaces",
    "UseCheck",
    "directory_lookup",
    "docs_table",
    "table_path",
]

MANIFEST = REPO_ROOT / "tools" / "fork_manifest.toml"
_RELEASE = UPSTREAM_VERSION
DOCS_PAGE = REPO_ROOT / "docs" / "design" / "nvfp4_moe_weight_preparation.md"
#: The table of the slice's harness names beside the release's sits between
#: these markers in the design page, one table per release.
TABLE_BEGIN = f"<!-- interface-table:{_RELEASE}:begin -->"
TABLE_END = f"<!-- interface-table:{_RELEASE}:end -->"
#: Where test_interfaces.py writes the table it computes (default
#: build/fork/<release>/interfaces.md).
TABLE_ENV = "VLLM_FORK_INTERFACE_TABLE"
_CHANGED_MODES = ("splice", "replace", "envs")


def table_path() -> Path:
    path = Path(os.environ.get(TABLE_ENV) or f"build/fork/{_RELEASE}/interfaces.md")
    return path if path.is_absolute() else REPO_ROOT / path


def docs_table(text: str | None = None) -> str | None:
    """The table the design page holds between :data:`TABLE_BEGIN` and
    :data:`TABLE_END` (None without the markers)."""
    text = DOCS_PAGE.read_text() if text is None else text
    start, end = text.find(TABLE_BEGIN), text.find(TABLE_END)
    if start < 0 or end < start:
        return None
    return text[start + len(TABLE_BEGIN) : end].strip("\n") + "\n"


def directory_lookup(root: Path) -> Callable[[str], ModuleInfo | None]:
    """``lookup(dotted name)`` over the source files under ``root`` (the
    directory holding ``vllm/``), for :class:`fork_interfaces.SourceTree`."""

    def lookup(name: str) -> ModuleInfo | None:
        rel = name.replace(".", "/")
        for candidate, is_package in (
            (f"{rel}/__init__.py", True),
            (f"{rel}.py", False),
        ):
            path = root / candidate
            if path.is_file():
                return ModuleInfo(
                    candidate, path.read_text(encoding="utf-8"), is_package
                )
        folder = root / rel
        if folder.is_dir():
            return ModuleInfo(rel, None, True)  # a namespace package
        parent = (root / rel).parent
        stem = rel.rpartition("/")[2]
        if parent.is_dir() and any(
            p.name.startswith(f"{stem}.") and p.suffix in (".so", ".pyd")
            for p in parent.iterdir()
        ):
            return ModuleInfo(rel, None, False)  # a compiled extension
        return None

    return lookup


def _installed_root() -> Path:
    spec = importlib.util.find_spec("vllm")
    assert spec is not None and spec.origin is not None
    return Path(spec.origin).resolve().parents[1]


@dataclass
class UseCheck:
    """One name checked by :func:`Interfaces.shipped_code_uses` or
    :func:`Interfaces.importer_names`: ``where`` the use is (``path:line``,
    the definition), ``name`` what is taken (``module.name`` or a chain),
    ``problem`` what is wrong (None: present, and the call binds)."""

    where: str
    name: str
    problem: str | None = None
    #: Read on a class whose ``__getattr__`` answers (``torch.nn.Module``'s
    #: parameters): present or not is not knowable from the class.
    dynamic: bool = False

    def __str__(self) -> str:
        return f"{self.where}: {self.name}: {self.problem}"


@dataclass
class _Entry:
    path: str
    module: str
    mode: str
    definitions: tuple[str, ...] = ()
    variables: tuple[str, ...] = ()
    stand_ins: tuple[str, ...] = ()


@dataclass
class _Stats:
    names: int = 0
    uses: int = 0
    calls: int = 0
    dynamic: int = 0
    problems: list[UseCheck] = field(default_factory=list)


class Interfaces:
    """The trees, the manifest, and the four checks (module doc). Build one
    per session: parsing upstream's tree takes a few seconds."""

    def __init__(self, upstream_root: Path | None = None) -> None:
        self.upstream_root = upstream_root or unmodified_tree()
        self.fork_root = _installed_root()
        self.upstream = fi.SourceTree(directory_lookup(self.upstream_root), "upstream")
        self.fork = fi.SourceTree(directory_lookup(self.fork_root), "the fork")
        self.slice = fi.SourceTree(directory_lookup(REPO_ROOT), "the slice")
        manifest = build_fork_wheel.load_manifest(MANIFEST)
        self.entries = [
            _Entry(
                e.path,
                _module_name(e.path)[0],
                e.mode,
                e.definitions,
                e.variables,
                e.stand_ins,
            )
            for e in manifest.files
        ]
        self.changed = {e.module: e for e in self.entries if e.mode in _CHANGED_MODES}
        self.new_modules = {e.module for e in self.entries if e.mode == "new"}
        self.replaced = {e.module for e in self.entries if e.mode == "replace"}

    # -- paths -------------------------------------------------------------
    @cached_property
    def shared_paths(self) -> list[str]:
        """Every .py under the slice's vllm/ that the release's vllm/ also has."""
        paths = []
        for path in sorted(SLICE_VLLM.rglob("*.py")):
            rel = path.relative_to(REPO_ROOT).as_posix()
            if (self.upstream_root / rel).is_file():
                paths.append(rel)
        return paths

    def owned(self, module: str, name: str) -> bool:
        """Whether ``module``'s ``name`` is the branch's in the fork (a
        spliced definition, or anything of a replaced or new module)."""
        if module in self.new_modules or module in self.replaced:
            return True
        entry = self.changed.get(module)
        return entry is not None and name in entry.definitions

    def upstream_module(self, module: str) -> bool:
        """A module of the release's tree the fork keeps as upstream's or
        changes (not one the branch adds)."""
        return module not in self.new_modules and self.upstream.has_module(module)

    # -- 1. the changed definitions ------------------------------------------
    def changed_definitions(self) -> fi.Comparison:
        """Each definition the branch ships in a changed file against
        upstream's (the fork's text for the spliced and replaced ones, the
        slice's for stand-ins, which the fork keeps as upstream's)."""
        out = fi.Comparison()
        for entry in self.changed.values():
            module = entry.module
            names = list(entry.definitions)
            if entry.mode == "replace":
                names = fi.public_names(self.slice, module)
                for name in fi.public_names(self.upstream, module):
                    if name not in names and self.upstream.definition(module, name):
                        out.differences.append(
                            fi.Difference(module, name, "the branch's file lacks it")
                        )
            for name in names:
                out.extend(
                    fi.compare_definition(self.upstream, self.fork, module, name)
                )
            for name in entry.stand_ins:
                out.extend(
                    fi.compare_definition(
                        self.upstream, self.slice, module, name, must_exist=True
                    )
                )
            if entry.variables:
                upstream_env = _env_keys(self.upstream, module)
                for var in entry.variables:
                    (out.compared if var in upstream_env else out.added).append(var)
        return out

    def fork_definition_mismatches(self) -> list[str]:
        """Spliced definitions whose text in the fork is not the slice's, and
        replaced or new files that differ (the fork is stale)."""
        out = []
        for entry in self.entries:
            fork_text = (self.fork_root / entry.path).read_text(encoding="utf-8")
            slice_text = (REPO_ROOT / entry.path).read_text(encoding="utf-8")
            if entry.mode in ("replace", "new"):
                if fork_text != slice_text:
                    out.append(f"{entry.path}: the fork's file is not the slice's")
                continue
            fork_defs = _definitions(fork_text)
            slice_defs = _definitions(slice_text)
            for name in entry.definitions:
                if fork_defs.get(name) != slice_defs.get(name):
                    out.append(f"{entry.path}: {name}: the fork's is not the slice's")
        return out

    # -- 2. upstream's importers ---------------------------------------------
    def importer_names(self) -> tuple[_Stats, list[fi.ImporterUse]]:
        """Every name the release's vllm/ modules take from a changed module,
        looked up in the fork's module (imported here), and each of their
        calls of one bound to the fork's signature."""
        targets = set(self.changed)
        keys = {m.rpartition(".")[2] for m in targets}
        uses: list[fi.ImporterUse] = []
        for path in sorted((self.upstream_root / "vllm").rglob("*.py")):
            text = path.read_text(encoding="utf-8")
            if not any(k in text for k in keys):
                continue
            rel = path.relative_to(self.upstream_root).as_posix()
            uses += fi.importer_uses(rel, text, targets)
        stats = _Stats()
        seen: dict[tuple[str, str], str | None] = {}
        for use in uses:
            key = (use.module, use.name)
            if key not in seen:
                seen[key] = self._fork_binds(use.module, use.name)
            where, label = f"{use.path}:{use.line}", f"{use.module}.{use.name}"
            problem = seen[key]
            if use.call is None:
                stats.uses += 1
            else:
                stats.calls += 1
                label += "(...)"
                if problem is None:
                    obj = self._attr(importlib.import_module(use.module), use.name)
                    if obj is not _MISSING:
                        problem = _bind_problem(obj, use.call, None, None, False)
            if problem is not None:
                stats.problems.append(UseCheck(where, label, problem))
        stats.names = len(seen)
        return stats, uses

    def _fork_binds(self, module: str, name: str) -> str | None:
        """None when the fork's ``module`` has ``name`` (bound when it runs,
        a submodule, or imported under ``if TYPE_CHECKING:``), else why not."""
        try:
            mod = importlib.import_module(module)
        except Exception as e:  # noqa: BLE001 - reported as the problem
            return f"the fork's module does not import: {type(e).__name__}: {e}"
        if hasattr(mod, name):
            return None
        if self.fork.has_module(f"{module}.{name}"):
            return None
        parsed = self.fork.module(module)
        if parsed is not None and parsed.binding(name) is not None:
            return None  # only for type checkers
        return "missing from the fork's module"

    # -- 3. what the shipped code takes from upstream --------------------------
    def shipped_code(self) -> Iterator[tuple[str, str, list[str] | None]]:
        """(path, module, definitions or None for the whole file) of the
        code the branch ships."""
        for entry in self.entries:
            if entry.mode in ("replace", "new"):
                yield entry.path, entry.module, None
            else:
                names = list(entry.definitions)
                if entry.variables:
                    names.append("environment_variables")
                yield entry.path, entry.module, names

    def shipped_code_uses(self) -> tuple[_Stats, list[UseCheck]]:
        """Each name the shipped code takes from the release's modules (imports,
        chains on imported modules and classes, ``self.x`` inherited from
        upstream's base classes, ``super()``, attributes of parameters
        annotated with upstream's classes), resolved in the fork; each call
        of such a name bound to the fork's signature."""
        stats = _Stats()
        checks: list[UseCheck] = []
        names: set[str] = set()
        for path, module, definitions in self.shipped_code():
            text = (REPO_ROOT / path).read_text(encoding="utf-8")
            fork_module = importlib.import_module(module)
            for use in fi.code_uses(path, text, definitions):
                for check, is_call in self._resolve(module, fork_module, use):
                    check.where = f"{path}:{use.line} ({use.definition})"
                    checks.append(check)
                    if check.dynamic:
                        stats.dynamic += 1
                        continue
                    stats.uses += not is_call
                    stats.calls += is_call
                    if not is_call:
                        names.add(check.name)
                    if check.problem is not None:
                        stats.problems.append(check)
        stats.names = len(names)
        return stats, checks

    def _resolve(
        self, module: str, fork_module: types.ModuleType, use: fi.CodeUse
    ) -> Iterator[tuple[UseCheck, bool]]:
        origin = use.origin
        kind = origin[0]
        if kind == "class":
            yield from self._resolve_class_use(module, fork_module, use)
            return
        if kind == "annotation":
            qualname = self.fork.qualify(module, origin[1].split("."))
            obj, label = self._import_qualname(qualname)
            if (
                obj is None
                or not isinstance(obj, type)
                or not self._upstream_object(obj)
            ):
                return
            yield from self._walk(obj, label, use.attrs, use.call, instance=True)
            return
        if kind == "module":
            target = origin[1]
            if not target.startswith("vllm") or not self.upstream_module(target):
                return
            obj = importlib.import_module(target)
            yield from self._walk(obj, target, use.attrs, use.call)
            return
        if kind == "from":
            source, name = origin[1], origin[2]
            if not source.startswith("vllm") or not self.upstream_module(source):
                return
            if self.owned(source, name):
                return
            label = f"{source}.{name}"
            problem = self._fork_binds(source, name)
            yield UseCheck("", label, problem), False
            if problem is not None:
                return
            obj = self._attr(importlib.import_module(source), name)
            if obj is _MISSING:
                return  # bound only for type checkers
            yield from self._walk(obj, label, use.attrs, use.call, count_root=False)
            return
        if kind == "local":
            name = origin[1]
            if self.owned(module, name) or module not in self.changed:
                return
            label = f"{module}.{name}"
            obj = getattr(fork_module, name, _MISSING)
            if obj is _MISSING:
                problem = self._fork_binds(module, name)
                yield UseCheck("", label, problem), False
                return
            yield UseCheck("", label), False
            yield from self._walk(obj, label, use.attrs, use.call, count_root=False)

    def _upstream_object(self, obj: Any) -> bool:
        module = getattr(obj, "__module__", None) or ""
        name = getattr(obj, "__qualname__", "").split(".")[0]
        return (
            module.startswith("vllm")
            and self.upstream_module(module)
            and not self.owned(module, name)
        )

    def _import_qualname(self, qualname: str) -> tuple[Any, str]:
        where = self.fork.split(qualname)
        if where is None:
            return None, qualname
        module, parts = where
        try:
            obj: Any = importlib.import_module(module)
        except Exception:  # noqa: BLE001 - not checkable here
            return None, qualname
        for p in parts:
            obj = getattr(obj, p, None)
        return obj, qualname

    @staticmethod
    def _attr(obj: Any, name: str) -> Any:
        try:
            return getattr(obj, name)
        except AttributeError:
            pass
        if isinstance(obj, types.ModuleType):
            try:
                return importlib.import_module(f"{obj.__name__}.{name}")
            except ImportError:
                pass
        return _MISSING

    def _class_has(self, cls: type, name: str) -> bool:
        """``name`` is a class attribute of ``cls`` or an instance attribute
        its hierarchy's source assigns (or declares as a field)."""
        if hasattr(cls, name):
            return True
        for klass in cls.__mro__:
            if name in vars(klass) or name in getattr(klass, "__annotations__", {}):
                return True
            shape = self.fork.class_shape(f"{klass.__module__}.{klass.__qualname__}")
            if shape is not None and name in shape.instance_attributes:
                return True
        return False

    def _walk(
        self,
        obj: Any,
        label: str,
        attrs: tuple[str, ...],
        call: fi.CallShape | None,
        instance: bool = False,
        count_root: bool = True,
    ) -> Iterator[tuple[UseCheck, bool]]:
        """Follow ``attrs`` from ``obj`` (an upstream module, class or
        object) while each step is a module, a class or an object of
        vllm's; one check per step, and the call's binding at the end."""
        if count_root and not attrs:
            yield UseCheck("", label), False
        owner: Any = None
        for i, attr in enumerate(attrs):
            step = f"{label}.{attr}"
            value = self._attr(obj, attr)
            found = value is not _MISSING or (
                isinstance(obj, type) and self._class_has(obj, attr)
            )
            if not found and isinstance(obj, type) and _dynamic(obj):
                yield UseCheck("", step, dynamic=True), False
                return
            yield UseCheck("", step, None if found else "missing in the fork"), False
            if not found:
                return
            owner, label = obj, step
            if value is _MISSING:
                return  # an instance attribute: its value is not known here
            if i < len(attrs) - 1 and not _followable(value):
                return
            obj = value
        if call is not None:
            bound = instance and len(attrs) == 1
            attr = attrs[-1] if attrs else None
            problem = _bind_problem(obj, call, owner, attr, bound)
            yield UseCheck("", f"{label}(...)", problem), True

    def _resolve_class_use(
        self, module: str, fork_module: types.ModuleType, use: fi.CodeUse
    ) -> Iterator[tuple[UseCheck, bool]]:
        cls = getattr(fork_module, use.origin[1], None)
        if not isinstance(cls, type):
            return
        attr = use.attrs[0]
        mro = cls.__mro__[1:] if use.root == "super" else cls.__mro__
        for klass in mro:
            shape = self.fork.class_shape(f"{klass.__module__}.{klass.__qualname__}")
            defines = attr in vars(klass) or (
                shape is not None
                and (attr in shape.instance_attributes or attr in shape.members)
            )
            if not defines:
                continue
            if not self._upstream_object(klass):
                return  # the branch's own (or outside vllm: torch.nn.Module's)
            label = f"{klass.__module__}.{klass.__qualname__}.{attr}"
            yield UseCheck("", label), False
            value = inspect.getattr_static(klass, attr, _MISSING)
            if use.call is not None and len(use.attrs) == 1 and value is not _MISSING:
                problem = _bind_problem(
                    getattr(klass, attr), use.call, klass, attr, instance=True
                )
                yield UseCheck("", f"{label}(...)", problem), True
            return
        if hasattr(cls, "__getattr__"):
            return
        label = f"{cls.__module__}.{cls.__qualname__}.{attr}"
        problem = "no class of its hierarchy in the fork binds it"
        yield UseCheck("", label, problem), False

    # -- 4. the slice's harness beside upstream --------------------------------
    def harness_rows(self) -> list[tuple[str, str, str]]:
        """(module path, name, difference) for each public name the slice
        defines at a shared path that the fork does not ship, and each name
        the shipped code takes from such a module that the slice lacks."""
        rows: list[tuple[str, str, str]] = []
        used = self._shipped_names_by_module()
        for path in self.shared_paths:
            module = _module_name(path)[0]
            entry = self.changed.get(module)
            if entry is not None and entry.mode == "replace":
                continue
            shipped = set(entry.definitions + entry.stand_ins) if entry else set()
            names = [n for n in fi.public_names(self.slice, module) if n not in shipped]
            for name in names:
                rows.append((path, name, self._harness_difference(module, name)))
            if entry is not None and entry.mode == "envs":
                up_env = _env_keys(self.upstream, module)
                for var in _env_keys(self.slice, module):
                    if var in entry.variables:
                        continue
                    text = "same" if var in up_env else f"not in {_RELEASE}"
                    rows.append((path, var, text))
            mod = self.slice.module(module)
            for name in sorted(used.get(module, ())):
                if mod is not None and mod.binding(name) is None and name not in names:
                    rows.append((path, name, _USED_UPSTREAM_ONLY))
        return rows

    def _shipped_names_by_module(self) -> dict[str, set[str]]:
        out: dict[str, set[str]] = {}
        for path, _module, definitions in self.shipped_code():
            text = (REPO_ROOT / path).read_text(encoding="utf-8")
            for use in fi.code_uses(path, text, definitions):
                if use.origin[0] == "from" and use.origin[1].startswith("vllm"):
                    if self.upstream.has_module(f"{use.origin[1]}.{use.origin[2]}"):
                        continue  # a submodule
                    out.setdefault(use.origin[1], set()).add(use.origin[2])
                elif use.origin[0] == "module" and use.attrs:
                    out.setdefault(use.origin[1], set()).add(use.attrs[0])
        return out

    def _harness_difference(self, module: str, name: str) -> str:
        parsed = self.slice.module(module)
        binding = None if parsed is None else parsed.binding(name, type_checking=False)
        if binding is not None and binding.kind != "definition":
            return self._reexport_difference(module, name)
        result = fi.compare_definition(self.upstream, self.slice, module, name)
        if name in result.added:
            if self._fork_binds(module, name) is None:
                return f"{_RELEASE} binds it when the module runs: not compared"
            return f"not in {_RELEASE}"
        if not result.differences:
            return "same"
        return _summary(name, result)

    def _reexport_difference(self, module: str, name: str) -> str:
        """A name the slice's module imports: "same" when the release's module
        imports the same definition (whose own differences are listed at
        its module). Where 0.33.0 binds the name only when the module runs
        (``import *``), the fork's objects are compared."""
        ours = self.slice.qualify(module, [name])
        if self.upstream.has_module(f"{module}.{name}"):
            return f"{_RELEASE}'s is its submodule `{name}`"
        parsed = self.upstream.module(module)
        if parsed is not None and parsed.binding(name) is not None:
            theirs = self.upstream.qualify(module, [name])
            if theirs == ours:
                return "same"
            return f"{_RELEASE}'s is `{_short(theirs)}`, the slice's `{_short(ours)}`"
        if self._fork_binds(module, name) is not None:
            return f"not in {_RELEASE}"
        bound = getattr(importlib.import_module(module), name, _MISSING)
        defined, _ = self._import_qualname(ours)
        if bound is not _MISSING and bound is defined:
            return "same"
        return f"{_RELEASE} binds it when the module runs, not to `{_short(ours)}`"

    def harness_table(self) -> str:
        """The Markdown table of :meth:`harness_rows`, a module's names in
        the order the slice defines them: those the same as the release's on one
        line, those 0.33.0 lacks on another, then one line per other name;
        the module cell only on its first line."""
        lines = ["| module | name | difference |", "|---|---|---|"]
        grouped: dict[str, list[tuple[str, str]]] = {}
        for path, name, text in self.harness_rows():
            grouped.setdefault(path, []).append((name, text))
        for path, rows in grouped.items():
            label = f"`{path.removeprefix('vllm/')}`"
            if _module_name(path)[0] in self.changed:
                label += " (changed file)"
            out = []
            for kind, text in (("same", f"same as {_RELEASE}"), (_ABSENT, _ABSENT)):
                names = [n for n, t in rows if t == kind]
                if names:
                    out.append((", ".join(f"`{n}`" for n in names), text))
            out += [(f"`{n}`", t) for n, t in rows if t not in ("same", _ABSENT)]
            for i, (name, text) in enumerate(out):
                text = text.replace("`vllm.", "`")
                lines.append(f"| {label if i == 0 else ''} | {name} | {text} |")
        return "\n".join(lines) + "\n"


_ABSENT = f"not in {_RELEASE}"
_USED_UPSTREAM_ONLY = f"not in the slice: {_RELEASE}'s, the shipped code uses it"
_MISSING = object()


def _dynamic(cls: type) -> bool:
    """Instances of ``cls`` answer unknown attributes (``__getattr__``)."""
    return any("__getattr__" in vars(k) for k in cls.__mro__ if k is not object)


def _env_keys(tree: fi.SourceTree, module: str) -> list[str]:
    """The keys of ``module``'s ``environment_variables`` dict literal."""
    parsed = tree.module(module)
    if parsed is None:
        return []
    for stmt in parsed.tree.body:
        value = getattr(stmt, "value", None)
        names = {
            t.id
            for t in (
                stmt.targets
                if isinstance(stmt, ast.Assign)
                else [getattr(stmt, "target", None)]
            )
            if isinstance(t, ast.Name)
        }
        if "environment_variables" in names and isinstance(value, ast.Dict):
            return [
                k.value
                for k in value.keys
                if isinstance(k, ast.Constant) and isinstance(k.value, str)
            ]
    return []


def _definitions(text: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for stmt in ast.parse(text).body:
        for name in _stmt_names(stmt):
            out.setdefault(name, ast.dump(stmt))
    return out


def _followable(value: Any) -> bool:
    if isinstance(value, (types.ModuleType, type)):
        return True
    return type(value).__module__.startswith("vllm")


def _bind_problem(
    target: Any,
    call: fi.CallShape,
    owner: Any,
    attr: str | None,
    instance: bool,
) -> str | None:
    """Why a call of ``target`` with ``call``'s arguments does not bind
    (None when it does, or when the signature cannot be read)."""
    static = None
    if isinstance(owner, type) and attr is not None:
        static = inspect.getattr_static(owner, attr, None)
    if isinstance(static, property) or isinstance(target, property):
        return None  # calling the property's value
    try:
        sig = inspect.signature(target)
    except (TypeError, ValueError):
        return None
    if instance and isinstance(owner, type) and inspect.isfunction(static):
        params = list(sig.parameters.values())[1:]
        sig = sig.replace(parameters=params)
    params = sig.parameters.values()
    if call.star or call.double_star:
        accepts_kwargs = any(p.kind is p.VAR_KEYWORD for p in params)
        names = {p.name for p in params if p.kind is not p.POSITIONAL_ONLY}
        unknown = [k for k in call.keywords if k not in names]
        if unknown and not accepts_kwargs:
            return f"no parameter {', '.join(unknown)} in {sig}"
        return None
    try:
        sig.bind(*([None] * call.positional), **dict.fromkeys(call.keywords))
    except TypeError as e:
        return (
            f"the call ({call.positional} positional, keywords "
            f"{list(call.keywords)}) does not bind to {sig}: {e}"
        )
    return None


def _summary(name: str, result: fi.Comparison) -> str:
    """One line for a name whose interface differs from the release's: per
    member, its differences (long lists counted); the members the slice
    adds; how many of the release's it lacks."""
    by_member: dict[str, list[str]] = {}
    lacking = 0
    for d in result.differences:
        if d.text.startswith("missing") or "inherits" in d.text:
            lacking += 1
            continue
        member = d.name[len(name) :].lstrip(".")
        by_member.setdefault(member, []).append(d.text)
    parts = []
    for member, texts in by_member.items():
        text = _compress(texts)
        parts.append(f"`{member}`: {text}" if member else text)
    added = [a[len(name) + 1 :] for a in result.added if a.startswith(name + ".")]
    if added:
        parts.append(f"not in {_RELEASE}'s: " + ", ".join(f"`{a}`" for a in added))
    if lacking:
        parts.append(f"lacks {lacking} of {_RELEASE}'s members")
    text = "; ".join(parts)
    for old, new in _HARNESS_WORDS:
        text = text.replace(old, new)
    return text.replace("|", "\\|")


# fork_interfaces' words for the two sides, as the table names them.
_HARNESS_WORDS = (
    (" upstream,", f" in {_RELEASE},"),
    (" upstream ", f" in {_RELEASE} "),
    (" in the branch", " in the slice"),
    ("the branch's class", "the slice's class"),
)


def _short(qualname: str) -> str:
    return qualname.removeprefix("vllm.")


def _names_or_count(names: list[str], what: str) -> str:
    if len(names) <= 3:
        return ", ".join(f"`{n}`" for n in names)
    return f"{len(names)} {what}"


def _compress(texts: list[str]) -> str:
    """A member's differences, dropped parameters and added defaults
    gathered (counted when more than three)."""
    dropped, defaulted, other = [], [], []
    for t in texts:
        if t.startswith("overrides "):
            other.append(t)
        elif t.startswith("drops parameter `"):
            dropped.append(t.split("`")[1])
        elif "has no default upstream" in t:
            defaulted.append(t.split("`")[1])
        elif t.startswith("positional order"):
            other.append("positional order differs")
        else:
            other.append(t)
    out = []
    if dropped:
        out.append("drops " + _names_or_count(dropped, f"of {_RELEASE}'s parameters"))
    if defaulted:
        out.append("gives " + _names_or_count(defaulted, "parameters") + " a default")
    return ", ".join(out + other)
