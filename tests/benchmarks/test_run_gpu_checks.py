# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""benchmarks/run_gpu_checks.sh runs on the lent GPU machine as it is: only
``python3`` there (no ``python``), from the repository root, every part's
status recorded. Run here with stand-ins for the interpreter."""

import os
import stat
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "run_gpu_checks.sh"
PARTS = ["device", "pytest_cuda", "reorder_cuda", "prep_cuda", "steps_cpu"]


def _shim(directory: Path, name: str, body: str) -> None:
    path = directory / name
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(path.stat().st_mode | stat.S_IEXEC)


def _run(tmp_path: Path, python3_rc: int) -> tuple[subprocess.CompletedProcess, str]:
    shims = tmp_path / "bin"
    shims.mkdir()
    # python3 logs its working directory and arguments; a bare `python`
    # (absent on the GPU machine) fails loudly.
    log = f'echo "$PWD $*" >> "{tmp_path}/calls"\n'
    _shim(shims, "python3", f"{log}exit {python3_rc}\n")
    _shim(shims, "python", "echo 'python: command not found' >&2\nexit 127\n")
    env = dict(os.environ, PATH=f"{shims}:/usr/bin:/bin", OUT=str(tmp_path / "out"))
    done = subprocess.run(
        ["bash", str(SCRIPT)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    return done, (tmp_path / "out" / "status.txt").read_text()


def test_gpu_checks_use_python3_from_the_root_and_record_every_part(tmp_path):
    done, status = _run(tmp_path, 0)
    assert status.splitlines() == [f"{p} rc=0" for p in PARTS], status
    assert done.returncode == 0, done.stdout + done.stderr
    calls = (tmp_path / "calls").read_text().splitlines()
    assert len(calls) == len(PARTS)
    # Run from the repository root, whatever the caller's directory.
    assert all(c.startswith(f"{ROOT} ") for c in calls), calls


def test_a_failing_part_is_recorded_and_fails_the_run(tmp_path):
    done, status = _run(tmp_path, 3)
    assert status.splitlines() == [f"{p} rc=3" for p in PARTS], status
    assert done.returncode != 0
