# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Ctrl-C ends ``vllm bench moe-weight-prep`` with one line and status 130:
no traceback (from the job or its worker and busy processes), no leaked
semaphore warning, no partial output file."""

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.sigint import reset_sigint_in_child, sigint_raises_keyboard_interrupt

ROOT = Path(__file__).resolve().parents[2]
PROG = "vllm bench moe-weight-prep"


def _env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    return env


def _lines(text: str) -> list[str]:
    # The progress bar redraws itself with carriage returns.
    return [s for s in text.replace("\r", "\n").splitlines() if s.strip()]


CASES = {
    "tp1 busy core": ["--busy-cores", "1"],
    "tp2": ["--tp", "2"],
}


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(CASES))
def test_ctrl_c_during_the_run_is_one_line_and_status_130(case, tmp_path):
    out_json, out_png = tmp_path / "r.json", tmp_path / "p.png"
    cmd = [
        sys.executable,
        "-m",
        "vllm.entrypoints.cli.main",
        *PROG.split()[1:],
        "--model",
        "qwen3.6-35b-a3b",
        *CASES[case],
        "--json",
        str(out_json),
        "--plot",
        str(out_png),
    ]
    # A session of its own: Ctrl-C in a terminal reaches the whole process
    # group (the job, its ranks and busy processes), as killpg does here.
    # SIGINT at its default in the job, which ignores it when inherited so.
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=_env(),
        start_new_session=True,
        preexec_fn=reset_sigint_in_child,
    )
    err: list[bytes] = []
    reader = threading.Thread(
        target=lambda: err.extend(iter(lambda: proc.stderr.read1(4096), b"")),
        daemon=True,
    )
    reader.start()
    try:
        deadline = time.monotonic() + 240
        # The progress bar's first draw: the layers are being prepared.
        while b"layer" not in b"".join(err):
            assert proc.poll() is None, b"".join(err).decode()
            assert time.monotonic() < deadline, "the run did not start"
            time.sleep(0.1)
        os.killpg(proc.pid, signal.SIGINT)
        # Not communicate(): the reader thread alone reads stderr (two
        # readers would split its bytes between them). Generous: stopping
        # the ranks and busy processes takes seconds on a loaded machine.
        proc.wait(timeout=180)
        out = proc.stdout.read()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    reader.join(10)
    text = b"".join(err).decode()
    assert proc.returncode == 130, text
    lines = [s for s in _lines(text) if "layer" not in s]  # bar lines dropped
    assert lines == [f"{PROG}: interrupted"], text
    assert "Traceback" not in text and "leaked" not in text, text
    assert not out.strip()  # no report of a partial run
    assert not out_json.exists() and not out_png.exists()


def test_ctrl_c_while_importing_exits_at_once_quietly():
    # Ctrl-C before the job has started anything (torch still importing):
    # a KeyboardInterrupt there would leave modules half-imported.
    code = (
        "import os, signal, time\n"
        "from vllm.entrypoints.cli.main import _sigint_exits_at_once\n"
        "with _sigint_exits_at_once():\n"
        "    os.kill(os.getpid(), signal.SIGINT)\n"
        "    time.sleep(30)\n"
        "print('not reached')\n"
    )
    # Where SIGINT is inherited as ignored the job leaves it so (a
    # background job's Ctrl-C is not its own): reset it, as a terminal has it.
    result = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env=_env(),
        timeout=180,
        preexec_fn=reset_sigint_in_child,
    )
    assert result.returncode == 130
    assert result.stderr == "vllm: interrupted\n" and result.stdout == ""


def test_ctrl_c_outside_the_import_is_a_keyboard_interrupt_again():
    # Control: after the import the handler is Python's own again, so the
    # job's cleanup (stopping ranks, busy processes) runs in its finally.
    # Python's handler first, as a terminal's process has it (a background
    # pytest inherits SIGINT ignored, and then the job rightly changes nothing).
    from vllm.entrypoints.cli.main import _sigint_exits_at_once

    with sigint_raises_keyboard_interrupt():
        with _sigint_exits_at_once():
            assert signal.getsignal(signal.SIGINT) is not signal.default_int_handler
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_ctrl_c_ignored_on_entry_stays_ignored_through_the_import():
    # Control: a job started with SIGINT ignored (nohup, `&`) keeps it so.
    from vllm.entrypoints.cli.main import _sigint_exits_at_once

    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        with _sigint_exits_at_once():
            assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, previous)
