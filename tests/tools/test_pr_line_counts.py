# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""docs/pr/README.md's table of what the branch changes in vLLM 0.33.0 (per
upstream file: the definitions replaced and added, the new files, with line
counts) is the splice report of this tree, as tools/build_fork_wheel.py
writes it into ``<wheel>.splice.json``.

The report is recomputed here from the manifest, this tree and the
unpacked, untouched 0.33.0 release that the build leaves in
``build/fork/upstream`` (``$VLLM_FORK_UPSTREAM_TREE`` for another): the
same ``splice_entry`` the build runs, nothing written. Without that tree the
upstream side cannot be counted and the comparison is skipped with the
reason; the branch side (the lines of every new and replacing file) is
checked regardless.
"""

import os
import re
from pathlib import Path

import pytest

from tools import fork_splice
from tools.build_fork_wheel import ROOT, load_manifest, splice_entry

DOC = ROOT / "docs" / "pr" / "README.md"
BEGIN = "<!-- splice-report: begin (tests/tools/test_pr_line_counts.py) -->"
END = "<!-- splice-report: end -->"


def _upstream_tree() -> Path:
    tree = Path(os.environ.get("VLLM_FORK_UPSTREAM_TREE") or "build/fork/upstream")
    return tree if tree.is_absolute() else ROOT / tree


def _lines(n: int) -> str:
    return f"{n} line" if n == 1 else f"{n} lines"


def _definitions(report: fork_splice.FileReport) -> str:
    parts = []
    for d in report.definitions:
        if d.action == "replaced":
            parts.append(f"`{d.name}` {d.lines_before} -> {d.lines_after}")
        elif d.action == "added":
            parts.append(f"`{d.name}` +{d.lines_after}")
        else:
            parts.append(f"`{d.name}` unchanged")
    parts += [f"`{v}` added" for v in report.variables_added]
    return ", ".join(parts)


def render_table(reports: list[fork_splice.FileReport]) -> str:
    """The markdown table docs/pr/README.md carries between its markers."""
    rows = [
        "| upstream file (under `vllm/`) | how | lines 0.33.0 -> fork | "
        "definitions: replaced (lines 0.33.0 -> fork), added (+lines) |",
        "|---|---|---|---|",
    ]
    for r in reports:
        path = r.path.removeprefix("vllm/")
        before = str(r.lines_before) if r.mode != "new" else "(new)"
        how = {"replace": "whole file"}.get(r.mode, r.mode)
        rows.append(
            f"| `{path}` | {how} | {before} -> {r.lines_after} | {_definitions(r)} |"
        )
    return "\n".join(rows)


def _doc_table() -> str:
    text = DOC.read_text(encoding="utf-8")
    match = re.search(re.escape(BEGIN) + r"\n(.*?)\n" + re.escape(END), text, re.S)
    assert match, f"{DOC} has no block between {BEGIN!r} and {END!r}"
    return match.group(1).strip()


def test_new_and_replacing_files_have_the_line_counts_the_doc_says():
    manifest = load_manifest(ROOT / "tools" / "fork_manifest.toml")
    rows = {
        row.split("|")[1].strip().strip("`"): row.split("|")
        for row in _doc_table().splitlines()[2:]
    }
    for entry in manifest.files:
        row = rows.get(entry.path.removeprefix("vllm/"))
        assert row is not None, f"{entry.path} is not in {DOC}'s table"
        if entry.mode in ("new", "replace"):
            text = (ROOT / entry.path).read_text(encoding="utf-8")
            after = int(row[3].split("->")[1])
            assert after == len(text.splitlines()), entry.path


def test_doc_table_is_the_splice_report_of_this_tree():
    upstream = _upstream_tree()
    if not (upstream / "vllm" / "_version.py").is_file():
        pytest.skip(
            f"no unpacked vLLM 0.33.0 at {upstream} (run python "
            "tools/build_fork_wheel.py, or set VLLM_FORK_UPSTREAM_TREE)"
        )
    manifest = load_manifest(ROOT / "tools" / "fork_manifest.toml")
    reports = [splice_entry(e, ROOT, upstream)[1] for e in manifest.files]
    expected = render_table(reports)
    assert _doc_table() == expected, (
        f"{DOC}'s splice table is not this tree's splice report; the block "
        f"between its markers should read:\n{expected}"
    )
