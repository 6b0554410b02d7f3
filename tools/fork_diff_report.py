# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Lines kept, added and removed in each upstream definition the branch changes.

    python tools/fork_diff_report.py [--release V] [--tree DIR]

Per release (its unpacked tree: --tree, default build/fork/<V>/upstream) and
per definition the branch replaces or edits (a class, for member changes):
upstream's lines, and the branch's diff against them (difflib), as the
Markdown table the PR pages quote.
"""

from __future__ import annotations

import argparse
import difflib
import sys
from collections.abc import Sequence
from pathlib import Path

try:
    from tools.fork_branch import (
        ROOT,
        BranchError,
        branch_texts,
        definition_source,
        load_manifest,
    )
except ImportError:  # run as `python tools/fork_diff_report.py`
    from fork_branch import (
        ROOT,
        BranchError,
        branch_texts,
        definition_source,
        load_manifest,
    )

__all__ = ["BEGIN", "END", "HEADER", "diff_rows", "main", "quote", "render"]

#: docs/pr/README.md holds the table between these markers.
BEGIN, END = "<!-- diff-report:begin -->", "<!-- diff-report:end -->"

HEADER = (
    "| release | definition (file) | upstream lines | kept | added | removed |\n"
    "|---|---|---|---|---|---|"
)


def diff_rows(tree: Path, version: str, texts: dict | None = None) -> list[tuple]:
    """(version, definition, path, upstream lines, kept, added, removed) per
    definition the branch replaces or edits, in the manifest's order
    (``texts``: :func:`branch_texts` of ``tree``, if already made)."""
    manifest = load_manifest()
    texts = texts or branch_texts(tree, version, manifest=manifest)
    rows = []
    for e in manifest.entries(version=version):
        for name in e.changed:
            up = (tree / e.path).read_text(encoding="utf-8")
            old = definition_source(up, name, e.path).splitlines()
            new = definition_source(texts[e.path], name, e.path).splitlines()
            match = difflib.SequenceMatcher(None, old, new, autojunk=False)
            kept = sum(b.size for b in match.get_matching_blocks())
            rows.append(
                (
                    version,
                    name,
                    e.path,
                    len(old),
                    kept,
                    len(new) - kept,
                    len(old) - kept,
                )
            )
    return rows


def quote(row: tuple) -> str:
    """How a PR page quotes one row."""
    v, name, _, n, kept, added, removed = row
    return f"`{name}` in {v}: {kept} of its {n} lines kept, +{added} -{removed}"


def render(rows: list[tuple]) -> str:
    lines = [HEADER]
    for v, name, path, n, kept, added, removed in rows:
        file = path.removeprefix("vllm/model_executor/layers/")
        lines.append(
            f"| {v} | `{name}` ({file}) | {n} | {kept} | +{added} | -{removed} |"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="fork_diff_report", description=__doc__.split("\n")[0]
    )
    p.add_argument("--release", action="append", help="only this release (repeatable)")
    p.add_argument("--tree", type=Path, help="the unpacked release (one --release)")
    args = p.parse_args(argv)
    try:
        rows = []
        for v in args.release or list(load_manifest().releases):
            tree = args.tree or ROOT / "build" / "fork" / v / "upstream"
            rows += diff_rows(tree, v)
    except (BranchError, OSError) as exc:
        print(f"fork_diff_report: error: {exc}", file=sys.stderr)
        return 2
    print(render(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
