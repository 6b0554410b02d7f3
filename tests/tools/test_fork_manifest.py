# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""tools/fork_manifest.toml against this tree, without a release: the PRs are
cut so each imports only itself and earlier PRs, the edits' new code is the
branch's files' own, and what ships speaks of vLLM only."""

import ast
import dataclasses
import re

import pytest

import fork_manifest
from fork_cst import _is_expression, bindings, code, find, match, parse, reads
from fork_manifest import Release, load_manifest
from tool_cli import ROOT, ToolError

MANIFEST = load_manifest()
PRS = [p.id for p in MANIFEST.prs]


def _module_of(path: str) -> str:
    return path.removesuffix(".py").removesuffix("/__init__").replace("/", ".")


def _shipped(entry):
    """(definition or file, its text) of what the entry puts in the release."""
    branch = (ROOT / entry.src).read_text(encoding="utf-8")
    if entry.new:
        return [(entry.path, branch)]
    module = parse(branch, entry.src)
    out = [
        (q, module.code_for_node(find(module, q, entry.src)))
        for q in (*entry.replace, *entry.add)
    ]
    return out + [(e.inside, e.code) for e in entry.edits if e.code]


def _imports(entry) -> set[tuple[str, str]]:
    """(module, name) the entry's shipped code imports from vllm."""
    if entry.new:
        tree = ast.parse((ROOT / entry.src).read_text(encoding="utf-8"))
        return {
            (n.module, a.name)
            for n in ast.walk(tree)
            if isinstance(n, ast.ImportFrom) and (n.module or "").startswith("vllm")
            for a in n.names
        }
    module = parse((ROOT / entry.src).read_text(encoding="utf-8"), entry.src)
    names = reads(*(find(module, q, entry.src) for q in (*entry.replace, *entry.add)))
    binds = bindings(module)
    return {
        binds[n][1:]
        for n in names
        if n in binds and binds[n][0] == "import" and binds[n][1].startswith("vllm")
    }


def _order_problems(files) -> tuple[list[str], int]:
    # a name the release has (replaced later or not) is there for every PR
    new_in = {_module_of(e.path): e.pr for e in files if e.new}
    placed_in = {
        (_module_of(e.path), q): e.pr
        for e in files
        if not e.new
        for q in e.add
        if "." not in q
    }
    problems, checked = [], 0
    for entry in files:
        for module, name in sorted(_imports(entry)):
            checked += 1
            owner = new_in.get(module) or placed_in.get((module, name))
            if owner and PRS.index(owner) > PRS.index(entry.pr):
                problems.append(
                    f"{entry.path} ({entry.pr}) imports {module}.{name} of {owner}"
                )
    return problems, checked


def test_each_pr_imports_only_itself_and_earlier_prs():
    problems, checked = _order_problems(MANIFEST.files)
    assert checked > 20, "the check found almost no imports: it is not looking"
    assert problems == []


def test_each_pr_reads_only_variables_of_itself_and_earlier_prs():
    added = {v: e.pr for e in MANIFEST.files for v in e.envs}
    read = 0
    for entry in MANIFEST.files:
        for where, text in _shipped(entry):
            for var in set(re.findall(r"\bVLLM_[A-Z0-9_]+", text)) & set(added):
                read += 1
                owner = added[var]
                assert PRS.index(owner) <= PRS.index(entry.pr), (
                    f"{where} reads {var} of {owner}"
                )
    assert read >= len(added), "fewer reads than variables: the check is not looking"


def test_a_file_moved_to_an_earlier_pr_is_caught():
    # the swizzle's test imports swizzle_blockscale_, which its own PR adds
    test = "tests/kernels/moe/test_flashinfer_fp4_moe_swizzle.py"
    files = [
        dataclasses.replace(e, pr=PRS[0]) if e.path == test else e
        for e in MANIFEST.files
    ]
    problems, _ = _order_problems(files)
    assert any(p.startswith(f"{test} ({PRS[0]}) imports ") for p in problems), problems


def test_the_edits_new_code_is_the_branch_files_own():
    checked = 0
    order = [pr.id for pr in MANIFEST.prs]
    for entry in (e for e in MANIFEST.files if e.edits and not e.releases):
        module = parse((ROOT / entry.src).read_text(encoding="utf-8"), entry.src)
        # an earlier PR's replacement of a definition is what its file holds;
        # a later PR's edit of it is the manifest's code alone
        earlier = {
            q
            for e in MANIFEST.files
            if e.path == entry.path and order.index(e.pr) < order.index(entry.pr)
            for q in e.replace
        }
        for edit in entry.edits:
            if edit.inside.split(".")[0] not in bindings(module):
                continue  # the branch's file lacks it: the manifest's code alone
            if edit.inside in earlier:
                continue
            inside, who = find(module, edit.inside, entry.src), entry.src
            checked += 1
            if edit.kind == "decorate":
                assert edit.anchor in [code(d.decorator) for d in inside.decorators]
            elif edit.kind == "replace" and _is_expression(edit.anchor):
                match(inside, edit.code, f"the branch's {who}")
            elif edit.code:
                for stmt in parse(edit.code, "code").body:
                    match(inside, code(stmt), who, statement=True)
    assert checked, "no edit's code was looked for"


FORBIDDEN = re.compile(
    r"this tree|the slice|this repository|stand[- ]in|\btests/", re.I
)


@pytest.mark.parametrize(
    "entry",
    [e for e in MANIFEST.files if e.path.startswith("vllm/")],
    ids=lambda e: f"{e.pr}:{e.path.rsplit('/', 1)[1]}",
)
def test_what_ships_speaks_of_vllm_only(entry):
    for where, text in _shipped(entry):
        for i, line in enumerate(text.splitlines(), 1):
            assert not FORBIDDEN.search(line), (
                f"{entry.src}: {where}: line {i}: {line.strip()}"
            )


def test_every_file_and_page_the_manifest_names_exists():
    for entry in MANIFEST.files:
        assert (ROOT / entry.src).is_file(), entry.src
    for pr in MANIFEST.prs:
        assert (ROOT / pr.doc).is_file(), pr.doc
    assert set(MANIFEST.releases) == {"0.34.0", "0.33.0"}
    for version in MANIFEST.releases:  # a file's hashes, in any of its entries
        entries = MANIFEST.entries(source=True, version=version)
        hashed = {(e.path, n) for e in entries for n in e.sha256.get(version, {})}
        ours = {(e.path, q) for e in entries for q in e.add if "." not in q}
        changed = {(e.path, n) for e in entries for n in e.changed}
        assert changed - ours <= hashed, version


def test_a_wheel_is_downloaded_for_its_own_tag(tmp_path, monkeypatch):
    ran = []
    monkeypatch.setattr(fork_manifest, "run", lambda cmd, *a, **k: ran.append(cmd))
    name = "vllm-9.0.0-cp38-abi3-manylinux_2_28_x86_64.whl"
    with pytest.raises(ToolError, match="pip download vllm==9.0.0 wrote no"):
        Release("9.0.0", name, "0" * 64).fetch("wheel", tmp_path)
    (cmd,) = ran
    assert cmd[3:] == [
        "download", "-q", "--no-deps", "-d", str(tmp_path), "vllm==9.0.0",
        "--only-binary", ":all:", "--implementation", "cp",
        "--python-version", "38", "--abi", "abi3",
        "--platform", "manylinux_2_28_x86_64", "--ignore-requires-python",
    ]  # fmt: skip
