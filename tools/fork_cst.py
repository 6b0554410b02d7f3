# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Definitions in Python source, found, hashed and edited with libcst: the
branch's edits of one upstream file, its imports kept as ruff's isort has them.

Names are "f", "C" or "C.m" ("C.__doc__": a class's docstring); an anchor is
source text matched by structure (comments and whitespace aside).
"""

from __future__ import annotations

import ast
import hashlib
import io
import re
import sys
import textwrap
import tokenize
from collections.abc import Sequence

import libcst as cst
import libcst.matchers as m

from fork_manifest import Edit
from tool_cli import ToolError, run

__all__ = ["add_definition", "add_imports", "bindings", "buildkite_dependencies"]
__all__ += ["code", "definition_source", "drop_unused_imports", "edit"]
__all__ += ["env_entries", "find", "match", "parse", "reads", "sort_imports"]
__all__ += ["source_hash"]


def parse(text: str, who: str) -> cst.Module:
    try:
        return cst.parse_module(text)
    except cst.ParserSyntaxError as exc:
        raise ToolError(f"{who}: does not parse: line {exc.raw_line}") from None


def code(node: cst.CSTNode) -> str:
    if hasattr(node, "leading_lines"):
        node = node.with_changes(leading_lines=())
    return cst.Module([]).code_for_node(node)


def _body(node: cst.CSTNode) -> Sequence[cst.CSTNode]:
    return node.body if isinstance(node, cst.Module) else node.body.body


def _binds(stmt: cst.CSTNode, first: bool = False) -> str | None:
    """The name a definition statement binds ("__doc__" for a docstring)."""
    if isinstance(stmt, (cst.FunctionDef, cst.ClassDef)):
        return stmt.name.value
    if isinstance(stmt, cst.SimpleStatementLine) and len(stmt.body) == 1:
        s = stmt.body[0]
        if isinstance(s, cst.Assign) and len(s.targets) == 1:
            s = s.targets[0]
        if isinstance(s, (cst.AssignTarget, cst.AnnAssign)):
            return s.target.value if isinstance(s.target, cst.Name) else None
        if first and isinstance(s, cst.Expr) and isinstance(s.value, cst.SimpleString):
            return "__doc__"
    return None


def _names_of(body: Sequence[cst.CSTNode]) -> list[str | None]:
    return [_binds(s, i == 0) for i, s in enumerate(body)]


def find(module: cst.Module, qualname: str, who: str) -> cst.CSTNode:
    node: cst.CSTNode = module
    for part in qualname.split("."):
        hits = [
            s
            for s, n in zip(_body(node), _names_of(_body(node)), strict=True)
            if n == part
        ]
        if len(hits) != 1:
            found = "defined twice" if hits else "not found"
            raise ToolError(f"{who}: {qualname}: {found}")
        node = hits[0]
    return node


def source_hash(module: cst.Module, qualname: str, who: str = "") -> str:
    """sha256 of a definition's tokens: its source normalised only for
    whitespace (line breaks inside brackets, spacing; indentation kept)."""
    lines = io.StringIO(code(find(module, qualname, who))).readline
    skip = {tokenize.NL, tokenize.ENDMARKER}
    text = " ".join(
        t.string if t.string.strip() else tokenize.tok_name[t.type]
        for t in tokenize.generate_tokens(lines)
        if t.type not in skip
    )
    return hashlib.sha256(text.encode()).hexdigest()


def definition_source(text: str, qualname: str, who: str = "") -> str:
    """The source of one definition ("f", "C" or "C.m") of a module's text."""
    return code(find(parse(text, who), qualname, who))


def _shape(text: str, statement: bool) -> str:
    if statement:
        return ast.dump(ast.parse(textwrap.dedent(text)))
    return ast.dump(ast.parse(f"(\n{text}\n)", mode="eval"))


def match(
    node: cst.CSTNode, text: str, who: str, statement: bool = False, of_if=False
) -> cst.CSTNode:
    """The one node under ``node`` with ``text``'s structure, comments and
    whitespace aside (``of_if``: the ``if`` statement whose test it is)."""
    try:
        kind = type(
            cst.parse_statement(text) if statement else cst.parse_expression(text)
        )
        want = _shape(text, statement)
    except (cst.ParserSyntaxError, SyntaxError):
        raise ToolError(f"{who}: {text!r} does not parse") from None

    def hit(n: cst.CSTNode) -> bool:
        part = n.test if of_if and isinstance(n, cst.If) else None if of_if else n
        return type(part) is kind and _shape(code(part), statement) == want

    hits = m.findall(node, m.MatchIfTrue(hit))
    if len(hits) != 1:
        raise ToolError(f"{who}: {text!r} matches {len(hits)} places, not 1")
    return hits[0]


class _Reads(cst.CSTVisitor):
    """The names code reads (not attribute names, keywords, parameters)."""

    def __init__(self) -> None:
        self.names: set[str] = set()

    def visit_Name(self, node: cst.Name) -> None:
        self.names.add(node.value)

    def visit_Attribute(self, node: cst.Attribute) -> bool:
        node.value.visit(self)
        return False

    def visit_Arg(self, node: cst.Arg) -> bool:
        node.value.visit(self)
        return False

    def visit_Param(self, node: cst.Param) -> bool:
        for n in (node.annotation, node.default):
            n and n.visit(self)
        return False

    def visit_Import(self, node: cst.CSTNode) -> bool:
        return False

    visit_ImportFrom = visit_Import


def reads(*nodes: cst.CSTNode) -> set[str]:
    v = _Reads()
    for n in nodes:
        n.visit(v)
    return v.names


class _Swap(cst.CSTTransformer):
    """Replace nodes by identity: {id(old node): new node or sentinel}."""

    def __init__(self, swaps: dict) -> None:
        super().__init__()
        self.swaps = swaps

    def on_leave(self, old, new):
        return self.swaps.get(id(old), new)


def _imports(module: cst.Module) -> list:
    """Module-level import lines (with those under ``if TYPE_CHECKING:``)."""
    tc = [s for s in module.body if isinstance(s, cst.If)]
    tc = [s.body.body for s in tc if code(s.test) == "TYPE_CHECKING"]
    return [s for s in [*module.body, *(tc[0] if tc else ())] if _is_import(s)]


def _alias_names(alias: cst.ImportAlias) -> tuple[str, str]:
    full = code(alias.name)
    return full, code(alias.asname.name) if alias.asname else full.split(".")[0]


def bindings(module: cst.Module) -> dict[str, tuple[str, ...]]:
    """name -> ("import", module or "", name) or ("def",), module level."""
    out: dict[str, tuple[str, ...]] = {}
    for s in _imports(module):
        imp = s.body[0]
        mod = code(imp.module) if isinstance(imp, cst.ImportFrom) else ""
        for a in () if isinstance(imp.names, cst.ImportStar) else imp.names:
            full, bound = _alias_names(a)
            out[bound] = ("import", mod, full if mod or a.asname else bound)
    for n in _names_of(module.body):
        out.setdefault(n, ("def",))
    return out


def _is_import(s: cst.CSTNode) -> bool:
    return isinstance(s, cst.SimpleStatementLine) and isinstance(
        s.body[0], (cst.Import, cst.ImportFrom)
    )


def _from(s: cst.CSTNode) -> str | None:
    """The module of a module-level ``from <module> import`` line."""
    imp = s.body[0] if _is_import(s) else None
    is_from = isinstance(imp, cst.ImportFrom) and imp.module and not imp.relative
    return code(imp.module) if is_from else None


def add_imports(module: cst.Module, wanted: dict) -> cst.Module:
    """Add the bindings ``wanted`` (bound name -> binding), an import line
    each, after upstream's import from the same module, else after the first
    run of imports; :func:`sort_imports` then places them as ruff does."""
    for bound, (_, mod, full) in sorted(wanted.items()):
        plain = full if mod else full.split(".")[0]
        name = full if bound == plain else f"{full} as {bound}"
        new = cst.parse_statement(
            f"from {mod} import {name}" if mod else f"import {name}"
        )
        body = list(module.body)
        runs = [k for k, s in enumerate(body) if _is_import(s)]
        i = next((k + 1 for k in runs if mod and _from(body[k]) == mod), None)
        if i is None and runs:
            i = runs[0]
            while i < len(body) and _is_import(body[i]):
                i += 1
        elif i is None:  # the first import: after the docstring
            i = int(bool(body) and _binds(body[0], True) == "__doc__")
            new = new.with_changes(leading_lines=[cst.EmptyLine(indent=False)] * i)
        module = module.with_changes(body=[*body[:i], new, *body[i:]])
    return module


def sort_imports(text: str, path: str, package: str, who: str) -> str:
    """``text`` (of the file ``path``) with its import blocks as upstream's
    pre-commit leaves them: ruff's isort (``ruff check --select I --fix``,
    ``package`` and tests/ first-party)."""
    first = f"lint.isort.known-first-party = [{package!r}, 'tests']"
    cmd = [sys.executable, "-m", "ruff", "check", "--isolated", "--no-cache"]
    cmd += ["--select", "I", "--fix", "--config", first, "--stdin-filename", path]
    return run([*cmd, "-"], f"{who}: ruff's import sorting", input=text, strip=False)


def drop_unused_imports(before: cst.Module, after: cst.Module) -> cst.Module:
    """Remove the imported names upstream's file read and the edited one no
    longer does (``__all__``'s strings count as reads). A new first statement
    keeps only its comments above it: the header holds the blank lines."""

    def used(m: cst.Module) -> set[str]:
        names = reads(m)
        for s in (s for s in m.body if _binds(s) == "__all__"):
            names |= set(re.findall(r"[\"'](\w+)[\"']", code(s)))
        return names

    gone, swaps = used(before) - used(after), {}
    for s in _imports(after):
        imp = s.body[0]
        if isinstance(imp.names, cst.ImportStar) or code(imp).startswith("from __"):
            continue
        keep = [a for a in imp.names if _alias_names(a)[1] not in gone]
        if not keep:
            swaps[id(s)] = cst.RemovalSentinel.REMOVE
        elif len(keep) < len(imp.names):
            keep[-1] = keep[-1].with_changes(comma=imp.names[-1].comma)
            swaps[id(imp)] = imp.with_changes(names=keep)
    body = list(after.visit(_Swap(swaps)).body)
    if body:
        notes = [ln for ln in body[0].leading_lines if ln.comment]
        body[0] = body[0].with_changes(leading_lines=notes)
    return after.with_changes(body=body)


def add_definition(
    up: cst.Module, br: cst.Module, qualname: str, who: str
) -> cst.Module:
    """Add the branch's definition where its file has it: before the next
    statement upstream has too (else after the previous one, else last)."""
    parent, _, name = qualname.rpartition(".")
    u_parent = find(up, parent, who) if parent else up
    b_parent = find(br, parent, who) if parent else br
    node = find(br, qualname, who)
    u_body, b_names = list(_body(u_parent)), _names_of(_body(b_parent))
    u_names = _names_of(u_body)
    if name in u_names:
        raise ToolError(f"{who}: {qualname}: upstream defines it: replace it")
    i = [s is node for s in _body(b_parent)].index(True)
    later = [u_names.index(n) for n in b_names[i + 1 :] if n in u_names]
    earlier = [u_names.index(n) + 1 for n in b_names[:i] if n in u_names]
    u_body.insert((later or [earlier[-1] if earlier else len(u_body)])[0], node)
    if not parent:
        return up.with_changes(body=u_body)
    body = u_parent.body.with_changes(body=u_body)
    return up.deep_replace(u_parent, u_parent.with_changes(body=body))


def edit(up: cst.Module, br: cst.Module, e: Edit, who: str) -> tuple:
    """``up`` with the edit made, and the names its new code reads."""
    who = f"{who}: {e.inside}"
    target = find(up, e.inside, who)
    if e.kind.startswith("insert"):
        anchor = match(target, e.anchor, who, statement=True)
        if e.take:
            new = [
                match(
                    find(br, e.inside, f"the branch's {who}"), e.take, who, of_if=True
                )
            ]
        else:
            block = parse(textwrap.dedent(e.code), who)
            first = block.body[0]
            new = [
                first.with_changes(leading_lines=[*block.header, *first.leading_lines])
            ]
            new += block.body[1:]
        seq = [*new, anchor] if e.kind == "insert_before" else [anchor, *new]
        return up.deep_replace(anchor, cst.FlattenSentinel(seq)), reads(*new)
    if e.kind == "replace":
        anchor = match(target, e.anchor, who)
        new = cst.parse_expression(e.code).with_changes(
            lpar=anchor.lpar, rpar=anchor.rpar
        )
        return up.deep_replace(anchor, new), reads(new)
    within = match(target, e.within, who)
    els, want = list(getattr(within, "elements", ())), _shape(e.anchor, False)
    idx = [i for i, el in enumerate(els) if _shape(code(el.value), False) == want]
    if not isinstance(within, (cst.List, cst.Tuple, cst.Set)) or len(idx) != 1:
        raise ToolError(f"{who}: {e.anchor!r} is not once an element of {e.within!r}")
    gone = els.pop(idx[0])
    if idx[0] == len(els) and els:  # it was last: the new last takes its comma
        els[-1] = els[-1].with_changes(comma=gone.comma)
    return up.deep_replace(within, within.with_changes(elements=els)), set()


def _env_parts(text: str, who: str) -> tuple:
    """(the ``environment_variables`` dict, its entries by name, the
    ``if TYPE_CHECKING:`` block, its annotations by name), by ast."""
    body = ast.parse(text).body
    named = [
        s.value
        for s in body
        if isinstance(s, (ast.Assign, ast.AnnAssign))
        and "environment_variables"
        in {ast.unparse(t) for t in getattr(s, "targets", [getattr(s, "target", None)])}
    ]
    tc = [
        s
        for s in body
        if isinstance(s, ast.If) and ast.unparse(s.test) == "TYPE_CHECKING"
    ]
    if not named or not isinstance(named[0], ast.Dict) or not tc:
        raise ToolError(f"{who}: no environment_variables dict or TYPE_CHECKING block")
    d, tc = named[0], tc[0]
    entries = {
        getattr(k, "value", None): (k, v) for k, v in zip(d.keys, d.values, strict=True)
    }
    anns = {ast.unparse(s.target): s for s in tc.body if isinstance(s, ast.AnnAssign)}
    return d, entries, tc, anns


def env_entries(text: str, branch: str, names: Sequence[str], who: str) -> str:
    """Add the branch's ``environment_variables`` entries ``names`` (with the
    comment lines above each) and their ``if TYPE_CHECKING:`` annotations."""
    (ud, ukeys, utc, _), (_, bkeys, _, banns) = (
        _env_parts(text, who),
        _env_parts(branch, who),
    )
    ul, bl = text.splitlines(keepends=True), branch.splitlines(keepends=True)
    entries, anns = [], []
    for n in names:
        if n in ukeys or n not in bkeys or n not in banns:
            where = "upstream has" if n in ukeys else "the branch's file lacks"
            raise ToolError(f"{who}: {where} {n} or its annotation")
        (key, value) = bkeys[n]
        first = key.lineno
        while bl[first - 2].lstrip().startswith("#"):
            first -= 1
        entries += bl[first - 1 : value.end_lineno]
        anns += bl[banns[n].lineno - 1 : banns[n].end_lineno]
    last = ud.values[-1]
    if not ul[last.end_lineno - 1][last.end_col_offset :].lstrip().startswith(","):
        raise ToolError(f"{who}: upstream's last environment variable has no comma")
    ul[ud.end_lineno - 1 : ud.end_lineno - 1] = entries
    ul[utc.end_lineno : utc.end_lineno] = anns
    return "".join(ul)


def buildkite_dependencies(text: str, step: str, paths: Sequence[str], who: str) -> str:
    """Add ``paths`` not covered yet to the ``source_file_dependencies`` of
    the step with key ``step`` (one ``- path`` line each, format kept)."""
    lines = text.splitlines(keepends=True)
    keys = [i for i, s in enumerate(lines) if s.strip() == f"key: {step}"]
    if len(keys) != 1:
        raise ToolError(f"{who}: step {step} found {len(keys)} times, not once")
    indent = lines[keys[0]][: -len(lines[keys[0]].lstrip())]
    i = keys[0] + 1
    while i < len(lines) and lines[i].startswith(indent):
        if lines[i] == f"{indent}source_file_dependencies:\n":
            break
        i += 1
    else:
        raise ToolError(f"{who}: step {step} has no source_file_dependencies")
    deps, i = [], i + 1
    while i < len(lines) and lines[i].startswith(f"{indent}- "):
        deps.append(lines[i].strip()[2:].strip().rstrip("/"))
        i += 1
    new = [p for p in paths if not any(p == d or p.startswith(d + "/") for d in deps)]
    lines[i:i] = [f"{indent}- {p}\n" for p in new]
    return "".join(lines)
