# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The README's Python snippet runs as written and prints what its comments
say; the README's code is ruff-formatted; its vLLM 0.33.0 command names the
files it uses."""

import contextlib
import io
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"


def _python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def _marked_bash_block(marker: str) -> str:
    """The bash block after ``<!-- marker -->``, as .ci/run reads test-command."""
    found = re.search(
        rf"<!-- {marker} -->\s*```bash\n(.*?)```", README.read_text(), flags=re.S
    )
    assert found, f"README.md has no bash block after <!-- {marker} -->"
    return found.group(1)


def test_fork_command_builds_the_fork_wheels_with_only_the_tools_libraries():
    (command,) = _marked_bash_block("fork-command").strip().splitlines()
    steps = [step.strip() for step in command.split("&&")]
    assert steps[-1] == "python tools/build_fork_wheel.py"
    assert "pip install libcst packaging wheel ruff==0.17.2" in steps
    assert "torch" not in command


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


def test_upstream_command_installs_files_that_exist_and_runs_tests_upstream_alone():
    text = README.read_text()
    block = text.split("<!-- upstream-command -->", 1)[1]
    command = re.search(r"```bash\n(.*?)\n```", block, flags=re.S).group(1)
    assert "\n" not in command  # one command
    for requirements in re.findall(r"-r (\S+)", command):
        assert (ROOT / requirements).is_file(), requirements
    # Run from its own directory (its pytest.ini), not from the root, whose
    # pythonpath would put this tree's vllm/ ahead of the installed wheel;
    # once per release, each fork wheel installed in turn.
    assert "for v in 0.34.0 0.33.0;" in command
    assert "(cd tests/upstream && VLLM_UPSTREAM_RELEASE=$v python -m pytest)" in command
    assert (ROOT / "tests/upstream/pytest.ini").is_file()
    # The skip reason of tests/upstream points at this section.
    title = "## Tests inside vLLM 0.34.0 and 0.33.0 (CPU)"
    assert f"\n{title}\n" in text
    assert title in (ROOT / "tests/upstream/upstream_env.py").read_text()
    upstream_reqs = (ROOT / "requirements/upstream-cpu.txt").read_text()
    assert not re.search(r"^vllm\b", upstream_reqs, flags=re.M | re.I)


def test_quantizers_command_builds_its_venv_and_runs_tests_quantizers():
    (command,) = _marked_bash_block("quantizers-command").strip().splitlines()
    steps = [step.strip() for step in command.split("&&")]
    assert steps[0] == "python3 -m venv .venv-quantizers"
    # torch alone first, from the CPU requirements, so pip keeps the CPU build.
    assert steps[2] == "pip install --no-deps -r requirements/cpu-torch.txt"
    for requirements in re.findall(r"-r (\S+)", command):
        assert (ROOT / requirements).is_file(), requirements
    assert steps[-1] == "pytest tests/quantizers"
    assert ".venv-quantizers/" in (ROOT / ".gitignore").read_text().splitlines()
    quantizers = (ROOT / "requirements/quantizers-cpu.txt").read_text()
    assert re.search(r"^-r cpu\.txt$", quantizers, flags=re.M)  # the torch pin
    # The skip reason of tests/quantizers points at this section.
    from tests.quantizers.quantizer_env import QUANTIZERS_COMMAND

    title = "## Checkpoints from the real quantizers (CPU)"
    assert f"\n{title}\n" in README.read_text()
    assert title in QUANTIZERS_COMMAND


@pytest.mark.skipif(
    shutil.which("git") is None or not (ROOT / ".git").exists(),
    reason="not a git checkout",
)
def test_what_the_readme_commands_write_is_ignored_by_git():
    # Run as written from the root, the README's commands leave nothing
    # untracked (w4a16-ckpt/ was, beside the ignored example-ckpt/).
    text = README.read_text()
    written = re.findall(r"nvfp4_checkpoint_writer (\S+)", text)
    written += re.findall(r"--(?:plot|json) (\S+)", text)
    assert "example-ckpt" in written and "w4a16-ckpt" in written, written
    for path in written:
        probe = f"{path}/model.safetensors.index.json" if "." not in path else path
        result = subprocess.run(["git", "check-ignore", "-q", probe], cwd=ROOT)
        assert result.returncode == 0, f"{path} is not ignored by .gitignore"
