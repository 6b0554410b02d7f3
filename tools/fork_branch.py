# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Apply the branch (tools/fork_manifest.toml) to an unpacked vLLM release tree.

    python tools/fork_branch.py apply TREE VERSION [--source] [--pr ID ...]
    python tools/fork_branch.py hashes TREE VERSION  # the manifest's sha256 lines

Edits are keyed by names and structure and made with libcst; the rest of each
upstream file stays byte for byte. Before anything is written, the sha256 of
upstream's own source (whitespace runs collapsed) of every definition the
branch replaces, edits or relies on is recomputed and compared.
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import io
import os
import re
import sys
import textwrap
import tokenize
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import libcst as cst
import tomllib
from libcst.metadata import MetadataWrapper, PositionProvider

__all__ = [
    "DEFAULT_MANIFEST",
    "ROOT",
    "BranchError",
    "BranchReport",
    "Edit",
    "FileEntry",
    "Manifest",
    "PullRequest",
    "Release",
    "apply_branch",
    "definition_source",
    "load_manifest",
    "release_hashes",
    "source_hash",
]

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_MANIFEST = ROOT / "tools" / "fork_manifest.toml"
_EDITS = ("insert_before", "insert_after", "replace", "remove")


class BranchError(ValueError):
    """The branch cannot be applied; one line naming release, file, definition."""


@dataclass(frozen=True)
class Release:
    version: str
    wheel: str
    wheel_sha256: str
    sdist: str
    sdist_sha256: str
    requirements: dict[str, str]


@dataclass(frozen=True)
class PullRequest:
    id: str
    title: str
    doc: str
    new: tuple[str, ...]


@dataclass(frozen=True)
class Edit:
    """An edit inside the upstream definition ``inside`` ("f" or "C.m"):
    insert_before/insert_after the statement ``anchor`` the statements
    ``code`` (or the branch's ``if <take>:``), replace the expression
    ``anchor`` by ``code``, or remove the element ``anchor`` of the list or
    tuple ``within``. Each anchor must match exactly once."""

    kind: str
    inside: str
    anchor: str
    code: str = ""
    take: str = ""
    within: str = ""


@dataclass(frozen=True)
class FileEntry:
    """What one PR does to one file: ``path`` in the release, ``src`` here."""

    path: str
    pr: str
    src: str
    new: bool = False
    replace: tuple[str, ...] = ()
    add: tuple[str, ...] = ()
    drop: tuple[str, ...] = ()
    edits: tuple[Edit, ...] = ()
    envs: tuple[str, ...] = ()
    sha256: dict[str, dict[str, str]] = field(default_factory=dict)

    @property
    def changed(self) -> list[str]:
        """The upstream definitions it replaces or edits (a class for members)."""
        names = [*self.replace, *self.drop, *(e.inside for e in self.edits)]
        names += [q for q in self.add if "." in q]
        return sorted({q.split(".")[0] for q in names})


@dataclass(frozen=True)
class Manifest:
    package: str
    local_label: str
    releases: dict[str, Release]
    prs: tuple[PullRequest, ...]
    files: tuple[FileEntry, ...]  # new files and edits, in PR order
    buildkite: dict[str, str] | None = None

    def release(self, version: str) -> Release:
        if version not in self.releases:
            supported = ", ".join(self.releases)
            raise BranchError(f"vllm {version} is not supported ({supported} are)")
        return self.releases[version]

    def entries(self, prs: Sequence[str] | None = None, source: bool = False):
        """The entries of ``prs`` (None: all), in order; tests/ and .buildkite/
        paths only for a source tree."""
        known = [p.id for p in self.prs]
        if unknown := set(prs or ()) - set(known):
            raise BranchError(f"no PR {sorted(unknown)[0]!r} (the series: {known})")
        return [
            e
            for e in self.files
            if (prs is None or e.pr in prs) and (source or e.path.startswith("vllm/"))
        ]


@dataclass
class BranchReport:
    version: str
    written: list[str] = field(default_factory=list)
    lines: list[str] = field(default_factory=list)


def _table(d: object, where: str, need: set[str], may: set[str]) -> dict:
    if not isinstance(d, dict):
        raise BranchError(f"{where}: must be a table")
    if bad := sorted(need - d.keys()) or sorted(d.keys() - need - may):
        raise BranchError(f"{where}: missing or unknown key {bad[0]!r}")
    return d


def load_manifest(path: Path = DEFAULT_MANIFEST) -> Manifest:
    """Read and check the manifest (its format: the comment at its top)."""
    try:
        data = tomllib.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise BranchError(f"{path}: {exc}") from None
    need = {"package", "local_label", "releases", "prs"}
    top = _table(data, Path(path).name, need, {"files", "buildkite"})
    releases = {}
    for v, r in top["releases"].items():
        keys = {"wheel", "wheel_sha256", "sdist", "sdist_sha256", "requirements"}
        releases[v] = Release(v, **_table(r, f"releases.{v}", keys, set()))
    prs, files = [], []
    for p in top["prs"]:
        p = _table(p, "prs", {"id", "title", "doc"}, {"new"})
        prs.append(PullRequest(p["id"], p["title"], p["doc"], tuple(p.get("new", ()))))
        files += [FileEntry(f, p["id"], f, new=True) for f in p.get("new", ())]
    order = [p.id for p in prs]
    may = {"src", "new", "replace", "add", "drop", "edits", "envs", "sha256"}
    for f in top.get("files", ()):
        f = _table(f, "files", {"path", "pr"}, may)
        if f["pr"] not in order:
            raise BranchError(f"files {f['path']}: no PR {f['pr']!r}")
        edits = []
        for e in f.get("edits", ()):
            kind = [k for k in _EDITS if k in e][:1] or ["insert_before"]
            e = _table(
                e, f"files {f['path']}", {"in", kind[0]}, {"code", "take", "within"}
            )
            args = (e.get("code", ""), e.get("take", ""), e.get("within", ""))
            edits.append(Edit(kind[0], e["in"], e[kind[0]], *args))
        lists = [tuple(f.get(k, ())) for k in ("replace", "add", "drop")]
        src, envs = f.get("src", f["path"]), tuple(f.get("envs", ()))
        sha = f.get("sha256", {})
        files.append(
            FileEntry(
                f["path"],
                f["pr"],
                src,
                bool(f.get("new")),
                *lists,
                tuple(edits),
                envs,
                sha,
            )
        )
    files.sort(key=lambda e: order.index(e.pr))  # stable: PR order, then listed
    bk = top.get("buildkite")
    if bk is not None:
        _table(bk, "buildkite", {"pr", "file", "step"}, set())
    return Manifest(
        top["package"], top["local_label"], releases, tuple(prs), tuple(files), bk
    )


# ---------------------------------------------------------------- libcst helpers


def _parse(text: str, who: str) -> cst.Module:
    try:
        return cst.parse_module(text)
    except cst.ParserSyntaxError as exc:
        raise BranchError(f"{who}: does not parse: line {exc.raw_line}") from None


def _code(node: cst.CSTNode) -> str:
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


def _find(module: cst.Module, qualname: str, who: str) -> cst.CSTNode:
    node: cst.CSTNode = module
    for part in qualname.split("."):
        hits = [
            s
            for s, n in zip(_body(node), _names_of(_body(node)), strict=True)
            if n == part
        ]
        if len(hits) != 1:
            found = "defined twice" if hits else "not found"
            raise BranchError(f"{who}: {qualname}: {found}")
        node = hits[0]
    return node


def source_hash(module: cst.Module, qualname: str, who: str = "") -> str:
    """sha256 of a definition's tokens: its source normalised only for
    whitespace (line breaks inside brackets, spacing; indentation kept)."""
    lines = io.StringIO(_code(_find(module, qualname, who))).readline
    skip = {tokenize.NL, tokenize.ENDMARKER}
    text = " ".join(
        t.string if t.string.strip() else tokenize.tok_name[t.type]
        for t in tokenize.generate_tokens(lines)
        if t.type not in skip
    )
    return hashlib.sha256(text.encode()).hexdigest()


def definition_source(path: Path, qualname: str) -> str:
    """The source text of one definition ("f", "C" or "C.m") of a file."""
    module = _parse(path.read_text(encoding="utf-8"), str(path))
    return _code(_find(module, qualname, str(path)))


def _shape(text: str, statement: bool) -> str:
    if statement:
        return ast.dump(ast.parse(textwrap.dedent(text)))
    return ast.dump(ast.parse(f"(\n{text}\n)", mode="eval"))


def _match(
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
        raise BranchError(f"{who}: {text!r} does not parse") from None
    hits: list[cst.CSTNode] = []

    class _Visit(cst.CSTVisitor):
        def on_visit(self, n: cst.CSTNode) -> bool:
            part = n.test if of_if and isinstance(n, cst.If) else None if of_if else n
            if type(part) is kind and _shape(_code(part), statement) == want:
                hits.append(n)
            return True

    node.visit(_Visit())
    if len(hits) != 1:
        raise BranchError(f"{who}: {text!r} matches {len(hits)} places, not 1")
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


def _reads(*nodes: cst.CSTNode) -> set[str]:
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


# -------------------------------------------------------------------- imports


def _type_checking(module: cst.Module) -> cst.If | None:
    tc = (s for s in module.body if isinstance(s, cst.If))
    return next((s for s in tc if _code(s.test) == "TYPE_CHECKING"), None)


def _imports(module: cst.Module, type_checking: bool = True) -> list:
    """Module-level import lines (with those under ``if TYPE_CHECKING:``)."""
    tc = _type_checking(module)
    lines = [*module.body, *(tc.body.body if tc and type_checking else ())]
    return [
        s
        for s in lines
        if isinstance(s, cst.SimpleStatementLine)
        and isinstance(s.body[0], (cst.Import, cst.ImportFrom))
    ]


def _alias_names(alias: cst.ImportAlias) -> tuple[str, str]:
    full = _code(alias.name)
    return full, _code(alias.asname.name) if alias.asname else full.split(".")[0]


def _bindings(module: cst.Module) -> dict[str, tuple[str, ...]]:
    """name -> ("import", module or "", name) or ("def",), module level."""
    out: dict[str, tuple[str, ...]] = {}
    for s in _imports(module):
        imp = s.body[0]
        mod = _code(imp.module) if isinstance(imp, cst.ImportFrom) else ""
        for a in () if isinstance(imp.names, cst.ImportStar) else imp.names:
            full, bound = _alias_names(a)
            out[bound] = ("import", mod, full if mod or a.asname else bound)
    for n in _names_of(module.body):
        out.setdefault(n, ("def",))
    return out


def _natural(text: str) -> list:
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", text.lower())]


def _import_line(mod: str, names: list[tuple[str, str]]) -> cst.SimpleStatementLine:
    """``import``/``from mod import`` of (name, bound) pairs, formatted as ruff."""

    def text(full: str, bound: str) -> str:
        plain = full if mod else full.split(".")[0]
        return full if bound == plain else f"{full} as {bound}"

    def rank(pair: tuple[str, str]) -> tuple:
        n = pair[0]
        return 0 if n.isupper() and len(n) > 1 else 1 if n[
            0
        ].isupper() else 2, _natural(n)

    parts = [text(*p) for p in sorted(set(names), key=rank)]
    line = f"from {mod} import {', '.join(parts)}" if mod else f"import {parts[0]}"
    if len(line) > 88:
        line = f"from {mod} import (\n" + "".join(f"    {p},\n" for p in parts) + ")"
    return cst.parse_statement(line + "\n")


def _sort_key(s: cst.SimpleStatementLine, package: str) -> tuple:
    imp = s.body[0]
    mod = _code(imp.module if isinstance(imp, cst.ImportFrom) else imp.names[0].name)
    top = mod.split(".")[0]
    section = [top == "__future__", top in sys.stdlib_module_names, True]
    section = section.index(True) + (top in (package, "tests"))
    return section, isinstance(imp, cst.ImportFrom), _natural(mod)


def _add_imports(module: cst.Module, wanted: dict, package: str) -> cst.Module:
    """Add the bindings ``wanted`` (bound name -> binding) as ruff's isort
    places them: into upstream's import of the same module, else sorted into
    its section."""
    groups: dict[str, list[tuple[str, str]]] = {}
    for bound, (_, mod, full) in sorted(wanted.items()):
        groups.setdefault(mod, []).append((full, bound))
    for mod, names in groups.items():
        for pairs in [names] if mod else [[p] for p in names]:
            lines = _imports(module, type_checking=False)
            same = [
                s
                for s in lines
                if mod
                and isinstance(s.body[0], cst.ImportFrom)
                and not isinstance(s.body[0].names, cst.ImportStar)
                and _code(s.body[0].module) == mod
            ]
            if same:
                have = [_alias_names(a) for a in same[0].body[0].names]
                new = _import_line(mod, have + pairs)
                swap = new.with_changes(leading_lines=same[0].leading_lines)
                module = module.deep_replace(same[0], swap)
                continue
            new = _import_line(mod, pairs)
            key = _sort_key(new, package)
            earlier = [s for s in lines if _sort_key(s, package) < key]
            later = [s for s in lines if _sort_key(s, package) > key]
            blank = [cst.EmptyLine(indent=False)]
            if (
                earlier
                and _sort_key(earlier[-1], package)[0] == key[0]
                or earlier
                and not later
            ):
                if _sort_key(earlier[-1], package)[0] != key[0]:
                    new = new.with_changes(leading_lines=blank)
                anchor, seq = earlier[-1], [earlier[-1], new]
            elif later:
                new = new.with_changes(leading_lines=later[0].leading_lines)
                same = _sort_key(later[0], package)[0] == key[0]
                anchor = later[0]
                seq = [new, anchor.with_changes(leading_lines=() if same else blank)]
            else:
                module = module.with_changes(body=[new, *module.body])
                continue
            module = module.deep_replace(anchor, cst.FlattenSentinel(seq))
    return module


def _drop_unused_imports(before: cst.Module, after: cst.Module) -> cst.Module:
    """Remove the imported names upstream's file read and the edited one no
    longer does (``__all__``'s strings count as reads)."""

    def used(m: cst.Module) -> set[str]:
        names = _reads(m)
        for s in (s for s in m.body if _binds(s) == "__all__"):
            names |= set(re.findall(r"[\"'](\w+)[\"']", _code(s)))
        return names

    gone, swaps = used(before) - used(after), {}
    for s in _imports(after):
        imp = s.body[0]
        if isinstance(imp.names, cst.ImportStar) or _code(imp).startswith("from __"):
            continue
        keep = [a for a in imp.names if _alias_names(a)[1] not in gone]
        if not keep:
            swaps[id(s)] = cst.RemovalSentinel.REMOVE
        elif len(keep) < len(imp.names):
            keep[-1] = keep[-1].with_changes(comma=imp.names[-1].comma)
            swaps[id(imp)] = imp.with_changes(names=keep)
    return after.visit(_Swap(swaps))


# ---------------------------------------------------------------------- edits


def _add(up: cst.Module, br: cst.Module, qualname: str, who: str) -> cst.Module:
    """Add the branch's definition where its file has it: before the next
    statement upstream has too (else after the previous one, else last)."""
    parent, _, name = qualname.rpartition(".")
    u_parent = _find(up, parent, who) if parent else up
    b_parent = _find(br, parent, who) if parent else br
    node = _find(br, qualname, who)
    u_body, b_names = list(_body(u_parent)), _names_of(_body(b_parent))
    u_names = _names_of(u_body)
    if name in u_names:
        raise BranchError(f"{who}: {qualname}: upstream defines it: replace it")
    i = [s is node for s in _body(b_parent)].index(True)
    later = [u_names.index(n) for n in b_names[i + 1 :] if n in u_names]
    earlier = [u_names.index(n) + 1 for n in b_names[:i] if n in u_names]
    u_body.insert((later or [earlier[-1] if earlier else len(u_body)])[0], node)
    if not parent:
        return up.with_changes(body=u_body)
    body = u_parent.body.with_changes(body=u_body)
    return up.deep_replace(u_parent, u_parent.with_changes(body=body))


def _edit(up: cst.Module, br: cst.Module, e: Edit, who: str) -> tuple:
    """``up`` with the edit made, and the names its new code reads."""
    who = f"{who}: {e.inside}"
    target = _find(up, e.inside, who)
    if e.kind.startswith("insert"):
        anchor = _match(target, e.anchor, who, statement=True)
        if e.take:
            new = [
                _match(
                    _find(br, e.inside, f"the branch's {who}"), e.take, who, of_if=True
                )
            ]
        else:
            code = _parse(textwrap.dedent(e.code), who)
            first = code.body[0]
            new = [
                first.with_changes(leading_lines=[*code.header, *first.leading_lines])
            ]
            new += code.body[1:]
        seq = [*new, anchor] if e.kind == "insert_before" else [anchor, *new]
        return up.deep_replace(anchor, cst.FlattenSentinel(seq)), _reads(*new)
    if e.kind == "replace":
        anchor = _match(target, e.anchor, who)
        new = cst.parse_expression(e.code).with_changes(
            lpar=anchor.lpar, rpar=anchor.rpar
        )
        return up.deep_replace(anchor, new), _reads(new)
    within = _match(target, e.within, who)
    els, want = list(getattr(within, "elements", ())), _shape(e.anchor, False)
    idx = [i for i, el in enumerate(els) if _shape(_code(el.value), False) == want]
    if not isinstance(within, (cst.List, cst.Tuple, cst.Set)) or len(idx) != 1:
        raise BranchError(f"{who}: {e.anchor!r} is not once an element of {e.within!r}")
    gone = els.pop(idx[0])
    if idx[0] == len(els) and els:  # it was last: the new last takes its comma
        els[-1] = els[-1].with_changes(comma=gone.comma)
    return up.deep_replace(within, within.with_changes(elements=els)), set()


def _positions(text: str) -> tuple[list[str], cst.Module, dict]:
    wrapper = MetadataWrapper(cst.parse_module(text))
    return (
        text.splitlines(keepends=True),
        wrapper.module,
        wrapper.resolve(PositionProvider),
    )


def _envs(text: str, branch: str, names: Sequence[str], who: str) -> str:
    """Add the branch's ``environment_variables`` entries ``names`` (with the
    comment lines above each) and their ``if TYPE_CHECKING:`` annotations."""
    found = []
    for src in (text, branch):
        lines, module, pos = _positions(src)
        envs = [s for s in module.body if _binds(s) == "environment_variables"]
        d, tc = envs and envs[0].body[0].value, _type_checking(module)
        if not isinstance(d, cst.Dict) or tc is None:
            raise BranchError(f"{who}: no environment_variables dict or TYPE_CHECKING")
        keys = {ast.literal_eval(_code(el.key)): el for el in d.elements}
        found.append((lines, pos, d, tc, keys, {_binds(s): s for s in tc.body.body}))
    (ul, upos, ud, utc, ukeys, _), (bl, bpos, _, _, bkeys, banns) = found
    entries, anns = [], []
    for n in names:
        if n in ukeys or n not in bkeys or n not in banns:
            where = "upstream has" if n in ukeys else "the branch's file lacks"
            raise BranchError(f"{who}: {where} {n} or its annotation")
        first = bpos[bkeys[n]].start.line
        while bl[first - 2].lstrip().startswith("#"):
            first -= 1
        entries += bl[first - 1 : bpos[bkeys[n]].end.line]
        anns += bl[bpos[banns[n]].start.line - 1 : bpos[banns[n]].end.line]
    if not isinstance(ud.elements[-1].comma, cst.Comma):
        raise BranchError(f"{who}: upstream's last environment variable has no comma")
    ul[upos[ud].end.line - 1 : upos[ud].end.line - 1] = entries
    ul[upos[utc].end.line : upos[utc].end.line] = anns
    return "".join(ul)


def _buildkite(text: str, step: str, paths: Sequence[str], who: str) -> str:
    """Add ``paths`` not covered yet to the ``source_file_dependencies`` of
    the step with key ``step`` (one ``- path`` line each, format kept)."""
    lines = text.splitlines(keepends=True)
    keys = [i for i, s in enumerate(lines) if s.strip() == f"key: {step}"]
    if len(keys) != 1:
        raise BranchError(f"{who}: step {step} found {len(keys)} times, not once")
    indent = lines[keys[0]][: -len(lines[keys[0]].lstrip())]
    i = keys[0] + 1
    while i < len(lines) and lines[i].startswith(indent):
        if lines[i] == f"{indent}source_file_dependencies:\n":
            break
        i += 1
    else:
        raise BranchError(f"{who}: step {step} has no source_file_dependencies")
    deps, i = [], i + 1
    while i < len(lines) and lines[i].startswith(f"{indent}- "):
        deps.append(lines[i].strip()[2:].strip().rstrip("/"))
        i += 1
    new = [p for p in paths if not any(p == d or p.startswith(d + "/") for d in deps)]
    lines[i:i] = [f"{indent}- {p}\n" for p in new]
    return "".join(lines)


# ---------------------------------------------------------------------- build


def _read(path: Path, who: str) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise BranchError(f"{who}: cannot read {path}: {exc}") from None


def _apply_entry(
    e: FileEntry, text: str, repo: Path, who: str, placed: set, package: str
):
    """The file's text with the entry applied, and the upstream definitions
    the branch's code in it reads (relied on)."""
    up0 = up = _parse(text, who)
    branch_text = _read(repo / e.src, f"{who}: the branch's file")
    br, bwho = _parse(branch_text, e.src), f"the branch's {e.src}"
    nodes = []
    for q in e.replace:
        old, new = _find(up, q, who), _find(br, q, bwho)
        nodes.append(new)
        up = up.deep_replace(old, new.with_changes(leading_lines=old.leading_lines))
    for q in e.drop:
        up = up.deep_replace(_find(up, q, who), cst.RemovalSentinel.REMOVE)
    for q in e.add:
        nodes.append(_find(br, q, bwho))
        up = _add(up, br, q, who)
    reads = _reads(*nodes)
    for edit in e.edits:
        up, more = _edit(up, br, edit, who)
        reads |= more
    ub, bb, wanted, relied = _bindings(up), _bindings(br), {}, set()
    for n in sorted(reads):
        b, u = bb.get(n), ub.get(n)
        if b is None or b == ("def",) and n in placed:
            continue
        if u is None and b[0] == "import":
            wanted[n] = b
        elif u != b:
            theirs = "does not define it" if u is None else f"binds it as {u}"
            raise BranchError(f"{who}: the branch's code reads {n}; upstream {theirs}")
        elif b == ("def",):
            relied.add(n)
    out = _drop_unused_imports(up0, _add_imports(up, wanted, package)).code
    return (_envs(out, branch_text, e.envs, who) if e.envs else out), relied


def _top_names(text: str) -> set[str]:
    """Names a module binds at its top level ({"*"}: it has __getattr__)."""
    names, todo = set(), list(ast.parse(text).body)
    while todo:
        s = todo.pop()
        if isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(s.name)
        elif isinstance(s, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in s.names}
        elif isinstance(s, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = s.targets if isinstance(s, ast.Assign) else [s.target]
            names |= {
                n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)
            }
        elif isinstance(s, (ast.If, ast.Try)):
            todo += s.body + s.orelse + getattr(s, "finalbody", [])
            todo += [x for h in getattr(s, "handlers", []) for x in h.body]
    return {"*"} if "__getattr__" in names else names


def _missing_import(path: str, text: str, files: dict, tree: Path, package: str):
    """The first ``from <package>... import`` in ``text`` that does not
    resolve in ``tree`` with ``files`` (path -> text) written over it."""

    def names(module: str) -> set[str] | None:
        rel = module.replace(".", "/")
        for cand in (f"{rel}.py", f"{rel}/__init__.py"):
            if cand in files or (tree / cand).is_file():
                return _top_names(files.get(cand) or _read(tree / cand, cand))
        compiled = any((tree / rel).parent.glob(f"{Path(rel).name}.*.so"))
        return {"*"} if compiled or (tree / rel).is_dir() else None

    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.ImportFrom) and not node.level:
            if node.module.split(".")[0] != package:
                continue
            if (bound := names(node.module)) is None:
                return f"{path}: imports {node.module}, which the tree lacks"
            for a in node.names:
                if (
                    not {"*", a.name} & bound
                    and names(f"{node.module}.{a.name}") is None
                ):
                    return (
                        f"{path}: imports {a.name} from {node.module}, which lacks it"
                    )
    return None


def _run(tree, version, repo, prs, source, manifest, check: bool):
    """(path -> new text, the report, {(path, name): upstream's sha256})."""
    manifest = manifest or load_manifest()
    if check:
        manifest.release(version)
    tree, repo = Path(tree), Path(repo)
    entries = manifest.entries(prs, source)
    report, hashes, texts, recorded = BranchReport(version), {}, {}, {}
    for e in manifest.files:  # a file's hashes, in whichever of its entries
        recorded.setdefault(e.path, {}).update(e.sha256.get(version, {}))

    def drift(path: str, module: cst.Module, name: str, why: str) -> None:
        who = f"vllm {version}: {path}: {name}"
        got = hashes.setdefault((path, name), source_hash(module, name, who))
        want = recorded[path].get(name)
        if check and want is None:
            raise BranchError(f"{who}: no sha256 recorded ({why})")
        if check and got != want:
            raise BranchError(
                f"{who}: upstream's source changed (sha256 {got[:12]}, the "
                f"branch was written against {want[:12]})"
            )

    for e in entries:  # every hash of upstream's own text, before any change
        who = f"vllm {version}: {e.path}"
        if (tree / e.path).exists() == e.new:
            there = "already has" if e.new else "has no"
            raise BranchError(f"{who}: the release {there} this file")
        if not e.new:
            module = _parse(texts.setdefault(e.path, _read(tree / e.path, who)), who)
            for name in sorted({*e.changed, *e.sha256.get(version, {})}):
                drift(e.path, module, name, "the branch changes it")
    placed: dict[str, set[str]] = {}  # top-level names the branch puts in a file
    for e in manifest.files:
        placed.setdefault(e.path, set()).update(
            q for q in (*e.replace, *e.add) if "." not in q
        )
    for e in entries:
        who = f"vllm {version}: {e.path}"
        if e.new:
            texts[e.path] = _read(repo / e.src, f"{who}: the branch's file")
            report.lines.append(f"{e.path}: new")
            continue
        pristine = _parse(texts[e.path], who)
        texts[e.path], relied = _apply_entry(
            e,
            texts[e.path],
            repo,
            who,
            placed[e.path],
            manifest.package,
        )
        for name in sorted(relied):
            drift(e.path, pristine, name, "the branch relies on it")
        done = [
            f"{k} {', '.join(getattr(e, k))}"
            for k in ("replace", "add", "drop", "envs")
            if getattr(e, k)
        ]
        done += [f"edit {x.inside}" for x in e.edits]
        report.lines.append(f"{e.path}: {'; '.join(done)}")
    bk = manifest.buildkite
    if source and bk and (prs is None or bk["pr"] in prs):
        upto = [p.id for p in manifest.prs]
        upto = upto[: upto.index(bk["pr"]) + 1]
        paths = sorted(
            {e.path for e in manifest.entries(upto) if e.path.startswith("vllm/")}
        )
        who = f"vllm {version}: {bk['file']}"
        texts[bk["file"]] = _buildkite(
            _read(tree / bk["file"], who), bk["step"], paths, who
        )
        report.lines.append(f"{bk['file']}: {bk['step']} source_file_dependencies")
    for path, text in texts.items():
        if path.endswith(".py"):
            try:
                compile(text, path, "exec", dont_inherit=True)
            except SyntaxError as exc:
                raise BranchError(
                    f"vllm {version}: {path}: line {exc.lineno}: {exc.msg}"
                ) from None
            if problem := _missing_import(path, text, texts, tree, manifest.package):
                raise BranchError(f"vllm {version}: {problem}")
    return texts, report, hashes


def apply_branch(
    tree: Path,
    version: str,
    *,
    repo: Path = ROOT,
    prs: Sequence[str] | None = None,
    source: bool = False,
    manifest: Manifest | None = None,
) -> BranchReport:
    """Apply the PRs ``prs`` (None: all, in order) of the branch in ``repo``
    to the unpacked release ``tree`` (with ``source``: also tests/ and
    .buildkite/). Every drift hash is checked and every file built in memory
    first; then each whole file is replaced atomically. Raises BranchError."""
    texts, report, _ = _run(tree, version, repo, prs, source, manifest, True)
    for path, text in sorted(texts.items()):
        target = Path(tree) / path
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(f".{target.name}.branch-tmp")
        tmp.write_text(text, encoding="utf-8", newline="")
        if target.exists():
            os.chmod(tmp, target.stat().st_mode & 0o7777)
        os.replace(tmp, target)
        report.written.append(path)
    return report


def release_hashes(tree: Path, version: str, manifest: Manifest | None = None) -> dict:
    """{(path, name): sha256} of every definition the branch replaces, edits
    or relies on, in the release ``tree`` (any version; nothing written)."""
    return _run(tree, version, ROOT, None, True, manifest, False)[2]


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="fork_branch", description=__doc__.split("\n")[0])
    p.add_argument("command", choices=("apply", "hashes"))
    p.add_argument("tree", type=Path)
    p.add_argument("version")
    p.add_argument("--source", action="store_true", help="a source tree")
    p.add_argument("--pr", action="append", help="only this PR (repeatable)")
    args = p.parse_args(argv)
    try:
        if args.command == "hashes":
            for (path, name), h in sorted(
                release_hashes(args.tree, args.version).items()
            ):
                print(f'{path}: sha256."{args.version}".{name} = "{h}"')
        else:
            report = apply_branch(
                args.tree, args.version, prs=args.pr, source=args.source
            )
            print("\n".join(report.lines))
    except BranchError as exc:
        print(f"fork_branch: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
