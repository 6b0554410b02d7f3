# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Definitions in Python source found, hashed and edited with libcst; imports
added and pruned by libcst's codemods, sorted by ruff's isort (upstream's pin).

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
from collections import Counter
from collections.abc import Sequence

import libcst as cst
import libcst.matchers as m
from libcst.codemod import CodemodContext
from libcst.codemod.visitors import AddImportsVisitor, RemoveImportsVisitor

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
    s = stmt.body[0] if isinstance(stmt, cst.SimpleStatementLine) else None
    if isinstance(s, cst.Assign) and len(s.targets) == 1:
        s = s.targets[0]
    if isinstance(s, (cst.AssignTarget, cst.AnnAssign)):
        return s.target.value if isinstance(s.target, cst.Name) else None
    docstring = isinstance(s, cst.Expr) and isinstance(s.value, cst.SimpleString)
    return "__doc__" if first and docstring else None


def _names(body: Sequence[cst.CSTNode]) -> list[str | None]:
    return [_binds(s, i == 0) for i, s in enumerate(body)]


def find(module: cst.Module, qualname: str, who: str) -> cst.CSTNode:
    node: cst.CSTNode = module
    for part in qualname.split("."):
        hits = [
            s
            for s, n in zip(_body(node), _names(_body(node)), strict=True)
            if n == part
        ]
        if len(hits) != 1:
            raise ToolError(
                f"{who}: {qualname}: {'defined twice' if hits else 'not found'}"
            )
        node = hits[0]
    return node


def source_hash(module: cst.Module, qualname: str, who: str = "") -> str:
    """sha256 of a definition's tokens: its source normalised only for
    whitespace (line breaks inside brackets, spacing; indentation kept)."""
    tokens = tokenize.generate_tokens(
        io.StringIO(code(find(module, qualname, who))).readline
    )
    text = " ".join(
        t.string if t.string.strip() else tokenize.tok_name[t.type]
        for t in tokens
        if t.type not in (tokenize.NL, tokenize.ENDMARKER)
    )
    return hashlib.sha256(text.encode()).hexdigest()


def definition_source(text: str, qualname: str, who: str = "") -> str:
    """The source of one definition ("f", "C" or "C.m") of a module's text."""
    return code(find(parse(text, who), qualname, who))


def _shape(text: str, statement: bool) -> str:
    if statement:
        return ast.dump(ast.parse(textwrap.dedent(text)))
    return ast.dump(ast.parse(f"(\n{text}\n)", mode="eval"))


def match(node, text: str, who: str, statement=False, of_if=False) -> cst.CSTNode:
    """The one node under ``node`` with ``text``'s structure, comments and
    whitespace aside (``of_if``: the ``if`` statement whose test it is)."""
    try:
        parsed = cst.parse_statement(text) if statement else cst.parse_expression(text)
        want = _shape(text, statement)
    except (cst.ParserSyntaxError, SyntaxError):
        raise ToolError(f"{who}: {text!r} does not parse") from None

    def hit(n: cst.CSTNode) -> bool:
        part = (n.test if isinstance(n, cst.If) else None) if of_if else n
        return type(part) is type(parsed) and _shape(code(part), statement) == want

    hits = m.findall(node, m.MatchIfTrue(hit))
    if len(hits) != 1:
        raise ToolError(f"{who}: {text!r} matches {len(hits)} places, not 1")
    return hits[0]


def _is_expression(text: str) -> bool:
    try:
        cst.parse_expression(text)
    except (cst.ParserSyntaxError, SyntaxError):
        return False
    return True


def reads(*nodes: cst.CSTNode) -> set[str]:
    """The names code reads or assigns (ast's: not attribute names, keywords,
    parameters, imports or the names of definitions)."""
    names: set[str] = set()
    for n in nodes:
        expression = isinstance(n, cst.BaseExpression)
        tree = ast.parse(f"(\n{code(n)}\n)" if expression else code(n))
        names |= {x.id for x in ast.walk(tree) if isinstance(x, ast.Name)}
    return names


def bindings(module: cst.Module) -> dict[str, tuple[str, ...]]:
    """name -> ("import", module or "", name) or ("def",), module level
    (imports under ``if TYPE_CHECKING:`` too; absolute ones, vLLM's style:
    a relative import binds nothing here)."""
    out: dict[str, tuple[str, ...]] = {}
    tree = ast.parse(module.code)
    checking = [
        s
        for s in tree.body
        if isinstance(s, ast.If) and ast.unparse(s.test) == "TYPE_CHECKING"
    ]
    for s in [*tree.body, *(checking[0].body if checking else ())]:
        mod = "" if isinstance(s, ast.Import) else getattr(s, "module", None)
        for a in s.names if mod is not None and not getattr(s, "level", 0) else ():
            bound = a.asname or a.name.split(".")[0]
            out[bound] = ("import", mod, a.name if mod or a.asname else bound)
    for n in _names(module.body):
        out.setdefault(n, ("def",))
    return out


def _checking(module: cst.Module) -> list:
    """The statements under ``if TYPE_CHECKING:``, module level."""
    ifs = [s for s in module.body if isinstance(s, cst.If)]
    return [x for s in ifs if code(s.test) == "TYPE_CHECKING" for x in s.body.body]


def _import_args(bound: str, mod: str, full: str) -> tuple:
    """libcst's (module, obj, asname) of the binding ("import", mod, full)."""
    plain = full if mod else full.split(".")[0]
    return mod or full, full if mod else None, None if bound == plain else bound


def _from_imports(module: cst.Module) -> list[cst.ImportFrom]:
    lines = [s for s in module.body if isinstance(s, cst.SimpleStatementLine)]
    return [s.body[0] for s in lines if isinstance(s.body[0], cst.ImportFrom)]


def add_imports(
    module: cst.Module, wanted: dict, branch: cst.Module | None = None
) -> cst.Module:
    """``module`` importing the bindings ``wanted`` (bound name -> binding); a
    new ``from`` import keeps the comment ``branch`` puts after its ``(``
    (upstream's ``# noqa: E501`` for a module path too long to wrap)."""
    ctx = CodemodContext()
    for bound, (_, mod, full) in sorted(wanted.items()):
        AddImportsVisitor.add_needed_import(ctx, *_import_args(bound, mod, full))
    body = list(AddImportsVisitor(ctx).transform_module(module).body)
    noted = {
        code(s.module): s
        for s in _from_imports(branch or cst.Module([]))
        if s.lpar and "#" in code(s.lpar)
    }
    old = {code(s) for s in _from_imports(module)}
    for i, line in enumerate(body):
        s = line.body[0] if isinstance(line, cst.SimpleStatementLine) else None
        new = isinstance(s, cst.ImportFrom) and s.module and code(s) not in old
        if new and (b := noted.get(code(s.module))):
            s = s.with_changes(lpar=b.lpar, rpar=b.rpar)
            body[i] = line.with_changes(body=[s, *line.body[1:]])
    # ruff format keeps a blank line after a module docstring; libcst does not
    if len(body) > 1 and _binds(body[0], True) == "__doc__":
        body[1] = body[1].with_changes(
            leading_lines=body[1].leading_lines or [cst.EmptyLine()]
        )
    return module.with_changes(body=body)


def _nested_imports(module: cst.Module) -> list[str]:
    """The import statements inside definitions."""
    lines = [*module.body, *_checking(module)]
    top = [code(s.body[0]) for s in lines if isinstance(s, cst.SimpleStatementLine)]
    found = [code(n) for n in m.findall(module, m.Import() | m.ImportFrom())]
    return sorted((Counter(found) - Counter(top)).elements())


def drop_unused_imports(before: cst.Module, after: cst.Module, path: str):
    """``after`` (the edited ``before`` of the file ``path``) without the
    module-level imports of the names ``before`` read and ``after`` no longer
    does (``__all__``'s strings count), each with its comment lines; libcst's
    remover checks each is unused. Nothing else is touched: upstream's
    side-effect imports (``# noqa: F401``) stay. A new first statement keeps
    only its comments: the header holds the blank lines."""

    def used(module: cst.Module) -> set[str]:
        names = reads(module)
        for s in (s for s in module.body if _binds(s) == "__all__"):
            names |= set(re.findall(r"[\"'](\w+)[\"']", code(s)))
        return names

    gone = used(before) - used(after)
    dotted = path.removesuffix(".py").replace("/", ".")
    package, name = dotted.rpartition(".")[0], dotted.removesuffix(".__init__")
    ctx = CodemodContext(full_module_name=name, full_package_name=package)
    drop = [
        (b, i) for b, i in bindings(after).items() if b in gone and i[0] == "import"
    ]
    if not drop:
        return after
    for bound, (_, mod, full) in drop:
        RemoveImportsVisitor.remove_unused_import(ctx, *_import_args(bound, mod, full))
    out = RemoveImportsVisitor(ctx).transform_module(after)
    # libcst removes a same-named unused import inside a function too
    if _nested_imports(out) != _nested_imports(after):
        names = ", ".join(sorted(b for b, _ in drop))
        raise ToolError(f"{path}: dropping {names} would drop a function's import")
    body = list(out.body)
    if body:
        notes = [ln for ln in body[0].leading_lines if ln.comment]
        body[0] = body[0].with_changes(leading_lines=notes)
    return after.with_changes(body=body)


def sort_imports(text: str, path: str, package: str, who: str) -> str:
    """``text`` (of the file ``path``) as upstream's pre-commit leaves it:
    ruff's isort (``ruff check --select I --fix``, ``package`` and tests/
    first-party), then ``ruff format`` with upstream's settings."""
    first = f"lint.isort.known-first-party = [{package!r}, 'tests']"
    cmd = [sys.executable, "-m", "ruff", "check", "--isolated", "--no-cache"]
    cmd += ["--select", "I", "--fix", "--config", first, "--stdin-filename", path]
    text = run([*cmd, "-"], f"{who}: ruff's import sorting", input=text, strip=False)
    # upstream's pre-commit formats too: only the branch's lines can change
    cmd = [sys.executable, "-m", "ruff", "format", "--isolated", "--no-cache"]
    cmd += ["--config", "format.docstring-code-format = true", "--stdin-filename"]
    return run([*cmd, path, "-"], f"{who}: ruff format", input=text, strip=False)


def add_definition(
    up: cst.Module, br: cst.Module, qualname: str, who: str
) -> cst.Module:
    """Add the branch's definition where its file has it: before the next
    statement upstream has too (else after the previous one, else last)."""
    parent, _, name = qualname.rpartition(".")
    u_parent = find(up, parent, who) if parent else up
    b_body = _body(find(br, parent, who) if parent else br)
    u_body, u_names, b_names = (
        list(_body(u_parent)),
        _names(_body(u_parent)),
        _names(b_body),
    )
    if name in u_names:
        raise ToolError(f"{who}: {qualname}: upstream defines it: replace it")
    node = find(br, qualname, who)
    i = [s is node for s in b_body].index(True)
    # by the definitions both have: imports, other unnamed statements and the
    # docstring (the imports follow it) differ
    named = [n if n != "__doc__" else None for n in b_names]
    later = [u_names.index(n) for n in named[i + 1 :] if n and n in u_names]
    earlier = [u_names.index(n) + 1 for n in named[:i] if n and n in u_names]
    u_body.insert((later or earlier[-1:] or [len(u_body)])[0], node)
    if not parent:
        return up.with_changes(body=u_body)
    new = u_parent.with_changes(body=u_parent.body.with_changes(body=u_body))
    return up.deep_replace(u_parent, new)


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
            new = list(block.body)
            new[0] = new[0].with_changes(
                leading_lines=[*block.header, *new[0].leading_lines]
            )
        seq = [*new, anchor] if e.kind == "insert_before" else [anchor, *new]
        return up.deep_replace(anchor, cst.FlattenSentinel(seq)), reads(*new)
    if e.kind == "decorate":  # target gets the decorator ``anchor`` first
        dec = cst.Decorator(decorator=cst.parse_expression(e.anchor))
        decorated = target.with_changes(decorators=[dec, *target.decorators])
        return up.deep_replace(target, decorated), reads(dec.decorator)
    if e.kind == "replace" and not _is_expression(e.anchor):  # a statement
        anchor = match(target, e.anchor, who, statement=True)
        new = list(parse(textwrap.dedent(e.code), who).body)
        new[0] = new[0].with_changes(leading_lines=anchor.leading_lines)
        return up.deep_replace(anchor, cst.FlattenSentinel(new)), reads(*new)
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
    """The ``environment_variables`` dict, its entries by name, and the
    ``if TYPE_CHECKING:`` block with its annotations by name (ast)."""
    body = ast.parse(text).body
    d = [
        s.value
        for s in body
        if isinstance(s, (ast.Assign, ast.AnnAssign))
        and ast.unparse(getattr(s, "target", None) or s.targets[0])
        == "environment_variables"
    ]
    tc = [
        s
        for s in body
        if isinstance(s, ast.If) and ast.unparse(s.test) == "TYPE_CHECKING"
    ]
    if not d or not isinstance(d[0], ast.Dict) or not tc:
        raise ToolError(f"{who}: no environment_variables dict or TYPE_CHECKING block")
    keys = {
        getattr(k, "value", None): (k, v)
        for k, v in zip(d[0].keys, d[0].values, strict=True)
    }
    anns = {
        ast.unparse(s.target): s for s in tc[0].body if isinstance(s, ast.AnnAssign)
    }
    return d[0], keys, tc[0], anns


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
        first = bkeys[n][0].lineno
        while bl[first - 2].lstrip().startswith("#"):
            first -= 1
        entries += bl[first - 1 : bkeys[n][1].end_lineno]
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
    while (
        i < len(lines)
        and lines[i].startswith(indent)
        and lines[i] != f"{indent}source_file_dependencies:\n"
    ):
        i += 1
    if i == len(lines) or not lines[i].startswith(indent):
        raise ToolError(f"{who}: step {step} has no source_file_dependencies")
    deps, i = [], i + 1
    while i < len(lines) and lines[i].startswith(f"{indent}- "):
        deps.append(lines[i].strip()[2:].strip().rstrip("/"))
        i += 1
    new = [p for p in paths if not any(p == d or p.startswith(d + "/") for d in deps)]
    lines[i:i] = [f"{indent}- {p}\n" for p in new]
    return "".join(lines)
