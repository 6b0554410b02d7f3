# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The README's Python snippet runs as written and prints what its comments
say; the README's code is ruff-formatted."""

import contextlib
import io
import re
import shutil
import subprocess
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"


def _python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def test_loading_snippet_runs_and_prints_what_it_says(tmp_path, monkeypatch):
    from vllm.model_executor.model_loader.nvfp4_checkpoint_writer import main

    (snippet,) = _python_blocks()
    monkeypatch.chdir(tmp_path)
    # The README's own instruction for the example checkpoint.
    main(["example-ckpt", "--format", "compressed-tensors"])
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(snippet, "README.md", "exec"), {})
    printed = out.getvalue().splitlines()
    promised = [
        line.split("# ", 1)[1].split(":")[0]
        for line in snippet.splitlines()
        if line.startswith("print(")
    ]
    assert printed == promised


@pytest.mark.skipif(shutil.which("ruff") is None, reason="ruff is not installed")
def test_readme_code_is_ruff_formatted():
    result = subprocess.run(
        ["ruff", "format", "--check", str(README)], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout + result.stderr
