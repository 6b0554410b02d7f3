# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""docs/pr/: each PR page lists the files its PR adds or changes, and quotes
`tools/fork_branch.py diff`'s numbers for the definitions it changes; the
series page's table is the report (the last two need the releases:
tests/tools/release_trees.py)."""

import re

import pytest

from tests.tools.release_trees import release_texts

from fork_branch import BEGIN, END, diff_rows, quote, render
from fork_manifest import load_manifest
from tool_cli import ROOT

MANIFEST = load_manifest()
SERIES = ROOT / "docs" / "pr" / "README.md"
QUOTE = re.compile(r"`\w+` in [\d.]+: \d+ of its \d+ lines kept, \+\d+ -\d+")


def _page(pr) -> str:
    return (ROOT / pr.doc).read_text(encoding="utf-8")


@pytest.mark.parametrize("pr", MANIFEST.prs, ids=lambda p: p.id)
def test_each_page_lists_its_prs_files(pr):
    files = {}
    for e in MANIFEST.files:
        if e.pr == pr.id:
            files.setdefault(e.path, "new" if e.new else "edited")
    if MANIFEST.buildkite and MANIFEST.buildkite["pr"] == pr.id:
        files[MANIFEST.buildkite["file"]] = "edited"
    section = _page(pr).split("\n## Files\n", 1)[-1]
    listed = dict(re.findall(r"^- `([^`]+)` \((new|edited)\)$", section, re.M))
    assert listed == files


@pytest.fixture(scope="module", params=list(MANIFEST.releases))
def rows(request):
    tree, texts = release_texts(request.param)
    return diff_rows(tree, request.param, texts)


def test_the_pages_quote_the_diff_report(rows):
    owner = {}
    for e in MANIFEST.entries():
        for name in e.changed:
            owner.setdefault(name, e.pr)
    for pr in MANIFEST.prs:
        mine = [quote(r) for r in rows if owner[r[1]] == pr.id]
        text = " ".join(_page(pr).split())  # a quote may wrap
        for line in mine:
            assert line in text, f"{pr.doc} should say: {line}"
        version = rows[0][0]
        stale = {q for q in QUOTE.findall(text) if f" in {version}:" in q} - set(mine)
        assert not stale, f"{pr.doc} quotes numbers the report does not give: {stale}"


def test_the_series_page_holds_the_report(rows):
    text = SERIES.read_text(encoding="utf-8")
    table = text.split(BEGIN, 1)[1].split(END, 1)[0].strip()
    version = rows[0][0]
    ours = [ln for ln in table.splitlines() if ln.startswith(f"| {version} |")]
    assert ours == render(rows).splitlines()[2:]
