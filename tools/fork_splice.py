# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Splice a fork branch's top-level Python definitions into upstream's files.

Pure functions over source text: nothing here reads or writes a file. Each
function takes upstream's text and the branch's text of one module and returns
the spliced text with a :class:`FileReport`, or raises :class:`SpliceError`
naming the file and the definition.

What a splice does to upstream's file (everything else stays byte-for-byte)::

    upstream's file                      the branch's file
    -----------------                    -----------------
    docstring, imports                   imports
    + imports the spliced code needs  <- (only the names it uses)
    if TYPE_CHECKING: ...
    + TYPE_CHECKING imports / env annotations
    __all__ = [...]  + spliced names  <- when the branch's __all__ lists them
    def kept(): ...
    def spliced(): <upstream's span>  <- def spliced(): <the branch's span>
    environment_variables = {
        ...,
        + "VLLM_NEW": ...,            <- entries named in the manifest
    }
    + def added(): ...                <- definitions upstream lacks (at the
                                         end, or before the first statement
                                         that needs them when it runs)

A name a spliced definition uses must resolve in upstream's module the same
way it resolves in the branch's: to another spliced definition, a builtin, an
identical binding, or the same import. Annotations count as run-time uses
unless upstream's file has ``from __future__ import annotations`` (then they
are only for type checkers); names inside string annotations never count.
"""

import ast
import builtins
import copy
import re
import symtable
from collections.abc import Callable, Collection, Iterable, Iterator, Sequence
from dataclasses import dataclass, field

__all__ = [
    "DefinitionChange",
    "FileReport",
    "ModuleInfo",
    "SpliceError",
    "check_compiles",
    "check_imports",
    "check_new",
    "check_replacement",
    "env_variable_names",
    "set_version",
    "splice_definitions",
    "splice_envs",
    "top_level_names",
]

# Names every module has without binding them.
_IMPLICIT = frozenset(dir(builtins)) | {
    "__builtins__",
    "__file__",
    "__name__",
    "__doc__",
    "__loader__",
    "__package__",
    "__path__",
    "__spec__",
    "__annotations__",
    "__cached__",
}
# Scopes that run when the scope holding them runs (not when called later).
_RUN_WITH_PARENT = frozenset({"listcomp", "setcomp", "dictcomp", "genexpr"})
_LINE = re.compile(r"[^\n]*\n|[^\n]+\Z")
_LINE_LENGTH = 88  # ruff's line length, as upstream vLLM formats
# Handlers that make an import optional (its module need not exist).
_IMPORT_ERRORS = frozenset(
    {"ImportError", "ModuleNotFoundError", "Exception", "BaseException"}
)


class SpliceError(ValueError):
    """A file cannot be spliced; the message names the file and the definition."""


@dataclass
class DefinitionChange:
    """One spliced definition: ``action`` is "replaced", "added" or "unchanged"
    (the branch's is identical to upstream's, whose text is kept);
    ``lines_before`` is 0 for an added one."""

    name: str
    action: str
    lines_before: int
    lines_after: int


@dataclass
class FileReport:
    """What splicing did to one file (``to_json`` gives the report's entry)."""

    path: str
    mode: str
    lines_before: int
    lines_after: int = 0
    definitions: list[DefinitionChange] = field(default_factory=list)
    imports_added: list[str] = field(default_factory=list)
    all_added: list[str] = field(default_factory=list)
    variables_added: list[str] = field(default_factory=list)
    variables_present: list[str] = field(default_factory=list)
    annotations_added: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    # Names bound by the imports added: the statements check_imports looks at.
    imported_names: list[str] = field(default_factory=list, repr=False)

    def to_json(self) -> dict[str, object]:
        out: dict[str, object] = {
            "path": self.path,
            "mode": self.mode,
            "lines_before": self.lines_before,
            "lines_after": self.lines_after,
        }
        if self.definitions:
            out["definitions"] = [vars(d) for d in self.definitions]
        for key in (
            "imports_added",
            "all_added",
            "variables_added",
            "variables_present",
            "annotations_added",
            "warnings",
        ):
            if getattr(self, key):
                out[key] = list(getattr(self, key))
        return out


@dataclass(frozen=True)
class ModuleInfo:
    """A module of the built tree, as :func:`check_imports` looks it up.

    ``text`` is None for a module without Python source (a compiled
    extension), whose names are not checked.
    """

    path: str
    text: str | None
    is_package: bool


# ---------------------------------------------------------------- source text


def _chars(line: str, col: int) -> int:
    """ast's column (UTF-8 bytes) as an index into ``line``."""
    if line.isascii():
        return col
    return len(line.encode("utf-8")[:col].decode("utf-8", errors="ignore"))


class _Source:
    """A module's text, its tree, and line/offset arithmetic."""

    def __init__(self, path: str, text: str, owner: str) -> None:
        self.path = path
        self.text = text
        self.owner = owner
        try:
            self.tree = ast.parse(text, filename=path)
        except SyntaxError as exc:
            raise SpliceError(
                f"{owner} {path} does not parse: line {exc.lineno}: {exc.msg}"
            ) from None
        self.lines = _LINE.findall(text)
        self.starts = [0]
        for line in self.lines:
            self.starts.append(self.starts[-1] + len(line))

    def offset(self, lineno: int, col: int) -> int:
        return self.starts[lineno - 1] + _chars(self.lines[lineno - 1], col)

    def line_start(self, lineno: int) -> int:
        return self.starts[lineno - 1]

    def line_end(self, lineno: int) -> int:
        return self.starts[lineno]

    def span(self, first: int, last: int) -> str:
        """Lines ``first..last`` (1-based, inclusive), ending with a newline."""
        text = self.text[self.starts[first - 1] : self.starts[last]]
        return text if text.endswith("\n") else text + "\n"

    def comments_above(self, first: int, floor: int) -> int:
        """First line of the comment lines directly above line ``first``
        (below line ``floor``); ``first`` when there are none."""
        line = first
        while line - 1 > floor and self.lines[line - 2].lstrip().startswith("#"):
            line -= 1
        return line


def _first_line(stmt: ast.stmt) -> int:
    decorators = getattr(stmt, "decorator_list", [])
    return min([stmt.lineno, *(d.lineno for d in decorators)])


def _stmt_names(stmt: ast.stmt) -> list[str]:
    """Names a top-level statement binds, if it is a definition."""
    if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return [stmt.name]
    if isinstance(stmt, ast.Assign):
        return [n for t in stmt.targets for n in _target_names(t)]
    if isinstance(stmt, ast.AnnAssign) and stmt.value is not None:
        return _target_names(stmt.target)
    return []


def _target_names(target: ast.expr) -> list[str]:
    if isinstance(target, ast.Name):
        return [target.id]
    if isinstance(target, (ast.Tuple, ast.List)):
        return [n for e in target.elts for n in _target_names(e)]
    if isinstance(target, ast.Starred):
        return _target_names(target.value)
    return []


def _kind(stmt: ast.stmt) -> str:
    if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return "def"
    if isinstance(stmt, ast.ClassDef):
        return "class"
    return "assign"


def _is_type_checking(test: ast.expr) -> bool:
    if isinstance(test, ast.Name):
        return test.id == "TYPE_CHECKING"
    return (
        isinstance(test, ast.Attribute)
        and test.attr == "TYPE_CHECKING"
        and isinstance(test.value, ast.Name)
        and test.value.id == "typing"
    )


def _dump(node: ast.AST) -> str:
    return ast.dump(node, include_attributes=False)


def _apply(text: str, edits: list[tuple[int, int, int, str]]) -> str:
    out: list[str] = []
    pos = 0
    for start, end, _, new in sorted(edits):
        if start < pos:
            raise SpliceError("internal error: two edits of the same text overlap")
        out.append(text[pos:start])
        out.append(new)
        pos = end
    out.append(text[pos:])
    return "".join(out)


# ------------------------------------------------------------------ bindings


@dataclass(frozen=True)
class _Binding:
    """How a module binds a name at its top level."""

    kind: str  # "def", "class", "assign" or "import"
    # Imports: ("from", level, module, name) or ("import", module).
    origin: tuple[object, ...] | None
    type_checking: bool  # only under `if TYPE_CHECKING:`
    stmt: ast.stmt  # the binding statement itself
    top: ast.stmt  # the module-level statement holding it

    def describe(self) -> str:
        if self.origin is None:
            verb = "defines" if self.kind in ("def", "class") else "assigns"
            return f"{verb} it (line {self.stmt.lineno})"
        where = " under `if TYPE_CHECKING:`" if self.type_checking else ""
        if self.origin[0] == "from":
            module = "." * self.origin[1] + self.origin[2]
            return f"imports it from {module}{where} (line {self.stmt.lineno})"
        return f"imports it as module {self.origin[1]}{where} (line {self.stmt.lineno})"


class _Module:
    """A parsed module and its top-level bindings."""

    def __init__(self, src: _Source) -> None:
        self.src = src
        self.bindings: dict[str, list[_Binding]] = {}
        self.star = False
        self._collect(src.tree.body, False, None)
        self.postponed = any(
            isinstance(s, ast.ImportFrom)
            and s.module == "__future__"
            and any(a.name == "annotations" for a in s.names)
            for s in src.tree.body
        )

    def _add(self, name: str, binding: _Binding) -> None:
        self.bindings.setdefault(name, []).append(binding)

    def _collect(
        self, stmts: Sequence[ast.stmt], tc: bool, top: ast.stmt | None
    ) -> None:
        for s in stmts:
            t = top or s
            if isinstance(s, ast.Import):
                for a in s.names:
                    bound = a.asname or a.name.split(".")[0]
                    module = a.name if a.asname else bound
                    self._add(bound, _Binding("import", ("import", module), tc, s, t))
            elif isinstance(s, ast.ImportFrom):
                for a in s.names:
                    if a.name == "*":
                        self.star = True
                        continue
                    origin = ("from", s.level, s.module or "", a.name)
                    self._add(a.asname or a.name, _Binding("import", origin, tc, s, t))
            elif isinstance(s, ast.If):
                self._collect(s.body, tc or _is_type_checking(s.test), t)
                self._collect(s.orelse, tc, t)
            elif isinstance(s, (ast.Try, getattr(ast, "TryStar", ast.Try))):
                self._collect(s.body, tc, t)
                for h in s.handlers:
                    self._collect(h.body, tc, t)
                self._collect(s.orelse, tc, t)
                self._collect(s.finalbody, tc, t)
            elif isinstance(s, (ast.For, ast.AsyncFor, ast.While)):
                if not isinstance(s, ast.While):
                    for n in _target_names(s.target):
                        self._add(n, _Binding("assign", None, tc, s, t))
                self._collect(s.body, tc, t)
                self._collect(s.orelse, tc, t)
            elif isinstance(s, (ast.With, ast.AsyncWith)):
                for item in s.items:
                    if item.optional_vars is not None:
                        for n in _target_names(item.optional_vars):
                            self._add(n, _Binding("assign", None, tc, s, t))
                self._collect(s.body, tc, t)
            elif isinstance(s, ast.AugAssign):
                for n in _target_names(s.target):
                    self._add(n, _Binding("assign", None, tc, s, t))
            else:
                for n in _stmt_names(s):
                    self._add(n, _Binding(_kind(s), None, tc, s, t))

    def runtime(self, name: str) -> list[_Binding]:
        return [b for b in self.bindings.get(name, []) if not b.type_checking]

    def definitions_of(self, name: str) -> list[ast.stmt]:
        """Module-level definition statements that bind ``name``."""
        return [s for s in self.src.tree.body if name in _stmt_names(s)]

    def type_checking_block(self) -> ast.If | None:
        for s in self.src.tree.body:
            if isinstance(s, ast.If) and _is_type_checking(s.test):
                return s
        return None

    def dict_literal(self, name: str) -> tuple[ast.stmt, ast.Dict] | None:
        for s in self.src.tree.body:
            if name in _stmt_names(s) and isinstance(s.value, ast.Dict):
                return s, s.value
        return None


# --------------------------------------------------------------------- needs


@dataclass
class _Need:
    runtime: bool = False  # evaluated when the code runs, not only by type checkers
    def_time: bool = False  # evaluated when the module-level statement runs


def _all_args(args: ast.arguments) -> list[ast.arg]:
    out = [*args.posonlyargs, *args.args, *args.kwonlyargs]
    out += [a for a in (args.vararg, args.kwarg) if a is not None]
    return out


def _take_annotations(
    stmts: Sequence[ast.stmt],
    run: str,
    in_function: bool,
    out: list[tuple[ast.expr, str]],
) -> None:
    """Move every annotation out of ``stmts`` into ``out`` with when it is
    evaluated: "def" (when the module-level statement runs), "call" (when a
    function holding it runs) or "never"."""
    for s in stmts:
        if isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for a in _all_args(s.args):
                if a.annotation is not None:
                    out.append((a.annotation, run))
                    a.annotation = None
            if s.returns is not None:
                out.append((s.returns, run))
                s.returns = None
            _take_annotations(s.body, "call", True, out)
        elif isinstance(s, ast.ClassDef):
            _take_annotations(s.body, run, False, out)
        elif isinstance(s, ast.AnnAssign):
            # A function's local annotations are never evaluated.
            out.append((s.annotation, "never" if in_function else run))
            s.annotation = ast.Constant(value=None)
        else:
            for name in ("body", "orelse", "finalbody"):
                _take_annotations(getattr(s, name, []), run, in_function, out)
            for h in getattr(s, "handlers", []):
                _take_annotations(h.body, run, in_function, out)
            for case in getattr(s, "cases", []):
                _take_annotations(case.body, run, in_function, out)


def _bound_inside(stmt: ast.stmt) -> set[str]:
    """Names bound anywhere inside ``stmt`` (its own name excluded)."""
    out: set[str] = set()
    for node in ast.walk(stmt):
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            out.add(node.id)
        elif isinstance(node, ast.arg):
            out.add(node.arg)
        elif node is not stmt and isinstance(
            node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
        ):
            out.add(node.name)
        elif isinstance(node, ast.alias):
            out.add(node.asname or node.name.split(".")[0])
    return out


def _needs(stmt: ast.stmt, postponed: bool) -> dict[str, _Need]:
    """Module-level names ``stmt`` uses and when (see :class:`_Need`).

    Scoping is CPython's own (``symtable``) on a copy of the statement
    without annotations; annotations are added by where they are evaluated.
    """
    node = copy.deepcopy(stmt)
    annotations: list[tuple[ast.expr, str]] = []
    _take_annotations([node], "def", False, annotations)
    out: dict[str, _Need] = {}

    def add(name: str, runtime: bool, def_time: bool) -> None:
        need = out.setdefault(name, _Need())
        need.runtime |= runtime
        need.def_time |= def_time

    module = ast.Module(body=[node], type_ignores=[])
    table = symtable.symtable(ast.unparse(module), "<definition>", "exec")

    def visit(t: symtable.SymbolTable, def_time: bool, top: bool) -> None:
        for sym in t.get_symbols():
            if not sym.is_referenced():
                continue
            if top:
                if sym.is_assigned() or sym.is_imported():
                    continue
            elif not sym.is_global():
                continue
            add(sym.get_name(), True, def_time)
        for child in t.get_children():
            inherit = child.get_type() == "class" or child.get_name() in (
                _RUN_WITH_PARENT
            )
            visit(child, def_time and inherit, False)

    visit(table, True, True)
    local = _bound_inside(stmt)
    for expr, when in annotations:
        if postponed:
            when = "never"
        for name in {n.id for n in ast.walk(expr) if isinstance(n, ast.Name)}:
            if name not in local:
                add(name, when != "never", when == "def")
    for name in _stmt_names(stmt):
        out.pop(name, None)
    return out


# -------------------------------------------------------------------- splicer


def _import_text(
    stmt: ast.stmt, names: Collection[str], indent: str, wrap: bool = True
) -> list[str]:
    """The branch's import ``stmt`` cut down to the aliases binding ``names``,
    one statement per string, wrapped as ruff formats it (unless not ``wrap``)."""
    if isinstance(stmt, ast.Import):
        return [
            f"{indent}import {a.name}" + (f" as {a.asname}" if a.asname else "") + "\n"
            for a in stmt.names
            if (a.asname or a.name.split(".")[0]) in names
        ]
    assert isinstance(stmt, ast.ImportFrom)
    module = "." * stmt.level + (stmt.module or "")
    parts = [
        a.name + (f" as {a.asname}" if a.asname else "")
        for a in stmt.names
        if (a.asname or a.name) in names
    ]
    one = f"{indent}from {module} import {', '.join(parts)}"
    if not wrap or len(one) <= _LINE_LENGTH:
        return [one + "\n"]
    inner = "".join(f"{indent}    {p},\n" for p in parts)
    return [f"{indent}from {module} import (\n{inner}{indent})\n"]


def _indent(text: str, old: str, new: str) -> str:
    if old == new:
        return text
    return "".join(
        new + line[len(old) :] if line.startswith(old) else line
        for line in text.splitlines(keepends=True)
    )


def _all_literal(mod: _Module) -> tuple[ast.stmt, list[ast.Constant]] | None:
    """Upstream's ``__all__`` list/tuple literal and its elements."""
    for s in mod.src.tree.body:
        if "__all__" not in _stmt_names(s):
            continue
        value = s.value
        if isinstance(value, (ast.List, ast.Tuple)) and all(
            isinstance(e, ast.Constant) and isinstance(e.value, str) for e in value.elts
        ):
            return s, value.elts
        raise SpliceError(
            f"{mod.src.owner} {mod.src.path} has an __all__ (line {s.lineno}) "
            "that is not a list or tuple literal of strings: cannot add names to it"
        )
    return None


def _all_names(mod: _Module) -> list[str] | None:
    try:
        found = _all_literal(mod)
    except SpliceError:
        return None
    return None if found is None else [e.value for e in found[1]]


class _Splicer:
    """Accumulates edits of upstream's text; :meth:`finish` applies them."""

    def __init__(
        self,
        path: str,
        upstream: str,
        branch: str,
        mode: str,
        stand_ins: Sequence[str] = (),
    ) -> None:
        self.path = path
        self.stand_ins = frozenset(stand_ins)
        self.up = _Module(_Source(path, upstream, "upstream's"))
        self.br = _Module(_Source(path, branch, "the branch's"))
        self.report = FileReport(path, mode, lines_before=len(self.up.src.lines))
        self.edits: list[tuple[int, int, int, str]] = []
        self.spliced: dict[str, ast.stmt] = {}  # name -> the branch's statement
        self.added: list[ast.stmt] = []  # the branch's statements upstream lacks
        # Added name -> the first upstream line whose statement needs it when
        # the module runs it: the definition goes before that line.
        self.anchors: dict[str, int] = {}
        self.wanted: dict[int, tuple[ast.stmt, set[str], bool]] = {}
        self.all_pending: list[str] = []
        self.checked: list[tuple[str, ast.stmt]] = []  # (user, statement) to order

    def _edit(self, start: int, end: int, text: str) -> None:
        self.edits.append((start, end, len(self.edits), text))

    # -- definitions

    def _branch_definition(self, name: str) -> ast.stmt:
        found = self.br.definitions_of(name)
        if not found:
            raise SpliceError(
                f"{name} is not a top-level definition (def, class or NAME = ...) "
                f"in the branch's {self.path}"
            )
        if len(found) > 1:
            lines = ", ".join(str(s.lineno) for s in found)
            raise SpliceError(
                f"{name} is defined {len(found)} times in the branch's {self.path} "
                f"(lines {lines}): cannot tell which to splice"
            )
        stmt = found[0]
        if _stmt_names(stmt) != [name]:
            raise SpliceError(
                f"the branch's {self.path} binds {name} together with other names "
                f"(line {stmt.lineno}): splice a statement that binds only {name}"
            )
        return stmt

    def _upstream_definition(self, name: str) -> ast.stmt | None:
        found = self.up.definitions_of(name)
        if len(found) == 1 and _stmt_names(found[0]) == [name]:
            return found[0]
        if len(found) > 1:
            raise SpliceError(
                f"{name} is defined {len(found)} times in upstream's {self.path}: "
                "cannot tell which to replace"
            )
        if found:
            raise SpliceError(
                f"upstream's {self.path} binds {name} together with other names "
                f"(line {found[0].lineno}): cannot replace it alone"
            )
        other = self.up.bindings.get(name)
        if other:
            raise SpliceError(
                f"upstream's {self.path} {other[0].describe()} rather than as a "
                f"top-level definition: cannot splice {name} into it"
            )
        return None

    def definitions(self, names: Sequence[str]) -> None:
        for name in names:
            if name == "__all__":
                raise SpliceError(
                    f"{self.path}: __all__ is merged (spliced names are added to "
                    "upstream's), not spliced: remove it from the definitions"
                )
            self.spliced[name] = self._branch_definition(name)
        added: set[str] = set()
        replaced: list[tuple[str, ast.stmt, ast.stmt]] = []
        for name, stmt in self.spliced.items():
            target = self._upstream_definition(name)
            if target is None:
                self.added.append(stmt)
                added.add(name)
            else:
                replaced.append((name, stmt, target))
        for name, stmt in self.spliced.items():
            for used, need in _needs(stmt, self.up.postponed).items():
                self._resolve(used, need, name)
            self._merge_all(name)
        src, up = self.br.src, self.up.src
        for name, stmt, target in replaced:
            before = target.end_lineno - _first_line(target) + 1
            after = stmt.end_lineno - _first_line(stmt) + 1
            if _dump(stmt) == _dump(target):
                self.report.definitions.append(
                    DefinitionChange(name, "unchanged", before, before)
                )
                continue
            self._check_own_lines(self.up, target, name)
            self._check_own_lines(self.br, stmt, name)
            first = _first_line(target)
            self._edit(
                up.line_start(first),
                up.line_end(target.end_lineno),
                src.span(_first_line(stmt), stmt.end_lineno),
            )
            self.checked.append((name, stmt))
            self.report.definitions.append(
                DefinitionChange(name, "replaced", before, after)
            )
            self._anchor(stmt, added, up.comments_above(first, self._floor(target)))
        for stmt in self.added:
            self._check_own_lines(self.br, stmt, _stmt_names(stmt)[0])
            text = self._added_text(stmt)
            self.checked.append((_stmt_names(stmt)[0], stmt))
            self.report.definitions.append(
                DefinitionChange(_stmt_names(stmt)[0], "added", 0, text.count("\n"))
            )

    def _floor(self, stmt: ast.stmt) -> int:
        """The last line of the statement before ``stmt`` in upstream's body."""
        body = self.up.src.tree.body
        i = body.index(stmt)
        return body[i - 1].end_lineno if i else 0

    def _check_own_lines(self, mod: _Module, stmt: ast.stmt, name: str) -> None:
        body = mod.src.tree.body
        i = body.index(stmt)
        before = body[i - 1].end_lineno if i else 0
        after = body[i + 1].lineno if i + 1 < len(body) else None
        if before >= _first_line(stmt) or (
            after is not None and after <= stmt.end_lineno
        ):
            raise SpliceError(
                f"{name} shares a line with another statement in {mod.src.owner} "
                f"{self.path} (line {stmt.lineno}): put it on lines of its own"
            )

    def _added_text(self, stmt: ast.stmt) -> str:
        src = self.br.src
        body = src.tree.body
        i = body.index(stmt)
        floor = body[i - 1].end_lineno if i else 0
        first = src.comments_above(_first_line(stmt), floor)
        return src.span(first, stmt.end_lineno)

    # -- names

    def _resolve(self, name: str, need: _Need, user: str) -> None:
        if name in self.spliced:
            return
        if name in self.stand_ins:
            if not self.up.bindings.get(name):
                raise SpliceError(
                    f"{self.path}: {name} used by {user} is a stand-in in the "
                    f"manifest, but upstream's {self.path} does not bind it"
                )
            return
        up = self.up.bindings.get(name, [])
        br = self.br.bindings.get(name, [])
        br_imports = [b for b in br if b.kind == "import"]
        where = f"{self.path}: {name} used by {user}"
        if br_imports:
            if up:
                same = {b.origin for b in br_imports} & {
                    b.origin for b in up if b.kind == "import"
                }
                if not same or any(b.kind != "import" for b in up):
                    raise SpliceError(
                        f"{where}: the branch {br_imports[0].describe()} but "
                        f"upstream {up[0].describe()}: import it from the same "
                        "module or rename it"
                    )
                if need.runtime and not self.up.runtime(name):
                    runtime = [b for b in br_imports if not b.type_checking]
                    if not runtime:
                        raise self._postponed(name, user)
                    self._want(runtime[0], name)
                return
            runtime = [b for b in br_imports if not b.type_checking]
            if runtime:
                self._want(runtime[0], name)
            elif need.runtime:
                raise self._postponed(name, user)
            else:
                self._want(br_imports[0], name)
            return
        if name in _IMPLICIT and not br:
            if up:
                raise SpliceError(
                    f"{where} is the builtin in the branch, but upstream "
                    f"{up[0].describe()}"
                )
            return
        if up:
            if need.runtime and not self.up.runtime(name):
                raise SpliceError(
                    f"{where} is bound only under `if TYPE_CHECKING:` in upstream's "
                    f"{self.path} (line {up[0].stmt.lineno}) but is needed at run "
                    "time: quote the annotation in the branch"
                )
            if br and {_dump(b.stmt) for b in br} != {_dump(b.stmt) for b in up}:
                if any(b.kind == "import" for b in up):
                    raise SpliceError(
                        f"{where}: the branch {br[0].describe()} but upstream "
                        f"{up[0].describe()}: add {name} to the manifest's "
                        "definitions or import it in the branch"
                    )
                raise SpliceError(
                    f"{where} differs between the branch (line {br[0].stmt.lineno}) "
                    f"and upstream (line {up[0].stmt.lineno}): add {name} to the "
                    "manifest's definitions"
                )
            return
        raise SpliceError(
            f"{name} used by {user} is not defined in upstream's {self.path}: "
            "add it to the manifest or import it"
        )

    def _postponed(self, name: str, user: str) -> SpliceError:
        return SpliceError(
            f"{self.path}: {name} used by {user} is imported only under `if "
            f"TYPE_CHECKING:` in the branch, but upstream's {self.path} evaluates "
            "it at run time (no `from __future__ import annotations` there): quote "
            "the annotation or import it at run time in the branch"
        )

    def _want(self, binding: _Binding, name: str) -> None:
        key = id(binding.stmt)
        stmt, names, _ = self.wanted.setdefault(
            key, (binding.stmt, set(), binding.type_checking)
        )
        names.add(name)

    def _merge_all(self, name: str) -> None:
        branch_all = _all_names(self.br)
        if not branch_all or name not in branch_all:
            return
        found = _all_literal(self.up)
        if found is None:
            return
        if name not in [e.value for e in found[1]] and name not in self.all_pending:
            self.all_pending.append(name)

    # -- environment variables

    def env_variables(self, variables: Sequence[str]) -> None:
        b_dict = self._env_dict(self.br)
        u_stmt, u_dict = self._env_dict(self.up)
        b_keys = _dict_keys(b_dict[1])
        u_keys = _dict_keys(u_dict)
        b_block = self.br.type_checking_block()
        u_block = self.up.type_checking_block()
        added_names = {_stmt_names(s)[0] for s in self.added}
        entries: list[str] = []
        annotations: list[str] = []
        for var in variables:
            if var not in b_keys:
                raise SpliceError(
                    f"{var} is not an entry of the branch's {self.path} "
                    "environment_variables dict"
                )
            value = b_dict[1].values[b_keys[var]]
            if var in u_keys:
                u_value = u_dict.values[u_keys[var]]
                if _dump(u_value) != _dump(value):
                    raise SpliceError(
                        f"upstream's {self.path} already defines {var} (line "
                        f"{u_value.lineno}) with a different value than the branch's "
                        f"(line {value.lineno})"
                    )
                self.report.variables_present.append(var)
            else:
                stmt = ast.Expr(value=value)
                needs = _needs(stmt, self.up.postponed)
                for used, need in needs.items():
                    self._resolve(used, need, var)
                first = self.up.src.comments_above(
                    _first_line(u_stmt), self._floor(u_stmt)
                )
                self._anchor(stmt, added_names, first)
                entries.append(self._entry_text(b_dict[1], b_keys[var], u_dict))
                self.report.variables_added.append(var)
            annotation = self._annotation(var, b_block, u_block)
            if annotation is not None:
                annotations.append(annotation)
        if entries:
            self._insert_entries(u_dict, entries)
            self.checked.append(("environment_variables", u_stmt))
        if annotations:
            assert u_block is not None
            self._edit(
                self.up.src.line_end(u_block.body[-1].end_lineno),
                self.up.src.line_end(u_block.body[-1].end_lineno),
                "".join(annotations),
            )

    def _env_dict(self, mod: _Module) -> tuple[ast.stmt, ast.Dict]:
        found = mod.dict_literal("environment_variables")
        if found is None:
            raise SpliceError(
                f"{mod.src.owner} {self.path} has no module-level "
                "`environment_variables = {...}` dict literal"
            )
        return found

    def _entry_text(self, d: ast.Dict, i: int, target: ast.Dict) -> str:
        src = self.br.src
        key, value = d.keys[i], d.values[i]
        assert key is not None
        first, last = key.lineno, value.end_lineno
        head = src.lines[first - 1][: _chars(src.lines[first - 1], key.col_offset)]
        tail = src.lines[last - 1][_chars(src.lines[last - 1], value.end_col_offset) :]
        rest = tail.strip()
        comma = rest.startswith(",")
        rest = rest[1:].strip() if comma else rest
        if head.strip() or (rest and not rest.startswith("#")):
            raise SpliceError(
                f"the branch's {self.path} entry {key.value!r} (line {first}) "
                "shares a line with something else: put it on lines of its own"
            )
        floor = d.values[i - 1].end_lineno if i else d.lineno
        text = src.span(src.comments_above(first, floor), last)
        if not comma:
            end = src.offset(last, value.end_col_offset) - src.line_start(
                src.comments_above(first, floor)
            )
            text = text[:end] + "," + text[end:]
        indent = head
        if target.keys and target.keys[0] is not None:
            line = self.up.src.lines[target.keys[0].lineno - 1]
            new = line[: _chars(line, target.keys[0].col_offset)]
        else:
            new = indent
        return _indent(text, indent, new)

    def _insert_entries(self, d: ast.Dict, entries: list[str]) -> None:
        up = self.up.src
        close_line = d.end_lineno
        close = up.offset(close_line, d.end_col_offset) - 1
        if up.text[up.line_start(close_line) : close].strip():
            raise SpliceError(
                f"upstream's {self.path} environment_variables dict does not end "
                "with `}` on a line of its own: cannot add entries"
            )
        if d.values:
            last = d.values[-1]
            end = up.offset(last.end_lineno, last.end_col_offset)
            between = "".join(
                line.split("#", 1)[0] for line in up.text[end:close].splitlines()
            )
            if not between.strip().startswith(","):
                self._edit(end, end, ",")
        start = up.line_start(close_line)
        self._edit(start, start, "".join(entries))

    def _annotation(
        self, var: str, b_block: ast.If | None, u_block: ast.If | None
    ) -> str | None:
        b_ann = _annotation_of(b_block, var)
        if b_ann is None:
            self.report.warnings.append(
                f"{var} has no annotation in the branch's `if TYPE_CHECKING:` "
                f"block of {self.path}: none added"
            )
            return None
        u_ann = _annotation_of(u_block, var)
        if u_ann is not None:
            if _dump(u_ann) != _dump(b_ann):
                raise SpliceError(
                    f"upstream's {self.path} already annotates {var} (line "
                    f"{u_ann.lineno}) differently from the branch (line "
                    f"{b_ann.lineno})"
                )
            return None
        if u_block is None:
            raise SpliceError(
                f"upstream's {self.path} has no `if TYPE_CHECKING:` block to "
                f"annotate {var} in"
            )
        src = self.br.src
        text = src.span(b_ann.lineno, b_ann.end_lineno)
        old = src.lines[b_ann.lineno - 1][
            : _chars(src.lines[b_ann.lineno - 1], b_ann.col_offset)
        ]
        line = self.up.src.lines[u_block.body[0].lineno - 1]
        new = line[: _chars(line, u_block.body[0].col_offset)]
        self.report.annotations_added.append(var)
        return _indent(text, old, new)

    def _anchor(self, stmt: ast.stmt, added: Collection[str], line: int) -> None:
        """Added definitions ``stmt`` needs when it runs go before ``line``,
        and so (transitively) do the added definitions those need."""
        for name, need in _needs(stmt, self.up.postponed).items():
            if (
                name in added
                and need.def_time
                and line < self.anchors.get(name, line + 1)
            ):
                self.anchors[name] = line
                self._anchor(self.spliced[name], added, line)

    # -- finishing

    def _place_added(self) -> None:
        if not self.added:
            return
        up = self.up.src
        body = up.tree.body
        end_anchor = None
        if len(body) > 1 and _is_main_block(body[-1]):
            end_anchor = up.comments_above(_first_line(body[-1]), body[-2].end_lineno)
        groups: dict[int | None, list[str]] = {}
        for stmt in self.added:
            anchor = self.anchors.get(_stmt_names(stmt)[0], end_anchor)
            groups.setdefault(anchor, []).append(self._added_text(stmt))
        for anchor, texts in groups.items():
            if anchor is not None:
                start = up.line_start(anchor)
                self._edit(start, start, "".join(t + "\n\n" for t in texts))
            elif not body:
                self._edit(len(up.text), len(up.text), "\n\n".join(texts))
            else:
                end = up.line_end(body[-1].end_lineno)
                prefix = "" if up.text[:end].endswith("\n") else "\n"
                self._edit(end, end, prefix + "".join("\n\n" + t for t in texts))

    def _place_imports(self) -> None:
        up = self.up.src
        block = self.up.type_checking_block()
        tc = [w for w in self.wanted.values() if w[2]]
        if tc and block is None and not self.up.runtime("TYPE_CHECKING"):
            self._resolve(
                "TYPE_CHECKING",
                _Need(True, True),
                "the `if TYPE_CHECKING:` block added for the branch's imports",
            )
        ordered = sorted(self.wanted.values(), key=lambda w: w[0].lineno)
        runtime = [t for s, n, c in ordered if not c for t in _import_text(s, n, "")]
        typing_only = [w for w in ordered if w[2]]
        for stmt, names, is_tc in ordered:
            suffix = " (under TYPE_CHECKING)" if is_tc else ""
            for text in _import_text(stmt, names, "", wrap=False):
                self.report.imports_added.append(text.strip() + suffix)
            self.report.imported_names.extend(sorted(names))
        body = up.tree.body
        imports = [s for s in body if isinstance(s, (ast.Import, ast.ImportFrom))]
        if imports:
            at, lead = up.line_end(imports[-1].end_lineno), ""
        elif body and _is_docstring(body[0]):
            at, lead = up.line_end(body[0].end_lineno), "\n"
        elif body:
            at, lead = up.line_start(_first_line(body[0])), ""
        else:
            at, lead = len(up.text), ""
        text = lead + "".join(runtime) if runtime else ""
        if typing_only and block is None:
            inner = "".join(
                t for s, n, _ in typing_only for t in _import_text(s, n, "    ")
            )
            text += "\nif TYPE_CHECKING:\n" + inner
        if text:
            if not imports and body and not _is_docstring(body[0]):
                text += "\n"
            self._edit(at, at, text)
        if typing_only and block is not None:
            line = up.lines[block.body[0].lineno - 1]
            indent = line[: _chars(line, block.body[0].col_offset)]
            inner = "".join(
                t for s, n, _ in typing_only for t in _import_text(s, n, indent)
            )
            end = up.line_end(block.body[-1].end_lineno)
            self._edit(end, end, inner)

    def _place_all(self) -> None:
        if not self.all_pending:
            return
        found = _all_literal(self.up)
        assert found is not None
        stmt, elts = found
        up = self.up.src
        value = stmt.value
        quote = '"'
        if elts:
            quote = up.text[up.offset(elts[0].lineno, elts[0].col_offset)]
            quote = quote if quote in "'\"" else '"'
        items = [f"{quote}{n}{quote}" for n in self.all_pending]
        close = up.offset(value.end_lineno, value.end_col_offset) - 1
        close_line = value.end_lineno
        own_line = not up.text[up.line_start(close_line) : close].strip()
        if elts and own_line and value.lineno != close_line:
            last = elts[-1]
            end = up.offset(last.end_lineno, last.end_col_offset)
            between = "".join(
                line.split("#", 1)[0] for line in up.text[end:close].splitlines()
            )
            if not between.strip().startswith(","):
                self._edit(end, end, ",")
            line = up.lines[last.lineno - 1]
            indent = line[: _chars(line, last.col_offset)]
            start = up.line_start(close_line)
            self._edit(start, start, "".join(f"{indent}{i},\n" for i in items))
        elif elts:
            last = elts[-1]
            end = up.offset(last.end_lineno, last.end_col_offset)
            self._edit(end, end, "".join(f", {i}" for i in items))
        else:
            start = up.offset(value.lineno, value.col_offset) + 1
            self._edit(start, start, ", ".join(items) + ",")
        self.report.all_added.extend(self.all_pending)

    def finish(self) -> tuple[str, FileReport]:
        # Imports first: an insertion at the same offset as an added
        # definition's must come before it.
        self._place_imports()
        self._place_added()
        self._place_all()
        text = _apply(self.up.src.text, self.edits)
        check_compiles(self.path, text)
        self._check_order(text)
        self.report.lines_after = len(_LINE.findall(text))
        return text, self.report

    def _check_order(self, text: str) -> None:
        """Every name a spliced statement needs when the module runs it is
        bound by an earlier module-level statement of the result."""
        result = _Module(_Source(self.path, text, "the spliced"))
        first_bound: dict[str, int] = {}
        for name, bindings in result.bindings.items():
            lines = [_first_line(b.top) for b in bindings if not b.type_checking]
            if lines:
                first_bound[name] = min(lines)
        for user, branch_stmt in self.checked:
            if user == "environment_variables":
                stmts = result.definitions_of(user)
            else:
                stmts = [
                    s
                    for s in result.definitions_of(user)
                    if _dump(s) == _dump(branch_stmt)
                ]
            for stmt in stmts[:1]:
                first = _first_line(stmt)
                for name, need in _needs(stmt, result.postponed).items():
                    if not need.def_time:
                        continue
                    bound = first_bound.get(name)
                    if bound is None and name in _IMPLICIT:
                        continue
                    if bound is None or bound >= first:
                        raise SpliceError(
                            f"{self.path}: {name} is needed when {user} is defined "
                            f"(line {first} of the spliced file) but is not bound "
                            "before it: define it earlier in the branch's file or "
                            "splice it too"
                        )


def _is_docstring(stmt: ast.stmt) -> bool:
    return (
        isinstance(stmt, ast.Expr)
        and isinstance(stmt.value, ast.Constant)
        and isinstance(stmt.value.value, str)
    )


def _is_main_block(stmt: ast.stmt) -> bool:
    test = getattr(stmt, "test", None)
    return (
        isinstance(stmt, ast.If)
        and isinstance(test, ast.Compare)
        and isinstance(test.left, ast.Name)
        and test.left.id == "__name__"
    )


def _dict_keys(d: ast.Dict) -> dict[str, int]:
    out: dict[str, int] = {}
    for i, key in enumerate(d.keys):
        if isinstance(key, ast.Constant) and isinstance(key.value, str):
            out.setdefault(key.value, i)
    return out


def _annotation_of(block: ast.If | None, var: str) -> ast.AnnAssign | None:
    if block is None:
        return None
    for s in block.body:
        if (
            isinstance(s, ast.AnnAssign)
            and isinstance(s.target, ast.Name)
            and s.target.id == var
        ):
            return s
    return None


# ------------------------------------------------------------------ public API


def splice_definitions(
    path: str,
    upstream: str,
    branch: str,
    definitions: Sequence[str],
    stand_ins: Sequence[str] = (),
) -> tuple[str, FileReport]:
    """Put the branch's top-level ``definitions`` into upstream's module.

    Each replaces upstream's definition of the same name (its whole span,
    decorators included) or, when upstream lacks it, is added with the
    comment lines directly above it in the branch. ``stand_ins``: names the
    branch's file binds only in place of upstream's own (upstream's binding,
    a definition or an import, is what the spliced definitions then use; it
    must exist). Returns the new text of upstream's file and the report.
    Raises :class:`SpliceError`.
    """
    splicer = _Splicer(path, upstream, branch, "splice", stand_ins)
    splicer.definitions(definitions)
    return splicer.finish()


def splice_envs(
    path: str,
    upstream: str,
    branch: str,
    variables: Sequence[str],
    definitions: Sequence[str] = (),
    stand_ins: Sequence[str] = (),
) -> tuple[str, FileReport]:
    """Add the branch's ``environment_variables`` entries for ``variables``
    to upstream's dict literal (before its closing brace) and their
    annotations from the branch's ``if TYPE_CHECKING:`` block to upstream's
    (at its end); ``definitions`` (helpers the entries call) are spliced as
    by :func:`splice_definitions`. An entry upstream already has must be
    identical; ``stand_ins`` as for :func:`splice_definitions`. Raises
    :class:`SpliceError`."""
    splicer = _Splicer(path, upstream, branch, "envs", stand_ins)
    splicer.definitions(definitions)
    splicer.env_variables(variables)
    return splicer.finish()


def check_replacement(path: str, upstream: str, branch: str) -> FileReport:
    """Check that the branch's file can replace upstream's whole: it binds
    every public name upstream's defines (imports aside) or lists in
    ``__all__``. Raises :class:`SpliceError`."""
    up = _Module(_Source(path, upstream, "upstream's"))
    br = _Module(_Source(path, branch, "the branch's"))
    public = {
        name
        for name, bindings in up.bindings.items()
        if not name.startswith("_")
        and any(b.kind != "import" and not b.type_checking for b in bindings)
    }
    public |= set(_all_names(up) or [])
    missing = sorted(public - set(br.bindings))
    if missing:
        raise SpliceError(
            f"the branch's {path} is not a drop-in replacement for upstream's: it "
            f"does not define {', '.join(missing)}"
        )
    check_compiles(path, branch)
    return FileReport(path, "replace", len(up.src.lines), lines_after=len(br.src.lines))


def check_new(path: str, branch: str) -> FileReport:
    """Check a module the branch adds (it must compile)."""
    check_compiles(path, branch)
    return FileReport(path, "new", 0, lines_after=len(_LINE.findall(branch)))


def check_compiles(path: str, text: str) -> None:
    """Compile ``text`` as the module at ``path`` (without this module's
    ``__future__`` flags). Raises :class:`SpliceError`."""
    try:
        compile(text, path, "exec", dont_inherit=True)
    except SyntaxError as exc:
        raise SpliceError(
            f"the spliced {path} does not compile: line {exc.lineno}: {exc.msg}"
        ) from None


def top_level_names(path: str, text: str) -> dict[str, str]:
    """The module-level definitions of a file: name -> "def", "class" or
    "assign" (what the manifest's ``definitions`` may name)."""
    src = _Source(path, text, "the branch's")
    out: dict[str, str] = {}
    for stmt in src.tree.body:
        for name in _stmt_names(stmt):
            out.setdefault(name, _kind(stmt))
    return out


def env_variable_names(path: str, text: str) -> list[str]:
    """The keys of a file's ``environment_variables`` dict literal."""
    mod = _Module(_Source(path, text, "the branch's"))
    found = mod.dict_literal("environment_variables")
    return [] if found is None else list(_dict_keys(found[1]))


def set_version(path: str, text: str, version: str) -> tuple[str, int]:
    """Set the string of every module-level ``__version__`` / ``version``
    assignment (``__version__ = version = '0.33.0'``) to ``version``,
    keeping its quotes. Returns the text and how many strings changed."""
    src = _Source(path, text, "upstream's")
    edits: list[tuple[int, int, int, str]] = []
    for stmt in src.tree.body:
        if not isinstance(stmt, ast.Assign):
            continue
        names = {n for t in stmt.targets for n in _target_names(t)}
        value = stmt.value
        if names & {"__version__", "version"} and (
            isinstance(value, ast.Constant) and isinstance(value.value, str)
        ):
            start = src.offset(value.lineno, value.col_offset)
            end = src.offset(value.end_lineno, value.end_col_offset)
            quote = src.text[end - 1]
            edits.append((start, end, len(edits), f"{quote}{version}{quote}"))
    return _apply(text, edits), len(edits)


# -------------------------------------------------------------- import checks


def _module_name(path: str) -> tuple[str, bool]:
    parts = path[: -len(".py")].split("/")
    if parts[-1] == "__init__":
        return ".".join(parts[:-1]), True
    return ".".join(parts), False


def _guarded(tree: ast.Module) -> Iterator[tuple[ast.stmt, bool, bool]]:
    """Every import in ``tree`` with (inside a try that catches its
    ImportError, under `if TYPE_CHECKING:`)."""

    def catches(handler: ast.ExceptHandler) -> bool:
        if handler.type is None:
            return True
        names = {n.id for n in ast.walk(handler.type) if isinstance(n, ast.Name)}
        return bool(names & _IMPORT_ERRORS)

    def walk(
        node: ast.AST, guarded: bool, tc: bool
    ) -> Iterator[tuple[ast.stmt, bool, bool]]:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node, guarded, tc
            return
        if isinstance(node, ast.Try) and any(catches(h) for h in node.handlers):
            for s in node.body:
                yield from walk(s, True, tc)
            for h in node.handlers:
                yield from walk(h, guarded, tc)
            for s in node.orelse + node.finalbody:
                yield from walk(s, guarded, tc)
            return
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for s in node.body:
                yield from walk(s, guarded, True)
            for s in node.orelse:
                yield from walk(s, guarded, tc)
            return
        for child in ast.iter_child_nodes(node):
            yield from walk(child, guarded, tc)

    yield from walk(tree, False, False)


def check_imports(
    path: str,
    text: str,
    lookup: Callable[[str], ModuleInfo | None],
    package: str,
    names: Iterable[str] | None = None,
) -> None:
    """Check the imports of ``package``'s modules in a file of the built tree.

    Every ``import package.x`` / ``from package.x import y`` must name a
    module ``lookup`` finds, each ``y`` must be a submodule or bound at that
    module's top level, and each ``alias.attr`` on such a module alias must
    be bound there too (for a module with ``__getattr__``: one of its
    ``environment_variables`` keys, as ``vllm.envs``). ``names`` limits the
    check to the module-level statements binding those names (the spliced
    definitions and added imports); None checks the whole file. Raises
    :class:`SpliceError`.
    """
    src = _Source(path, text, "the built")
    here, is_package = _module_name(path)
    base = here if is_package else here.rpartition(".")[0]
    wanted = None if names is None else set(names)
    scope = [
        s
        for s in src.tree.body
        if wanted is None or wanted & set(_stmt_names(s) + _import_names(s))
    ]
    cache: dict[str, tuple[ModuleInfo | None, _Module | None]] = {}

    def module(name: str) -> tuple[ModuleInfo | None, _Module | None]:
        if name not in cache:
            info = lookup(name)
            parsed = None
            if info is not None and info.text is not None:
                parsed = _Module(_Source(info.path, info.text, "the built"))
            cache[name] = (info, parsed)
        return cache[name]

    def absolute(stmt: ast.ImportFrom) -> str:
        if not stmt.level:
            return stmt.module or ""
        parts = base.split(".")
        parts = parts[: len(parts) - (stmt.level - 1)]
        return ".".join([*parts, stmt.module] if stmt.module else parts)

    def defines(mod: _Module, name: str, runtime: bool) -> bool | None:
        """Whether ``mod`` binds ``name`` (None: cannot tell)."""
        if mod.runtime(name) if runtime else mod.bindings.get(name):
            return True
        if "__getattr__" in mod.bindings:
            # vllm.envs' idiom: __getattr__ serves environment_variables' keys.
            env = mod.dict_literal("environment_variables")
            return None if env is None else name in _dict_keys(env[1])
        return None if mod.star else False

    aliases: dict[str, str] = {}  # name -> module of `package` it is bound to
    in_scope = {id(n) for s in scope for n in ast.walk(s)}
    for stmt, guarded, tc in _guarded(src.tree):
        checked = id(stmt) in in_scope and not guarded
        if isinstance(stmt, ast.Import):
            for a in stmt.names:
                if a.name.split(".")[0] != package:
                    continue
                if checked and module(a.name)[0] is None:
                    raise SpliceError(
                        f"{path}: line {stmt.lineno}: `import {a.name}` names a module "
                        f"the built wheel does not have: add it to the manifest"
                    )
                if a.asname:
                    aliases[a.asname] = a.name
            continue
        assert isinstance(stmt, ast.ImportFrom)
        name = absolute(stmt)
        if name.split(".")[0] != package:
            continue
        info, parsed = module(name)
        if info is None:
            if checked:
                raise SpliceError(
                    f"{path}: line {stmt.lineno}: imports from {name}, a module the "
                    'built wheel does not have: add it to the manifest (mode "new")'
                )
            continue
        for a in stmt.names:
            if a.name == "*":
                continue
            if module(f"{name}.{a.name}")[0] is not None:
                aliases[a.asname or a.name] = f"{name}.{a.name}"
                continue
            if (
                checked
                and parsed is not None
                and defines(parsed, a.name, not tc) is False
            ):
                raise SpliceError(
                    f"{path}: line {stmt.lineno}: imports {a.name} from {name}, "
                    f"which the built {info.path} does not define: add it to the "
                    "manifest"
                )
    for stmt in scope:
        for node in ast.walk(stmt):
            if not (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id in aliases
                and isinstance(node.ctx, ast.Load)
            ):
                continue
            target = aliases[node.value.id]
            info, parsed = module(target)
            if parsed is None or module(f"{target}.{node.attr}")[0] is not None:
                continue
            if defines(parsed, node.attr, True) is False:
                hint = (
                    ' (mode "envs")'
                    if parsed.dict_literal("environment_variables")
                    else ""
                )
                raise SpliceError(
                    f"{path}: line {node.lineno}: {node.value.id}.{node.attr} is not "
                    f"defined by the built {info.path}: add it to the "
                    f"manifest{hint}"
                )


def _import_names(stmt: ast.stmt) -> list[str]:
    if isinstance(stmt, ast.Import):
        return [a.asname or a.name.split(".")[0] for a in stmt.names]
    if isinstance(stmt, ast.ImportFrom):
        return [a.asname or a.name for a in stmt.names]
    return []
