# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Compare the interfaces of a fork branch's modules with upstream's, from
their source: signatures, class shapes, and the names code takes from other
modules.

Pure functions over source text, like tools/fork_splice.py: a module is
looked up by its dotted name through a callable returning
:class:`fork_splice.ModuleInfo`; nothing here imports the code it reads or
touches a file. ``tests/upstream/test_interfaces.py`` runs them on vLLM
0.33.0's tree, the fork's and this branch's slice;
``tests/tools/test_fork_interfaces.py`` on synthetic pairs.

What "compatible" means for a definition the branch changes::

    upstream                      the branch
    def f(a, b=1, *, c=None)      def f(a, b=1, *, c=None, d=0)  compatible
                                  def f(a, b=2, *, c=None)       default of b
                                  def f(a, x=1, *, c=None)       renames b to x
                                  def f(a, b=1, e=0, *, c=None)  adds positional e
                                  def f(a, *, c=None, d)         drops b; d has no
                                                                 default
    class C(Base):                class C(Base): the same bases; every member
        @staticmethod             upstream's C defines (public ones, and the
        def s(): ...              private ones overriding Base's) with the same
        def m(self, x): ...       kind (static, class, instance method,
        self.attr = ...           property, attribute) and a compatible
                                  signature; upstream's public instance
                                  attributes (its own or inherited); and a
                                  member overriding Base's compatible with
                                  Base's
"""

from __future__ import annotations

import ast
import builtins
from collections.abc import Callable, Collection, Iterator, Sequence
from dataclasses import dataclass, field

try:
    from tools.fork_splice import (
        ModuleInfo,
        _is_type_checking,
        _module_name,
        _needs,
        _stmt_names,
    )
except ImportError:  # tools/ itself on sys.path (tests/upstream)
    from fork_splice import (  # type: ignore[no-redef]
        ModuleInfo,
        _is_type_checking,
        _module_name,
        _needs,
        _stmt_names,
    )

__all__ = [
    "CallShape",
    "ClassShape",
    "CodeUse",
    "Comparison",
    "Difference",
    "ImporterUse",
    "Member",
    "Param",
    "Signature",
    "SourceTree",
    "class_differences",
    "code_uses",
    "compare_definition",
    "describe_definition",
    "importer_uses",
    "public_names",
    "signature_differences",
]

_POSITIONAL = ("positional-only", "positional")
_PROPERTY_DECORATORS = frozenset({"property", "cached_property"})
_DATACLASS_DECORATORS = frozenset({"dataclass"})
_NAMED_TUPLE = frozenset({"typing.NamedTuple", "typing_extensions.NamedTuple"})
# Methods every class has; a branch's class that does not define them is
# not missing anything.
_IMPLICIT_MEMBERS = frozenset(dir(object))
_MAX_DEPTH = 32  # import chains followed before giving up


# ------------------------------------------------------------------ the model


@dataclass(frozen=True)
class Param:
    """One parameter: ``kind`` is "positional-only", "positional",
    "*args", "keyword-only" or "**kwargs"; ``default`` the source text of
    its default (``ast.unparse``), None without one."""

    name: str
    kind: str
    default: str | None = None

    def text(self) -> str:
        prefix = {"*args": "*", "**kwargs": "**"}.get(self.kind, "")
        default = "" if self.default is None else f"={self.default}"
        return f"{prefix}{self.name}{default}"


@dataclass(frozen=True)
class Signature:
    """A callable's parameters and how it is bound: ``kind`` is "function"
    (module level), "method", "staticmethod", "classmethod" or "property"."""

    params: tuple[Param, ...]
    kind: str = "function"

    def text(self) -> str:
        out: list[str] = []
        star = False
        for i, p in enumerate(self.params):
            if p.kind == "keyword-only" and not star:
                out.append("*")
                star = True
            if p.kind == "*args":
                star = True
            out.append(p.text())
            following = self.params[i + 1] if i + 1 < len(self.params) else None
            if p.kind == "positional-only" and (
                following is None or following.kind != "positional-only"
            ):
                out.append("/")
        return "(" + ", ".join(out) + ")"


@dataclass(frozen=True)
class Member:
    """A name a class body binds: ``kind`` is "method", "staticmethod",
    "classmethod", "property", "attribute" or "class"."""

    kind: str
    signature: Signature | None = None


@dataclass(frozen=True)
class ClassShape:
    """What a class statement defines, as its module's source says.

    ``bases``: qualified names (``pkg.mod.Base``; ``abc.ABC`` for names
    from outside the tree). ``members``: its body's bindings.
    ``instance_attributes``: ``self.X`` its methods assign, with the method
    assigning each first. ``fields``: a dataclass's or NamedTuple's own
    fields in order, as ``__init__`` takes them (None for other classes)."""

    qualname: str
    bases: tuple[str, ...]
    members: dict[str, Member]
    instance_attributes: dict[str, str]
    fields: tuple[Param, ...] | None = None


@dataclass(frozen=True)
class Difference:
    """An interface difference of ``name`` (``Class.member`` for members)
    in ``module``."""

    module: str
    name: str
    text: str

    def __str__(self) -> str:
        return f"{self.module}: {self.name}: {self.text}"


@dataclass
class Comparison:
    """What comparing definitions found: ``compared`` the names present on
    both sides (members as ``Class.member``), ``added`` those only the
    branch has, ``differences`` what differs."""

    compared: list[str] = field(default_factory=list)
    added: list[str] = field(default_factory=list)
    differences: list[Difference] = field(default_factory=list)

    def extend(self, other: Comparison) -> None:
        self.compared += other.compared
        self.added += other.added
        self.differences += other.differences


# ------------------------------------------------------------ reading source


def _dotted(node: ast.expr) -> list[str] | None:
    """``a.b.c`` as ["a", "b", "c"]; None for anything else."""
    parts: list[str] = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    parts.append(node.id)
    return parts[::-1]


def _decorator_names(node: ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
    for d in node.decorator_list:
        target = d.func if isinstance(d, ast.Call) else d
        parts = _dotted(target)
        if parts:
            yield parts


def _function_kind(node: ast.FunctionDef | ast.AsyncFunctionDef, in_class: bool):
    """The member kind of a def in a class body (or "function"), None for a
    property's setter/deleter and an ``@overload`` stub."""
    kind = "method" if in_class else "function"
    for parts in _decorator_names(node):
        last = parts[-1]
        if last == "overload":
            return None
        if not in_class:
            continue
        if last in ("setter", "deleter", "getter") and len(parts) > 1:
            return None
        if last == "staticmethod":
            kind = "staticmethod"
        elif last == "classmethod":
            kind = "classmethod"
        elif last in _PROPERTY_DECORATORS:
            kind = "property"
    return kind


def _params(args: ast.arguments) -> tuple[Param, ...]:
    out: list[Param] = []
    positional = [*args.posonlyargs, *args.args]
    defaults = [None] * (len(positional) - len(args.defaults)) + list(args.defaults)
    for i, (a, d) in enumerate(zip(positional, defaults, strict=True)):
        kind = "positional-only" if i < len(args.posonlyargs) else "positional"
        out.append(Param(a.arg, kind, None if d is None else ast.unparse(d)))
    if args.vararg is not None:
        out.append(Param(args.vararg.arg, "*args"))
    for a, d in zip(args.kwonlyargs, args.kw_defaults, strict=True):
        out.append(Param(a.arg, "keyword-only", None if d is None else ast.unparse(d)))
    if args.kwarg is not None:
        out.append(Param(args.kwarg.arg, "**kwargs"))
    return tuple(out)


def _signature(node: ast.FunctionDef | ast.AsyncFunctionDef, kind: str) -> Signature:
    return Signature(_params(node.args), kind)


def _self_name(node: ast.FunctionDef | ast.AsyncFunctionDef, kind: str) -> str | None:
    if kind in ("staticmethod",):
        return None
    positional = [*node.args.posonlyargs, *node.args.args]
    return positional[0].arg if positional else None


def _store_attributes(node: ast.AST, owner: str) -> Iterator[ast.Attribute]:
    for n in ast.walk(node):
        if (
            isinstance(n, ast.Attribute)
            and isinstance(n.ctx, ast.Store)
            and isinstance(n.value, ast.Name)
            and n.value.id == owner
        ):
            yield n


def _is_classvar(annotation: ast.expr) -> bool:
    target = annotation.value if isinstance(annotation, ast.Subscript) else annotation
    parts = _dotted(target)
    return bool(parts) and parts[-1] == "ClassVar"


def _dataclass_kw_only(node: ast.ClassDef) -> bool | None:
    """None: not a dataclass; else whether ``kw_only=True``."""
    for d in node.decorator_list:
        target = d.func if isinstance(d, ast.Call) else d
        parts = _dotted(target)
        if not parts or parts[-1] not in _DATACLASS_DECORATORS:
            continue
        if isinstance(d, ast.Call):
            for kw in d.keywords:
                if kw.arg == "kw_only" and isinstance(kw.value, ast.Constant):
                    return bool(kw.value.value)
        return False
    return None


def _fields(node: ast.ClassDef, kw_only: bool) -> tuple[Param, ...]:
    out: list[Param] = []
    for s in node.body:
        if not (isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)):
            continue
        if _is_classvar(s.annotation):
            continue
        parts = _dotted(s.annotation)
        if parts and parts[-1] == "KW_ONLY":
            kw_only = True
            continue
        default: str | None = None
        this_kw_only = kw_only
        value = s.value
        if isinstance(value, ast.Call) and (_dotted(value.func) or [""])[-1] == "field":
            init = True
            for kw in value.keywords:
                if kw.arg == "default":
                    default = ast.unparse(kw.value)
                elif kw.arg == "default_factory":
                    default = f"<factory {ast.unparse(kw.value)}>"
                elif kw.arg == "init" and isinstance(kw.value, ast.Constant):
                    init = bool(kw.value.value)
                elif kw.arg == "kw_only" and isinstance(kw.value, ast.Constant):
                    this_kw_only = bool(kw.value.value)
            if not init:
                continue
        elif value is not None:
            default = ast.unparse(value)
        kind = "keyword-only" if this_kw_only else "positional"
        out.append(Param(s.target.id, kind, default))
    return tuple(out)


# ------------------------------------------------------------------ the tree


@dataclass
class _Binding:
    kind: str  # "definition", "module", "from"
    stmt: ast.stmt | None = None  # the definition
    module: str = ""  # "module": the module; "from": where it is taken from
    attr: str = ""  # "from": the name taken


class _Parsed:
    """A module's tree and its module-level runtime bindings (the first of
    each name; those only under ``if TYPE_CHECKING:`` when nothing else)."""

    def __init__(self, name: str, info: ModuleInfo) -> None:
        self.name = name
        self.info = info
        self.is_package = info.is_package
        assert info.text is not None
        self.tree = ast.parse(info.text, filename=info.path)
        self.package = name if info.is_package else name.rpartition(".")[0]
        self.bindings: dict[str, _Binding] = {}
        self.type_checking: dict[str, _Binding] = {}
        self.dynamic = False  # a module-level __getattr__ or `import *`
        self._collect(self.tree.body, False)
        self.postponed = any(
            isinstance(s, ast.ImportFrom)
            and s.module == "__future__"
            and any(a.name == "annotations" for a in s.names)
            for s in self.tree.body
        )

    def absolute(self, stmt: ast.ImportFrom) -> str:
        if not stmt.level:
            return stmt.module or ""
        parts = self.package.split(".")
        parts = parts[: len(parts) - (stmt.level - 1)]
        return ".".join([*parts, stmt.module] if stmt.module else parts)

    def _bind(self, name: str, binding: _Binding, tc: bool) -> None:
        table = self.type_checking if tc else self.bindings
        table.setdefault(name, binding)

    def _collect(self, stmts: Sequence[ast.stmt], tc: bool) -> None:
        for s in stmts:
            if isinstance(s, ast.Import):
                for a in s.names:
                    if a.asname:
                        self._bind(a.asname, _Binding("module", module=a.name), tc)
                    else:
                        top = a.name.split(".")[0]
                        self._bind(top, _Binding("module", module=top), tc)
            elif isinstance(s, ast.ImportFrom):
                module = self.absolute(s)
                for a in s.names:
                    if a.name == "*":
                        self.dynamic = True
                        continue
                    b = _Binding("from", module=module, attr=a.name)
                    self._bind(a.asname or a.name, b, tc)
            elif isinstance(s, ast.If):
                self._collect(s.body, tc or _is_type_checking(s.test))
                self._collect(s.orelse, tc)
            elif isinstance(s, ast.Try):
                self._collect(s.body, tc)
                for h in s.handlers:
                    self._collect(h.body, tc)
                self._collect(s.orelse, tc)
                self._collect(s.finalbody, tc)
            else:
                for n in _stmt_names(s):
                    if n == "__getattr__":
                        self.dynamic = True
                    self._bind(n, _Binding("definition", stmt=s), tc)
                if (
                    isinstance(s, ast.AnnAssign)
                    and isinstance(s.target, ast.Name)
                    and s.value is None
                ):
                    # `X: int` alone: an annotation, bound only for checkers.
                    self._bind(s.target.id, _Binding("definition", stmt=s), True)

    def binding(self, name: str, type_checking: bool = True) -> _Binding | None:
        found = self.bindings.get(name)
        if found is None and type_checking:
            found = self.type_checking.get(name)
        return found

    def definition(self, name: str) -> ast.stmt | None:
        b = self.bindings.get(name)
        return b.stmt if b is not None and b.kind == "definition" else None


class SourceTree:
    """A package's modules by dotted name (``lookup`` as in
    :func:`fork_splice.check_imports`), parsed on demand. ``label`` names
    the tree in messages ("upstream", "the branch")."""

    def __init__(
        self, lookup: Callable[[str], ModuleInfo | None], label: str = "the tree"
    ) -> None:
        self._lookup = lookup
        self.label = label
        self._cache: dict[str, _Parsed | None] = {}
        self._exists: dict[str, bool] = {}
        self._shapes: dict[str, ClassShape | None] = {}

    def has_module(self, name: str) -> bool:
        if name not in self._exists:
            self._exists[name] = bool(name) and self._lookup(name) is not None
        return self._exists[name]

    def module(self, name: str) -> _Parsed | None:
        """The parsed module ``name``; None where the tree lacks it or it has
        no source."""
        if name not in self._cache:
            info = self._lookup(name) if name else None
            parsed = None
            if info is not None and info.text is not None:
                parsed = _Parsed(name, info)
            self._cache[name] = parsed
        return self._cache[name]

    # -- names -----------------------------------------------------------
    def qualify(self, module: str, parts: Sequence[str], _depth: int = 0) -> str:
        """The qualified name ``parts`` (``["mk", "Base"]``) means in
        ``module``, following imports and re-exports to where it is
        defined: ``pkg.modular_kernel.Base``; names from outside the tree
        stay as imported (``abc.ABC``), builtins are ``builtins.X``."""
        parts = list(parts)
        mod = self.module(module)
        if mod is None or not parts or _depth > _MAX_DEPTH:
            return ".".join([module, *parts])
        head, rest = parts[0], parts[1:]
        b = mod.binding(head)
        if b is None:
            sub = f"{module}.{head}"
            if self.has_module(sub):
                return self._qualify_module(sub, rest, _depth)
            if head in dir(builtins):
                return ".".join(["builtins", *parts])
            return ".".join([module, *parts])
        if b.kind == "definition":
            return ".".join([module, *parts])
        if b.kind == "module":
            return self._qualify_module(b.module, rest, _depth)
        sub = f"{b.module}.{b.attr}"
        if self.has_module(sub):
            return self._qualify_module(sub, rest, _depth)
        if self.module(b.module) is None:
            return ".".join([b.module, b.attr, *rest])
        return self.qualify(b.module, [b.attr, *rest], _depth + 1)

    def _qualify_module(self, module: str, rest: list[str], depth: int) -> str:
        if not rest:
            return module
        if self.module(module) is None:
            return ".".join([module, *rest])
        return self.qualify(module, rest, depth + 1)

    def split(self, qualname: str) -> tuple[str, list[str]] | None:
        """``pkg.mod.Class.attr`` as ("pkg.mod", ["Class", "attr"]): the
        longest prefix the tree has as a module."""
        parts = qualname.split(".")
        for i in range(len(parts), 0, -1):
            module = ".".join(parts[:i])
            if self.has_module(module):
                return module, parts[i:]
        return None

    def definition(self, module: str, name: str) -> tuple[str, ast.stmt] | None:
        """Where ``module``'s name ``name`` is defined (following imports
        and re-exports): (defining module, its statement); None for a
        module, a name from outside the tree, or one not bound."""
        qualname = self.qualify(module, [name])
        where = self.split(qualname)
        if where is None or len(where[1]) != 1:
            return None
        mod = self.module(where[0])
        if mod is None:
            return None
        stmt = mod.definition(where[1][0])
        return None if stmt is None else (where[0], stmt)

    # -- classes ---------------------------------------------------------
    def class_shape(self, qualname: str) -> ClassShape | None:
        """The class ``qualname`` (``pkg.mod.Class``, or a class nested in
        one: ``pkg.mod.Outer.Inner``); None where it is not a class of the
        tree."""
        if qualname in self._shapes:
            return self._shapes[qualname]
        self._shapes[qualname] = None  # a cycle of bases ends here
        shape = None
        where = self.split(qualname)
        if where is not None and where[1]:
            module, path = where
            mod = self.module(module)
            node = None if mod is None else mod.definition(path[0])
            for name in path[1:]:
                if not isinstance(node, ast.ClassDef):
                    node = None
                    break
                node = next(
                    (
                        s
                        for s in node.body
                        if isinstance(s, ast.ClassDef) and s.name == name
                    ),
                    None,
                )
            if isinstance(node, ast.ClassDef):
                shape = self._shape(module, ".".join(path), node)
            elif (
                # `Name = other.Class`: an alias.
                isinstance(node, ast.Assign)
                and len(path) == 1
                and (parts := _dotted(node.value))
                and (target := self.qualify(module, parts)) != qualname
            ):
                shape = self.class_shape(target)
        self._shapes[qualname] = shape
        return shape

    def _shape(self, module: str, path: str, node: ast.ClassDef) -> ClassShape:
        bases: list[str] = []
        for b in node.bases:
            target = b.value if isinstance(b, ast.Subscript) else b
            parts = _dotted(target)
            bases.append(
                self.qualify(module, parts) if parts else f"<{ast.unparse(b)}>"
            )
        members: dict[str, Member] = {}
        attributes: dict[str, str] = {}
        for s in node.body:
            if isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef)):
                kind = _function_kind(s, True)
                if kind is None:
                    continue
                members.setdefault(s.name, Member(kind, _signature(s, kind)))
                owner = _self_name(s, kind)
                if owner is not None and kind in ("method", "property"):
                    for attr in _store_attributes(s, owner):
                        attributes.setdefault(attr.attr, s.name)
            elif isinstance(s, ast.ClassDef):
                members.setdefault(s.name, Member("class"))
            elif isinstance(s, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
                targets = s.targets if isinstance(s, ast.Assign) else [s.target]
                for t in targets:
                    for n in ast.walk(t):
                        if isinstance(n, ast.Name):
                            members.setdefault(n.id, Member("attribute"))
        kw_only = _dataclass_kw_only(node)
        fields = None
        if kw_only is not None:
            fields = _fields(node, kw_only)
        elif set(bases) & _NAMED_TUPLE:
            fields = _fields(node, False)
        return ClassShape(f"{module}.{path}", tuple(bases), members, attributes, fields)

    def mro(self, shape: ClassShape) -> list[ClassShape]:
        """``shape`` and the classes of the tree it derives from, nearest
        first (depth-first, left to right, each once; classes from outside
        the tree are not followed)."""
        out: list[ClassShape] = []
        seen: set[str] = set()

        def visit(s: ClassShape) -> None:
            if s.qualname in seen:
                return
            seen.add(s.qualname)
            out.append(s)
            for base in s.bases:
                b = self.class_shape(base)
                if b is not None:
                    visit(b)

        visit(shape)
        return out

    def find_member(
        self, shape: ClassShape, name: str, skip_self: bool = False
    ) -> tuple[ClassShape, Member] | None:
        """The first class of ``shape``'s hierarchy whose body binds
        ``name``, and the member."""
        for s in self.mro(shape)[1 if skip_self else 0 :]:
            if name in s.members:
                return s, s.members[name]
            if s.fields and any(p.name == name for p in s.fields):
                return s, Member("attribute")
        return None

    def find_attribute(self, shape: ClassShape, name: str) -> ClassShape | None:
        """The first class of the hierarchy that binds ``name`` in its body
        or assigns ``self.name`` in a method."""
        for s in self.mro(shape):
            if name in s.members or name in s.instance_attributes:
                return s
            if s.fields and any(p.name == name for p in s.fields):
                return s
        return None

    def init_signature(self, shape: ClassShape) -> Signature | None:
        """``__init__`` as the class's hierarchy defines it (a dataclass's or
        NamedTuple's from its fields); None where only classes outside the
        tree define it."""
        for s in self.mro(shape):
            member = s.members.get("__init__")
            if member is not None and member.signature is not None:
                return member.signature
            if s.fields is not None:
                fields: list[Param] = []
                for d in reversed(self.mro(s)):
                    if d.fields is not None:
                        names = {p.name for p in d.fields}
                        fields = [p for p in fields if p.name not in names]
                        fields += d.fields
                positional = [p for p in fields if p.kind == "positional"]
                keyword = [p for p in fields if p.kind == "keyword-only"]
                self_param = Param("self", "positional")
                return Signature((self_param, *positional, *keyword), "method")
        return None


# --------------------------------------------------------------- comparisons


def _a(kind: str) -> str:
    return f"an {kind}" if kind[0] in "aeiou" else f"a {kind}"


def signature_differences(upstream: Signature, branch: Signature) -> list[str]:
    """How ``branch`` differs from ``upstream``, each as a sentence; empty
    when the branch's is compatible: the same positional parameters in the
    same order with the same names, kinds and defaults, upstream's
    keyword-only ones with the same defaults, extra parameters only
    keyword-only with a default, the same ``*args`` / ``**kwargs``, and the
    same kind (a static method stays static)."""
    if upstream.kind != branch.kind:
        return [f"{_a(upstream.kind)} upstream, {_a(branch.kind)} in the branch"]
    out: list[str] = []
    up_pos = [p for p in upstream.params if p.kind in _POSITIONAL]
    br_pos = [p for p in branch.params if p.kind in _POSITIONAL]
    up_named = {p.name: p for p in upstream.params if "*" not in p.kind}
    br_named = {p.name: p for p in branch.params if "*" not in p.kind}
    renamed: dict[str, str] = {}
    for i, (u, b) in enumerate(zip(up_pos, br_pos, strict=False)):
        if u.name != b.name and u.name not in br_named and b.name not in up_named:
            renamed[u.name] = b.name
            out.append(f"renames parameter {i + 1} `{u.name}` to `{b.name}`")
    renamed_to = set(renamed.values())
    for name in up_named:
        if name not in br_named and name not in renamed:
            out.append(f"drops parameter `{name}`")
    for p in br_pos:
        if p.name not in up_named and p.name not in renamed_to:
            out.append(f"adds positional parameter `{p.name}`")
    up_order = [p.name for p in up_pos if p.name in br_named]
    br_order = [p.name for p in br_pos if p.name in up_named]
    if [n for n in up_order if n in br_order] != [n for n in br_order if n in up_order]:
        out.append(
            f"positional order: upstream ({', '.join(up_order)}), branch "
            f"({', '.join(br_order)})"
        )
    for name, u in up_named.items():
        b = br_named.get(renamed.get(name, name))
        if b is None:
            continue
        if u.kind != b.kind:
            out.append(f"`{name}` is {u.kind} upstream, {b.kind} in the branch")
        if u.default != b.default:
            if u.default is None:
                out.append(
                    f"`{name}` has no default upstream, `{b.default}` in the branch"
                )
            elif b.default is None:
                out.append(f"`{name}` loses its default `{u.default}`")
            else:
                out.append(
                    f"default of `{name}`: `{u.default}` upstream, `{b.default}` "
                    "in the branch"
                )
    for p in branch.params:
        if (
            p.kind == "keyword-only"
            and p.name not in up_named
            and p.name not in renamed_to
            and p.default is None
        ):
            out.append(f"adds keyword-only parameter `{p.name}` without a default")
    for kind in ("*args", "**kwargs"):
        up_has = any(p.kind == kind for p in upstream.params)
        br_has = any(p.kind == kind for p in branch.params)
        if up_has and not br_has:
            out.append(f"drops {kind}")
        elif br_has and not up_has:
            out.append(f"adds {kind}")
    return out


def _member_differences(upstream: Member, branch: Member) -> list[str]:
    if upstream.kind != branch.kind:
        return [f"{_a(upstream.kind)} upstream, {_a(branch.kind)} in the branch"]
    if upstream.signature is None or branch.signature is None:
        return []
    if upstream.kind == "property":
        return []
    return signature_differences(upstream.signature, branch.signature)


def _is_interface_member(tree: SourceTree, shape: ClassShape, name: str) -> bool:
    """Public members, dunders, and private members that override a base's
    (hooks the base class calls, such as ``_supports_current_device``)."""
    if not name.startswith("_") or (name.startswith("__") and name.endswith("__")):
        return True
    if name.startswith("__"):
        return False  # name-mangled
    return tree.find_member(shape, name, skip_self=True) is not None


def class_differences(
    up_tree: SourceTree,
    upstream: ClassShape,
    br_tree: SourceTree,
    branch: ClassShape,
    module: str,
) -> Comparison:
    """Compare the branch's class with upstream's (see the module doc):
    bases by qualified name; each member upstream's class defines (public,
    dunder, or overriding a base's) present in the branch's class body with
    the same kind and a compatible signature; upstream's public instance
    attributes present in the branch's hierarchy; each member the branch's
    class defines that upstream's inherits compatible with the inherited
    one. ``module`` labels the differences."""
    name = branch.qualname.rpartition(".")[2]
    out = Comparison()

    def differ(member: str, text: str) -> None:
        out.differences.append(Difference(module, f"{name}{member}", text))

    out.compared.append(name)
    if upstream.bases != branch.bases:
        dropped = [b for b in upstream.bases if b not in branch.bases]
        added = [b for b in branch.bases if b not in upstream.bases]
        parts = [f"drops base `{b}`" for b in dropped]
        parts += [f"adds base `{b}`" for b in added]
        if not parts:
            parts = [
                f"base order: upstream ({', '.join(upstream.bases)}), branch "
                f"({', '.join(branch.bases)})"
            ]
        for p in parts:
            differ("", p)
    up_init = up_tree.init_signature(upstream)
    br_init = br_tree.init_signature(branch)
    if "__init__" not in upstream.members and up_init is not None:
        # A dataclass's or an inherited __init__: what callers construct with.
        out.compared.append(f"{name}.__init__")
        if br_init is None:
            differ(".__init__", "the branch's class has no __init__ of its tree")
        else:
            for d in signature_differences(up_init, br_init):
                differ(".__init__", d)
    for member, up_member in upstream.members.items():
        if not _is_interface_member(up_tree, upstream, member):
            continue
        br_member = branch.members.get(member)
        if br_member is None and any(p.name == member for p in branch.fields or ()):
            br_member = Member("attribute")
        if br_member is None:
            inherited = br_tree.find_member(branch, member, skip_self=True)
            if inherited is not None:
                where = inherited[0].qualname
                differ(
                    f".{member}",
                    f"not defined by the branch's class (it inherits `{where}`'s)",
                )
            elif member not in _IMPLICIT_MEMBERS:
                differ(f".{member}", f"missing (upstream: {up_member.kind})")
            continue
        out.compared.append(f"{name}.{member}")
        for d in _member_differences(up_member, br_member):
            differ(f".{member}", d)
    for attr, method in upstream.instance_attributes.items():
        if attr.startswith("_") or attr in upstream.members:
            continue
        out.compared.append(f"{name}.{attr}")
        if br_tree.find_attribute(branch, attr) is None:
            differ(
                f".{attr}",
                f"missing instance attribute (upstream's `{method}` sets it)",
            )
    for member, br_member in branch.members.items():
        if member in upstream.members:
            continue
        inherited = up_tree.find_member(upstream, member, skip_self=True)
        if inherited is None:
            out.added.append(f"{name}.{member}")
            continue
        base, base_member = inherited
        out.compared.append(f"{name}.{member}")
        for d in _member_differences(base_member, br_member):
            differ(f".{member}", f"overrides `{base.qualname}`'s: {d}")
    return out


def describe_definition(stmt: ast.stmt) -> str:
    """The kind of a module-level definition: "function", "class" or
    "assignment"."""
    if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return "function"
    if isinstance(stmt, ast.ClassDef):
        return "class"
    return "assignment"


def compare_definition(
    up_tree: SourceTree,
    br_tree: SourceTree,
    module: str,
    name: str,
    must_exist: bool = False,
) -> Comparison:
    """Compare module ``module``'s top-level ``name`` in the branch's tree
    with upstream's (each followed through imports to where it is
    defined): a function's signature, a class by :func:`class_differences`,
    an assignment by its kind only. A name upstream lacks is ``added``
    (a difference when ``must_exist``, as for a stand-in)."""
    out = Comparison()
    br = br_tree.definition(module, name)
    if br is None:
        out.differences.append(
            Difference(module, name, f"{br_tree.label} does not define it")
        )
        return out
    up = up_tree.definition(module, name)
    if up is None:
        bound = up_tree.module(module)
        if bound is not None and bound.binding(name, type_checking=False):
            # Bound upstream but not to a definition of the tree (a value
            # imported from outside, a module): present, not comparable.
            out.compared.append(name)
        elif must_exist:
            out.differences.append(
                Difference(module, name, f"{up_tree.label} does not define it")
            )
        else:
            out.added.append(name)
        return out
    (up_module, up_stmt), (br_module, br_stmt) = up, br
    up_kind, br_kind = describe_definition(up_stmt), describe_definition(br_stmt)
    if up_kind != br_kind:
        out.differences.append(
            Difference(
                module, name, f"{_a(up_kind)} upstream, {_a(br_kind)} in the branch"
            )
        )
        return out
    if isinstance(up_stmt, ast.ClassDef):
        up_shape = up_tree.class_shape(f"{up_module}.{up_stmt.name}")
        br_shape = br_tree.class_shape(f"{br_module}.{br_stmt.name}")
        assert up_shape is not None and br_shape is not None
        result = class_differences(up_tree, up_shape, br_tree, br_shape, module)
        result.compared = [name if c == up_stmt.name else c for c in result.compared]
        return result
    out.compared.append(name)
    if isinstance(up_stmt, (ast.FunctionDef, ast.AsyncFunctionDef)):
        assert isinstance(br_stmt, (ast.FunctionDef, ast.AsyncFunctionDef))
        for d in signature_differences(
            _signature(up_stmt, "function"), _signature(br_stmt, "function")
        ):
            out.differences.append(Difference(module, name, d))
    return out


def public_names(tree: SourceTree, module: str) -> list[str]:
    """The public names ``module`` defines: its top-level definitions not
    starting with ``_`` and the names its ``__all__`` lists, in order."""
    mod = tree.module(module)
    if mod is None:
        return []
    names: list[str] = []
    for stmt in mod.tree.body:
        if isinstance(stmt, ast.If) and _is_type_checking(stmt.test):
            continue
        for n in _stmt_names(stmt):
            if n == "__all__" or n.startswith("_") or n in names:
                continue
            names.append(n)
    for stmt in mod.tree.body:
        if "__all__" in _stmt_names(stmt) and isinstance(
            stmt.value, (ast.List, ast.Tuple)
        ):
            for e in stmt.value.elts:
                if (
                    isinstance(e, ast.Constant)
                    and isinstance(e.value, str)
                    and e.value not in names
                ):
                    names.append(e.value)
    return names


# ---------------------------------------------------------------------- uses


@dataclass(frozen=True)
class CallShape:
    """How a call passes its arguments: ``positional`` plain positional
    arguments, ``keywords`` the names, ``star`` / ``double_star`` whether it
    unpacks ``*xs`` / ``**kw`` too."""

    positional: int
    keywords: tuple[str, ...]
    star: bool = False
    double_star: bool = False


def _call_shape(call: ast.Call) -> CallShape:
    positional = sum(1 for a in call.args if not isinstance(a, ast.Starred))
    keywords = tuple(k.arg for k in call.keywords if k.arg is not None)
    return CallShape(
        positional,
        keywords,
        star=any(isinstance(a, ast.Starred) for a in call.args),
        double_star=any(k.arg is None for k in call.keywords),
    )


@dataclass(frozen=True)
class ImporterUse:
    """A name a file takes from ``module``: ``from module import name``,
    ``alias.name`` on a module import, or ``getattr(alias, "name")``;
    ``call``: how the file calls it there (None: the use is not a call)."""

    module: str
    name: str
    path: str
    line: int
    call: CallShape | None = None


def importer_uses(path: str, text: str, modules: Collection[str]) -> list[ImporterUse]:
    """Every name the file at ``path`` (a tree path, ``pkg/sub/mod.py``)
    takes from one of ``modules`` (dotted names), anywhere in the file
    (lazy imports inside functions included), and each call of such a name
    (``name(...)`` after a from-import, ``alias.name(...)``)."""
    here, is_package = _module_name(path)
    package = here if is_package else here.rpartition(".")[0]
    tree = ast.parse(text, filename=path)
    targets = set(modules)
    aliases: dict[str, str] = {}  # a name bound to a target module
    imported: dict[str, tuple[str, str]] = {}  # a name from-imported from one
    dotted: set[str] = set()  # `import a.b.c`: chains starting `a.b.c.`
    out: list[ImporterUse] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.asname and a.name in targets:
                    aliases[a.asname] = a.name
                elif not a.asname:
                    dotted.add(a.name)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                parts = parts[: len(parts) - (node.level - 1)]
                module = ".".join([*parts, node.module] if node.module else parts)
            else:
                module = node.module or ""
            for a in node.names:
                if f"{module}.{a.name}" in targets:
                    aliases[a.asname or a.name] = f"{module}.{a.name}"
                elif module in targets and a.name != "*":
                    imported[a.asname or a.name] = (module, a.name)
                    out.append(ImporterUse(module, a.name, path, node.lineno))

    def target_of(node: ast.expr) -> tuple[str, str] | None:
        if isinstance(node, ast.Name) and node.id in imported:
            return imported[node.id]
        if not isinstance(node, ast.Attribute):
            return None
        parts = _dotted(node.value)
        if not parts:
            return None
        if len(parts) == 1 and parts[0] in aliases:
            return aliases[parts[0]], node.attr
        chain = ".".join(parts)
        if (
            len(parts) > 1
            and chain in targets
            and any(d == chain or d.startswith(chain + ".") for d in dotted)
        ):
            return chain, node.attr
        return None

    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load):
            found = target_of(node)
            if found is not None:
                out.append(ImporterUse(*found, path, node.lineno))
        elif isinstance(node, ast.Call):
            found = target_of(node.func)
            if found is not None:
                shape = _call_shape(node)
                out.append(ImporterUse(*found, path, node.lineno, shape))
            if (
                isinstance(node.func, ast.Name)
                and node.func.id in ("getattr", "hasattr")
                and len(node.args) >= 2
                and isinstance(node.args[0], ast.Name)
                and node.args[0].id in aliases
                and isinstance(node.args[1], ast.Constant)
                and isinstance(node.args[1].value, str)
            ):
                module = aliases[node.args[0].id]
                out.append(ImporterUse(module, node.args[1].value, path, node.lineno))
    return sorted(set(out), key=lambda u: (u.line, u.module, u.name, u.call is None))


@dataclass(frozen=True)
class CodeUse:
    """A name a definition's code takes from elsewhere, and how.

    ``root``/``origin`` say what the chain starts from:

    * a module-level name: ``origin`` ("module", dotted module) for a module
      import, ("from", module, name) for a from-import, ("local", name) for
      a definition of the same module;
    * ``self`` / ``cls`` in a method, or ``super()``: ("class", class name);
    * a parameter annotated with a class: ("annotation", the annotation's
      dotted text, as the module resolves it).

    ``attrs``: the attribute chain read from it (may be empty), ``call``:
    how the chain's end is called (None when it is not), ``definition``: the
    top-level definition holding the use, ``line``: its line."""

    definition: str
    root: str
    origin: tuple[str, ...]
    attrs: tuple[str, ...]
    call: CallShape | None
    line: int


def _chains(node: ast.AST) -> Iterator[tuple[ast.expr, list[str], ast.Call | None]]:
    """Maximal attribute chains in ``node``: (root expression, attrs, the
    call of the whole chain or None). ``getattr(x, "name"[, default])``
    counts as ``x.name``."""
    calls: dict[int, ast.Call] = {}
    for n in ast.walk(node):
        if isinstance(n, ast.Call):
            calls[id(n.func)] = n
    inner: set[int] = set()
    for n in ast.walk(node):
        if isinstance(n, ast.Attribute):
            inner.add(id(n.value))
    for n in ast.walk(node):
        if isinstance(n, (ast.Attribute, ast.Name)) and id(n) not in inner:
            if isinstance(n, ast.Name) and not isinstance(n.ctx, ast.Load):
                continue
            if isinstance(n, ast.Attribute) and not isinstance(n.ctx, ast.Load):
                continue
            attrs: list[str] = []
            cur: ast.expr = n
            while isinstance(cur, ast.Attribute):
                attrs.append(cur.attr)
                cur = cur.value
            yield cur, attrs[::-1], calls.get(id(n))
        elif (
            isinstance(n, ast.Call)
            and isinstance(n.func, ast.Name)
            and n.func.id in ("getattr", "hasattr")
            and len(n.args) >= 2
            and isinstance(n.args[1], ast.Constant)
            and isinstance(n.args[1].value, str)
            and isinstance(n.args[0], (ast.Name, ast.Attribute))
        ):
            attrs = []
            cur = n.args[0]
            while isinstance(cur, ast.Attribute):
                attrs.append(cur.attr)
                cur = cur.value
            yield cur, [*attrs[::-1], n.args[1].value], None


def _annotation_target(annotation: ast.expr | None) -> list[str] | None:
    """The one class an annotation names (``X``, ``X | None``,
    ``Optional[X]``, ``"X"``), as dotted parts; None otherwise."""
    if annotation is None:
        return None
    if isinstance(annotation, ast.Constant) and isinstance(annotation.value, str):
        try:
            annotation = ast.parse(annotation.value, mode="eval").body
        except SyntaxError:
            return None
    if isinstance(annotation, ast.BinOp) and isinstance(annotation.op, ast.BitOr):
        sides = [annotation.left, annotation.right]
        sides = [
            s for s in sides if not (isinstance(s, ast.Constant) and s.value is None)
        ]
        return _annotation_target(sides[0]) if len(sides) == 1 else None
    if isinstance(annotation, ast.Subscript):
        parts = _dotted(annotation.value)
        if parts and parts[-1] == "Optional":
            return _annotation_target(annotation.slice)
        return None
    return _dotted(annotation)


def _functions(node: ast.AST) -> Iterator[ast.FunctionDef | ast.AsyncFunctionDef]:
    for n in ast.walk(node):
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield n


def _own_nodes(function: ast.AST) -> Iterator[ast.AST]:
    """The nodes of a function's body, nested functions and classes not
    entered (their parameters are theirs)."""
    stack = list(ast.iter_child_nodes(function))
    while stack:
        n = stack.pop()
        yield n
        if not isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            stack.extend(ast.iter_child_nodes(n))


def code_uses(
    path: str, text: str, definitions: Collection[str] | None = None
) -> list[CodeUse]:
    """What the top-level ``definitions`` of the module at ``path`` (all
    of the module, its imports included, when None) take from elsewhere:
    each attribute chain rooted at a module-level name they use (the
    module's own definitions among them), at ``self`` / ``cls`` or
    ``super()`` in a method, or at a parameter annotated with one class,
    with how the chain's end is called. Names the code binds itself are
    not uses. For the whole module, every ``from``-import is a use too."""
    here, is_package = _module_name(path)
    parsed = _Parsed(here, ModuleInfo(path, text, is_package))
    wanted = None if definitions is None else set(definitions)
    out: list[CodeUse] = []

    def origin_of(name: str) -> tuple[str, ...] | None:
        b = parsed.binding(name)
        if b is None:
            return None
        if b.kind == "module":
            return ("module", b.module)
        if b.kind == "from":
            return ("from", b.module, b.attr)
        return ("local", name)

    def add(defn, root, origin, attrs, call, line) -> None:
        shape = None if call is None else _call_shape(call)
        out.append(CodeUse(defn, root, origin, tuple(attrs), shape, line))

    for stmt in parsed.tree.body:
        names = _stmt_names(stmt)
        if isinstance(stmt, (ast.Import, ast.ImportFrom)) or (
            isinstance(stmt, (ast.If, ast.Try)) and not names
        ):
            if wanted is not None:
                continue
            for n in ast.walk(stmt):
                if isinstance(n, ast.ImportFrom):
                    module = parsed.absolute(n)
                    for a in n.names:
                        if a.name != "*":
                            origin = ("from", module, a.name)
                            bound = a.asname or a.name
                            add("<imports>", bound, origin, [], None, n.lineno)
            continue
        if not names or (wanted is not None and not set(names) & wanted):
            continue
        defn = names[0]
        free = set(_needs(stmt, parsed.postponed))
        # Imports inside the definition (lazy imports) bind local roots.
        local_imports: dict[str, tuple[str, ...]] = {}
        for n in ast.walk(stmt):
            if isinstance(n, ast.ImportFrom):
                module = parsed.absolute(n)
                for a in n.names:
                    if a.name == "*":
                        continue
                    origin = ("from", module, a.name)
                    local_imports[a.asname or a.name] = origin
                    add(defn, a.asname or a.name, origin, [], None, n.lineno)
            elif isinstance(n, ast.Import):
                for a in n.names:
                    bound = a.asname or a.name.split(".")[0]
                    module = a.name if a.asname else bound
                    local_imports[bound] = ("module", module)
        class_methods: dict[int, tuple[str, str]] = {}  # chain root -> (cls, self)
        if isinstance(stmt, ast.ClassDef):
            for s in stmt.body:
                if not isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    continue
                kind = _function_kind(s, True) or "method"
                owner = _self_name(s, kind)
                for n in _own_nodes(s):
                    if owner is not None and isinstance(n, ast.Name) and n.id == owner:
                        class_methods[id(n)] = (stmt.name, owner)
        annotated: dict[int, tuple[str, list[str]]] = {}
        for f in _functions(stmt):
            args = f.args
            params = [*args.posonlyargs, *args.args, *args.kwonlyargs]
            reassigned = {
                n.id
                for n in _own_nodes(f)
                if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)
            }
            by_name = {}
            for a in params:
                target = _annotation_target(a.annotation)
                if target and a.arg not in reassigned:
                    by_name[a.arg] = target
            if not by_name:
                continue
            for n in _own_nodes(f):
                if isinstance(n, ast.Name) and n.id in by_name:
                    annotated[id(n)] = (n.id, by_name[n.id])
        for root, attrs, call in _chains(stmt):
            line = getattr(root, "lineno", stmt.lineno)
            if isinstance(root, ast.Name):
                if id(root) in class_methods:
                    cls_name, owner = class_methods[id(root)]
                    if attrs:
                        add(defn, owner, ("class", cls_name), attrs, call, line)
                    continue
                if id(root) in annotated:
                    param, target = annotated[id(root)]
                    if attrs:
                        origin = ("annotation", ".".join(target))
                        add(defn, param, origin, attrs, call, line)
                    continue
                if root.id in local_imports:
                    add(defn, root.id, local_imports[root.id], attrs, call, line)
                    continue
                if root.id not in free:
                    continue
                origin = origin_of(root.id)
                if origin is None:
                    continue
                add(defn, root.id, origin, attrs, call, line)
            elif (
                isinstance(root, ast.Call)
                and isinstance(root.func, ast.Name)
                and root.func.id == "super"
                and isinstance(stmt, ast.ClassDef)
                and attrs
            ):
                add(defn, "super", ("class", stmt.name), attrs, call, line)
    return out
