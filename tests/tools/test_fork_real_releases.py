# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The real manifest applied to the real vLLM 0.34.0 and 0.33.0 trees (opt-in:
tests/tools/release_trees.py finds them, or skips; with
VLLM_FORK_RELEASE_TREES set a missing one fails)."""

import difflib
import os
import shutil
import subprocess
import sys

import pytest

from tests.tools.release_trees import release_texts

from fork_branch import branch_texts, release_hashes
from fork_cst import definition_source
from fork_manifest import load_manifest
from tool_cli import ToolError

pytestmark = pytest.mark.slow  # about 40 s per release on 2 cores

MANIFEST = load_manifest()
ORACLE = "vllm/model_executor/layers/fused_moe/oracle/nvfp4.py"


@pytest.fixture(scope="module", params=list(MANIFEST.releases))
def release(request):
    return request.param, *release_texts(request.param)


def test_every_file_compiles_and_the_hashes_are_the_releases(release):
    version, tree, texts = release
    for path, text in texts.items():
        compile(text, path, "exec", dont_inherit=True)
    recorded = {}
    for e in MANIFEST.entries():  # the wheel's files (tests/ are source-only)
        recorded.update({(e.path, n): h for n, h in e.sha256.get(version, {}).items()})
    assert release_hashes(tree, version) == recorded


def test_make_nvfp4_moe_quant_config_is_a_one_line_edit(release):
    version, tree, texts = release
    old = definition_source((tree / ORACLE).read_text(), "make_nvfp4_moe_quant_config")
    new = definition_source(texts[ORACLE], "make_nvfp4_moe_quant_config")
    changed = [
        ln
        for ln in difflib.unified_diff(
            old.splitlines(), new.splitlines(), lineterm="", n=0
        )
        if ln[:1] in "+-" and not ln.startswith(("+++", "---"))
    ]
    assert len(changed) == 2, changed
    assert "FLASHINFER_B12X" in changed[1]
    if version == "0.34.0":  # upstream's in-place refill kept
        for name in ("_a1_gscale", "_a2_gscale"):
            assert f'refill_derived(layer, "{name}", ' in new


def test_each_pr_prefix_builds_on_its_own(release):
    version, tree, _ = release
    # imports resolving in the release with PR 1 alone is checked by branch_texts
    pr = MANIFEST.prs[0].id
    first = branch_texts(tree, version, prs=[pr])
    assert set(first) == {e.path for e in MANIFEST.entries([pr])}
    assert ORACLE not in first and "swizzle_blockscale_(" not in str(first)


def test_edited_files_are_lint_clean_as_upstream_formats(release, tmp_path):
    version, _, texts = release
    edited = {e.path for e in MANIFEST.entries() if not e.new}
    paths = [p for p in texts if p.endswith(".py") and p in edited]
    for path in paths:
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text(texts[path])
    ruff = [sys.executable, "-m", "ruff"]
    select = ["--isolated", "--select", "F401,F811,F821,I001"]
    select += ["--config", "lint.isort.known-first-party = ['vllm']"]
    for cmd in (
        [*ruff, "check", *select, *paths],
        [*ruff, "format", "--isolated", "--check", *paths],
    ):
        done = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True)
        assert done.returncode == 0, done.stdout + done.stderr


def test_a_planted_line_in_a_copy_of_the_release_stops_it(release, tmp_path):
    version, tree, _ = release
    copy = tmp_path / "release"
    shutil.copytree(tree / "vllm", copy / "vllm", copy_function=os.link)
    path = copy / ORACLE
    text = path.read_text()
    path.unlink()  # a new file, not the hard-linked release's
    path.write_text(
        text.replace("a2_gscale=a2_gscale,", "a2_gscale=a1_gscale,", 1).replace(
            "a2_gscale=(1.0 / a2_scale),", "a2_gscale=(1.0 / a1_scale),", 1
        )
    )
    assert path.read_text() != text
    with pytest.raises(ToolError) as info:
        branch_texts(copy, version)
    where = f"vllm {version}: {ORACLE}: make_nvfp4_moe_quant_config"
    assert str(info.value).startswith(f"{where}: upstream's source changed")
