# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Apply the branch (tools/fork_manifest.toml) to an unpacked vLLM release tree.

    python tools/fork_branch.py apply TREE VERSION [--source] [--pr ID ...]
    python tools/fork_branch.py hashes TREE VERSION  # the manifest's sha256 lines

Every drift sha256 is checked before anything is written; the rest of each
upstream file stays byte for byte.
"""

from __future__ import annotations

import ast
import os
import symtable
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import libcst as cst

import fork_cst as fc
from fork_manifest import FileEntry, Manifest, load_manifest
from tool_cli import ROOT, ToolError, command, parser

__all__ = ["BranchReport", "apply_branch", "branch_texts", "release_hashes"]
__all__ += ["top_names"]


@dataclass
class BranchReport:
    version: str
    written: list[str] = field(default_factory=list)
    lines: list[str] = field(default_factory=list)


def _read(path: Path, who: str) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ToolError(f"{who}: cannot read {path}: {exc}") from None


def _apply_entry(e: FileEntry, text: str, repo: Path, who: str, placed, package):
    """The file's text with the entry applied, and the upstream definitions
    the branch's code in it reads (relied on)."""
    up0 = up = fc.parse(text, who)
    branch_text = _read(repo / e.src, f"{who}: the branch's file")
    br, bwho = fc.parse(branch_text, e.src), f"the branch's {e.src}"
    nodes = []
    for q in e.replace:
        old, new = fc.find(up, q, who), fc.find(br, q, bwho)
        nodes.append(new)
        up = up.deep_replace(old, new.with_changes(leading_lines=old.leading_lines))
    for q in e.drop:
        up = up.deep_replace(fc.find(up, q, who), cst.RemovalSentinel.REMOVE)
    for test in e.drop_if:  # matched by structure, exactly once
        gone = fc.match(up, test, who, of_if=True)
        up = up.deep_replace(gone, cst.RemovalSentinel.REMOVE)
    for q in e.add:
        nodes.append(fc.find(br, q, bwho))
        up = fc.add_definition(up, br, q, who)
    reads = fc.reads(*nodes)
    for edit in e.edits:
        up, more = fc.edit(up, br, edit, who)
        reads |= more
    ub, bb, wanted, relied = fc.bindings(up), fc.bindings(br), {}, set()
    for n in sorted(reads):
        b, u = bb.get(n), ub.get(n)
        if b is None or b == ("def",) and n in placed:
            continue
        if u is None and b[0] == "import":
            wanted[n] = b
        elif u != b:
            theirs = "does not define it" if u is None else f"binds it as {u}"
            raise ToolError(f"{who}: the branch's code reads {n}; upstream {theirs}")
        elif b == ("def",):
            relied.add(n)
    up = fc.drop_unused_imports(up0, fc.add_imports(up, wanted, br), e.path)
    out = fc.sort_imports(up.code, e.path, package, who)
    return (fc.env_entries(out, branch_text, e.envs, who) if e.envs else out), relied


def top_names(text: str) -> set[str]:
    """Names a module binds at its top level ({"*"}: it has __getattr__)."""
    table = symtable.symtable(text, "<module>", "exec").get_symbols()
    names = {s.get_name() for s in table if s.is_assigned() or s.is_imported()}
    names |= {s.get_name() for s in table if s.is_namespace()}
    star = any(
        isinstance(n, ast.ImportFrom) and n.names[0].name == "*"
        for n in ast.walk(ast.parse(text))
    )  # `import *` is only allowed at module level
    return {"*"} if star or "__getattr__" in names else names


def _missing_import(path: str, text: str, files: dict, tree: Path, package: str):
    """The first ``from <package>... import`` in ``text`` that does not
    resolve in ``tree`` with ``files`` (path -> text) written over it."""

    def names(module: str) -> set[str] | None:
        rel = module.replace(".", "/")
        for cand in (f"{rel}.py", f"{rel}/__init__.py"):
            if cand in files or (tree / cand).is_file():
                return top_names(files.get(cand) or _read(tree / cand, cand))
        compiled = any((tree / rel).parent.glob(f"{Path(rel).name}.*.so"))
        return {"*"} if compiled or (tree / rel).is_dir() else None

    for node in ast.walk(ast.parse(text)):
        if not isinstance(node, ast.ImportFrom) or node.level:
            continue
        if node.module.split(".")[0] != package:
            continue
        if (bound := names(node.module)) is None:
            return f"{path}: imports {node.module}, which the tree lacks"
        for a in node.names:
            if not {"*", a.name} & bound and names(f"{node.module}.{a.name}") is None:
                return f"{path}: imports {a.name} from {node.module}, which lacks it"
    return None


def _run(tree, version, repo, prs, source, manifest, check: bool):
    """(path -> new text, the report, {(path, name): upstream's sha256})."""
    manifest = manifest or load_manifest()
    if check:
        manifest.release(version)
    tree, repo = Path(tree), Path(repo)
    report, hashes, texts, recorded = BranchReport(version), {}, {}, {}
    placed: dict[str, set[str]] = {}  # top-level names the branch puts in a file
    for e in manifest.files:  # a file's hashes, in whichever of its entries
        recorded.setdefault(e.path, {}).update(e.sha256.get(version, {}))
        placed.setdefault(e.path, set()).update(
            q for q in (*e.replace, *e.add) if "." not in q
        )

    def drift(path: str, text: str, names, why: str) -> None:
        module = fc.parse(text, path) if names else None
        for name in sorted(names):
            who = f"vllm {version}: {path}: {name}"
            got = hashes.setdefault((path, name), fc.source_hash(module, name, who))
            want = recorded[path].get(name)
            if check and want is None:
                raise ToolError(f"{who}: no sha256 recorded ({why})")
            if check and got != want:
                raise ToolError(
                    f"{who}: upstream's source changed (sha256 {got[:12]}, the "
                    f"branch was written against {want[:12]})"
                )

    entries, why = manifest.entries(prs, source, version), "the branch changes it"
    # definitions an entry adds are the branch's: a later edit of one is no drift
    ours = {(x.path, q.split(".")[0]) for x in entries for q in x.add if "." not in q}
    for e in entries:  # every hash of upstream's own text, before any change
        if (tree / e.path).exists() == e.new:
            there = "already has this file" if e.new else "has no such file"
            raise ToolError(f"vllm {version}: {e.path}: the release {there}")
        if not e.new:
            text = texts.setdefault(e.path, _read(tree / e.path, f"vllm {version}"))
            names = {*e.changed, *e.sha256.get(version, {})}
            names = {n for n in names if (e.path, n) not in ours}
            drift(e.path, text, names, why)
    pristine = dict(texts)
    for e in entries:
        who = f"vllm {version}: {e.path}"
        if e.new:
            texts[e.path] = _read(repo / e.src, f"{who}: the branch's file")
            report.lines.append(f"{e.path}: new")
            continue
        texts[e.path], relied = _apply_entry(
            e, texts[e.path], repo, who, placed[e.path], manifest.package
        )
        drift(e.path, pristine[e.path], relied, "the branch relies on it")
        done = [
            f"{k} {', '.join(getattr(e, k))}"
            for k in ("replace", "add", "drop", "drop_if", "envs")
            if getattr(e, k)
        ]
        done += [f"edit {x.inside}" for x in e.edits]
        report.lines.append(f"{e.path}: {'; '.join(done)}")
    bk = manifest.buildkite
    if source and bk:
        paths = {e.path for e in manifest.entries(prs, version=version)}
        who = f"vllm {version}: {bk['file']}"
        old = _read(tree / bk["file"], who)
        new = fc.buildkite_dependencies(old, bk["step"], sorted(paths), who)
        if new != old:
            texts[bk["file"]] = new
            report.lines.append(f"{bk['file']}: {bk['step']} source_file_dependencies")
    for path, text in texts.items():
        if path.endswith(".py"):
            try:
                compile(text, path, "exec", dont_inherit=True)
            except SyntaxError as exc:
                where = f"vllm {version}: {path}: line {exc.lineno}"
                raise ToolError(f"{where}: {exc.msg}") from None
            if problem := _missing_import(path, text, texts, tree, manifest.package):
                raise ToolError(f"vllm {version}: {problem}")
    return texts, report, hashes


def branch_texts(
    tree: Path, version: str, *, repo=ROOT, prs=None, source=False, manifest=None
) -> dict[str, str]:
    """What :func:`apply_branch` would write (path -> text), nothing written."""
    return _run(tree, version, repo, prs, source, manifest, True)[0]


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
    first; then each whole file is replaced atomically. Raises ToolError."""
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


def release_hashes(tree: Path, version: str, manifest=None, source=False) -> dict:
    """{(path, name): sha256} of every definition the branch replaces, edits
    or relies on, in the release ``tree`` (any version; nothing written)."""
    return _run(tree, version, ROOT, None, source, manifest, False)[2]


def main(argv: Sequence[str] | None = None) -> int:
    p = parser(__doc__, releases=False)
    p.prog = "fork_branch"
    p.add_argument("command", choices=("apply", "hashes"))
    p.add_argument("tree", type=Path, help="the unpacked release")
    p.add_argument("version", help="its version")
    p.add_argument("--source", action="store_true", help="a source tree")
    p.add_argument("--pr", action="append", help="only this PR (repeatable)")
    args = p.parse_args(argv)

    def body() -> None:
        if args.command == "hashes":
            found = release_hashes(args.tree, args.version, source=args.source)
            for (path, name), h in sorted(found.items()):
                print(f'{path}: sha256."{args.version}".{name} = "{h}"')
        else:
            report = apply_branch(
                args.tree, args.version, prs=args.pr, source=args.source
            )
            print("\n".join(report.lines))

    return command("fork_branch", body)


if __name__ == "__main__":
    sys.exit(main())
