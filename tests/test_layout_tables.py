# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The layout tables of the README and the design page name paths that
exist: a row's first cell lists paths in backquotes, the first from its
table's root, the ones after it without a ``/`` beside the first."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DESIGN = ROOT / "docs" / "design" / "nvfp4_moe_weight_preparation.md"
MODULES = ROOT / "vllm" / "model_executor" / "layers"


def _table_after(text: str, heading: str) -> list[str]:
    """The rows (first cells) of the first table after ``heading``."""
    rest = text[text.index(heading) :]
    rows = re.search(r"\n(\|[^\n]*\|\n)+", rest)
    assert rows, f"no table after {heading!r}"
    cells = [line.split("|")[1] for line in rows.group(0).strip().splitlines()]
    return [c for c in cells[2:] if "`" in c]  # past the header and the rule


def _paths(cell: str, root: Path) -> list[Path]:
    names = re.findall(r"`([^`]+)`", cell)
    first = root / names[0]
    return [first] + [first.parent / n if "/" not in n else root / n for n in names[1:]]


def _missing(cells: list[str], root: Path) -> list[str]:
    return [str(p) for c in cells for p in _paths(c, root) if not p.exists()]


@pytest.mark.parametrize(
    "doc,heading,root",
    [
        (ROOT / "README.md", "## Layout", ROOT),
        (DESIGN, "## The preparation's state, and recovery", MODULES),
    ],
    ids=["readme", "design-page"],
)
def test_layout_table_names_paths_that_exist(doc, heading, root):
    cells = _table_after(doc.read_text(encoding="utf-8"), heading)
    assert len(cells) >= 6
    assert _missing(cells, root) == []


def test_a_path_the_tree_lacks_is_reported():
    cells = ["`vllm/envs.py`, `no_such_module.py`", "`tests/nowhere/`"]
    assert _missing(cells, ROOT) == [
        str(ROOT / "vllm" / "no_such_module.py"),
        str(ROOT / "tests" / "nowhere"),
    ]
