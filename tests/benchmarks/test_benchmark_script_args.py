# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The benchmark scripts under benchmarks/ refuse bad counts and sizes with
one-line argparse errors (exit 2) before anything runs, like the main job."""

import importlib.util
import sys
from pathlib import Path

import pytest

from vllm.utils.argparse_utils import available_cores

SCRIPTS = Path(__file__).resolve().parents[2] / "benchmarks" / "kernels"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"_bench_{name}", SCRIPTS / name)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _never(*args, **kwargs):
    raise AssertionError("the benchmark started despite a bad argument")


STEPS = "benchmark_moe_weight_prep_steps.py"
REORDER = "benchmark_reorder_w1w3.py"
PARTS = "benchmark_w4a16_repack_parts.py"
# Functions each script calls first once its arguments are parsed.
ENTRY_POINTS = {
    STEPS: ["busy_cores", "synthetic_layer_tensors", "get_preset"],
    REORDER: ["busy_cores", "bench_model", "tile_sweep"],
    PARTS: ["busy_cores", "get_preset"],
}
TOO_MANY = str(available_cores() + 1)
BAD = {
    "steps busy cores -1": (
        STEPS,
        ["--busy-cores", "-1"],
        "--busy-cores: must be at least 0, got -1",
    ),
    "steps busy cores too many": (
        STEPS,
        ["--busy-cores", TOO_MANY],
        f"--busy-cores: must be at most {TOO_MANY[:-1]}",
    ),
    "steps busy threads 0": (
        STEPS,
        ["--busy-threads", "0"],
        "--busy-threads: must be at least 1, got 0",
    ),
    "steps busy threads -2": (
        STEPS,
        ["--busy-threads", "-2"],
        "--busy-threads: must be at least 1",
    ),
    "steps prep threads -1": (
        STEPS,
        ["--prep-threads", "-1"],
        "--prep-threads: must be at least 0, got -1",
    ),
    "steps threads 0": (STEPS, ["--threads", "0"], "--threads: must be at least 1"),
    "steps repeats 0": (STEPS, ["--repeats", "0"], "--repeats: must be at least 1"),
    "steps repeats x": (
        STEPS,
        ["--repeats", "x"],
        "--repeats: expected an integer, got 'x'",
    ),
    "reorder tile sweep 0": (
        REORDER,
        ["--tile-sweep-kib", "0"],
        "--tile-sweep-kib: must be at least 1, got 0",
    ),
    "reorder tile sweep -4": (
        REORDER,
        ["--tile-sweep-kib", "1024", "-4"],
        "--tile-sweep-kib: must be at least 1, got -4",
    ),
    "reorder caps 0": (REORDER, ["--caps-kib", "0"], "--caps-kib: must be at least 1"),
    "reorder busy cores -1": (
        REORDER,
        ["--busy-cores", "-1"],
        "--busy-cores: must be at least 0, got -1",
    ),
    "reorder busy cores too many": (
        REORDER,
        ["--busy-cores", TOO_MANY],
        "--busy-cores: must be at most",
    ),
    "reorder repeats 0": (REORDER, ["--repeats", "0"], "--repeats: must be at least 1"),
    "parts busy cores -1": (
        PARTS,
        ["--busy-cores", "-1"],
        "--busy-cores: must be at least 0, got -1",
    ),
    "parts busy cores too many": (
        PARTS,
        ["--busy-cores", TOO_MANY],
        "--busy-cores: must be at most",
    ),
    "parts repeats 0": (PARTS, ["--repeats", "0"], "--repeats: must be at least 1"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_counts_are_one_line_errors_before_the_run(case, capsys, monkeypatch):
    script, argv, message = BAD[case]
    module = _load(script)
    for name in ENTRY_POINTS[script]:
        monkeypatch.setattr(module, name, _never)
    monkeypatch.setattr(sys, "argv", [script, *argv])
    with pytest.raises(SystemExit) as exit_info:
        module.main()
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    # The error and a hint, not the usage first.
    assert len(err) == 2 and err[0].startswith(f"{script}: error: argument "), err
    assert message in err[0], err
    assert err[1] == f"Try '{script} --help' for more information.", err


@pytest.mark.parametrize("script", sorted(ENTRY_POINTS))
def test_good_counts_reach_the_run(script, capsys, monkeypatch):
    # Control: the same flags at valid values get past the parser (to the
    # first entry point, which stops the run here).
    argv = ["--busy-cores", str(available_cores()), "--repeats", "1"]
    if script == REORDER:
        argv += ["--tile-sweep-kib", "1"]
    elif script == PARTS:
        pass
    else:
        argv += ["--prep-threads", "0", "--busy-threads", "1"]
    module = _load(script)
    for name in ENTRY_POINTS[script]:
        monkeypatch.setattr(module, name, _never)
    monkeypatch.setattr(sys, "argv", [script, *argv])
    with pytest.raises(AssertionError, match="started despite"):
        module.main()
