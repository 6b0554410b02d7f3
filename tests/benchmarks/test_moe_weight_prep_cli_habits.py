# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""``vllm bench moe-weight-prep`` as a vLLM user types it: vLLM's spellings,
the ids the tool prints, one JSON layout, outputs checked before the run and
written whole, the precision report's cost and what it says."""

import argparse
import json
import os

import pytest

from tests.benchmarks.moe_prep_cli_utils import checkpoint_argv, example_checkpoint
from vllm.entrypoints.cli.main import main, make_parser
from vllm.utils.argparse_utils import available_cores, core_count

PROG = "vllm bench moe-weight-prep"
HINT = f"Try '{PROG} --help' for more information."
VARIANTS = ("legacy", "bounded")


def _job_parser():
    bench = make_parser()._subparsers._group_actions[0].choices["bench"]
    return bench._subparsers._group_actions[0].choices["moe-weight-prep"]


@pytest.mark.parametrize(
    "argv",
    [
        ["--tp", "2"],
        ["-tp", "2"],
        ["--tensor-parallel-size", "2"],
        ["--tensor-parallel-size=2"],
    ],
    ids=lambda a: a[0],
)
def test_tensor_parallel_spellings(argv):
    args = _job_parser().parse_args(["--model", "mixtral-8x7b", *argv])
    assert args.tp == 2 and not args.enable_expert_parallel


@pytest.mark.parametrize("flag", ["--enable-expert-parallel", "-ep"])
def test_expert_parallel_spellings(flag):
    args = _job_parser().parse_args(["--model", "mixtral-8x7b", "-tp", "2", flag])
    assert args.tp == 2 and args.enable_expert_parallel


def _never(*args, **kwargs):
    raise AssertionError("the run started despite a bad argument")


@pytest.fixture
def no_run(monkeypatch):
    """The job with its runs replaced by a failure: argument errors must
    come before them."""
    import vllm.benchmarks.moe_weight_prep.run as job

    for name in ("rank_job", "run_ranks", "busy_cores"):
        monkeypatch.setattr(job, name, _never)
    return job


def _error(capsys, argv, code=2):
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "moe-weight-prep", "--no-progress", *argv])
    assert exit_info.value.code == code
    err = capsys.readouterr().err.strip().splitlines()
    assert not any("Traceback" in line for line in err), err
    return err


@pytest.mark.parametrize(
    "model", ["Qwen/Qwen3.6-35B-A3B", "qwen/qwen3.6-35b-a3b", "QWEN3.6-35B-A3B"]
)
def test_the_model_ids_the_tool_prints_select_the_preset(model):
    from vllm.benchmarks.moe_weight_prep.presets import get_preset

    assert get_preset(model).name == "qwen3.6-35b-a3b"


def test_list_prints_the_ids_and_honours_json(tmp_path, capsys):
    out = tmp_path / "presets.json"
    assert main(["bench", "moe-weight-prep", "--model", "list"]) == 0
    text = capsys.readouterr().out
    assert "Qwen/Qwen3.6-35B-A3B" in text and "mistralai/Mixtral-8x7B-v0.1" in text
    assert (
        main(["bench", "moe-weight-prep", "--model", "list", "--json", str(out)]) == 0
    )
    listing = json.loads(out.read_text())
    by_name = {p["name"]: p for p in listing["presets"]}
    assert by_name["qwen3.6-35b-a3b"]["hf_id"] == "Qwen/Qwen3.6-35B-A3B"
    assert by_name["qwen3.6-35b-a3b"]["num_experts"] == 256
    assert f"wrote {out}" in capsys.readouterr().out


ARGUMENT_ERRORS = {
    # 19.12: the plot's format and directory, before the run.
    "plot txt": (["--plot", "p.txt"], "--plot p.txt: unknown plot format 'txt'"),
    "plot in /proc": (
        ["--plot", "/proc/p.png"],
        "--plot /proc/p.png: cannot write in /proc",
    ),
    "plot missing dir": (
        ["--plot", "/nonexistent-dir/p.png"],
        "directory /nonexistent-dir does not exist",
    ),
    # 19.13
    "busy cores 1000": (
        ["--busy-cores", "1000"],
        f"--busy-cores: must be at most {available_cores()}",
    ),
    # 19.14: the same error with one rank or two, before spawning.
    "num layers 99": (
        ["--num-layers", "99"],
        "--num-layers must be in [1, 40] for qwen3.6-35b-a3b, got 99",
    ),
    "num layers 99 tp 2": (
        ["--num-layers", "99", "--tp", "2"],
        "--num-layers must be in [1, 40] for qwen3.6-35b-a3b",
    ),
    "num layers 99 ep 2": (
        ["--num-layers", "99", "-tp", "2", "-ep"],
        "--num-layers must be in [1, 40]",
    ),
    "precision bad": (["--precision", "most"], "argument --precision: invalid choice"),
    # 20.3: a missing directory is reported as missing.
    "checkpoint missing": (
        ["--checkpoint", "/nonexistent-ckpt"],
        "--checkpoint /nonexistent-ckpt: no such directory",
    ),
    "tp 3": (["--tp", "3"], "--tp 3 does not divide"),
    "cap too small": (["--max-transient", "1"], "below 64KiB"),
    # -ep alone ran without expert parallelism, without a word (rc 0).
    "ep without tp": (
        ["-ep"],
        "--enable-expert-parallel (-ep) needs --tp N with N > 1",
    ),
    "ep with tp 1": (["--tp", "1", "--enable-expert-parallel"], "needs --tp N"),
    # No abbreviations: a typo is not another option.
    "num-layer typo": (["--num-layer", "1"], "unrecognized arguments: --num-layer 1"),
    "prefix of --memory-limit": (["--mem", "5MiB"], "unrecognized arguments: --mem"),
    # A negative size reaches the size's own message, in both spellings
    # (before: "expected one argument" for the first).
    "memory limit -5MiB": (
        ["--memory-limit", "-5MiB"],
        "argument --memory-limit: size must be at least one byte, got '-5MiB'",
    ),
    "memory limit=-5MiB": (
        ["--memory-limit=-5MiB"],
        "size must be at least one byte, got '-5MiB'",
    ),
    "max transient -.5G": (["--max-transient", "-.5G"], "at least one byte"),
}


@pytest.mark.parametrize("case", sorted(ARGUMENT_ERRORS))
def test_argument_errors_come_before_the_run_with_a_help_hint(case, capsys, no_run):
    argv, message = ARGUMENT_ERRORS[case]
    source = [] if "--checkpoint" in argv else ["--model", "qwen3.6-35b-a3b"]
    err = _error(capsys, [*source, *argv])
    # The error, then a one-line hint, for every argument error alike,
    # argparse's own (an invalid choice, a bad integer) and the job's: not
    # the 16-line usage before the one useful line.
    assert len(err) == 2, err
    assert err[0].startswith(f"{PROG}: error: ") and message in err[0], err
    assert err[1] == HINT, err


def test_negative_values_that_are_numbers_still_parse():
    # Control for the negative sizes above: a value starting with "-" and a
    # digit is a value (a negative seed as before), options are unchanged.
    args = _job_parser().parse_args(
        ["--model", "mixtral-8x7b", "--seed", "-3", "-tp", "2", "-ep"]
    )
    assert args.seed == -3 and args.tp == 2 and args.enable_expert_parallel


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="no affinity mask")
def test_busy_cores_are_bounded_by_the_cores_this_process_may_run_on(monkeypatch):
    # The affinity mask (taskset, a container's cpuset), not the machine's
    # count: one allowed core of 64 takes --busy-cores 1, not 2.
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0})
    monkeypatch.setattr(os, "cpu_count", lambda: 64)
    assert available_cores() == 1 and core_count("1") == 1
    with pytest.raises(argparse.ArgumentTypeError, match="must be at most 1 "):
        core_count("2")


def _example(path, activation="silu", layers=1, experts=8):
    return example_checkpoint(
        path, "--activation", activation, layers=layers, experts=experts
    )


def test_a_damaged_second_shard_is_refused_before_the_first_layer(
    tmp_path, capsys, no_run
):
    # Before: a corrupt header in the second shard failed the run (rc 1)
    # only after two layers had been prepared.
    from vllm.model_executor.model_loader.nvfp4_checkpoint_writer import (
        random_bf16_experts,
        write_nvfp4_moe_checkpoint,
    )

    layers = {i: random_bf16_experts(8, 256, 256, True, seed=i) for i in range(3)}
    config = {
        "hidden_size": 256,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 256,
    }
    ckpt = write_nvfp4_moe_checkpoint(
        tmp_path / "ckpt", layers, config, max_shard_bytes=1 << 20
    )
    second = sorted(ckpt.glob("*.safetensors"))[1]
    data = second.read_bytes()
    second.write_bytes(data[:8] + b"\xff" * 16 + data[24:])
    err = _error(capsys, ["--checkpoint", str(ckpt)])
    assert err[0].startswith(f"{PROG}: error: {second}: not a readable"), err


def _run(tmp_path, capsys, *argv, ckpt=None):
    ckpt = ckpt or _example(tmp_path / "ckpt")
    rc = main(
        ["bench", "moe-weight-prep", "--checkpoint", str(ckpt), "--no-progress", *argv]
    )
    return rc, capsys.readouterr()


@pytest.mark.parametrize("tp", ["1", pytest.param("2", marks=pytest.mark.slow)])
def test_one_json_layout_for_any_number_of_ranks(tmp_path, capsys, tp):
    out = tmp_path / "r.json"
    rc, _ = _run(tmp_path, capsys, "--tp", tp, "--json", str(out))
    assert rc == 0
    job = json.loads(out.read_text())
    assert job["world_size"] == int(tp) and len(job["ranks"]) == int(tp)
    assert [r["rank"] for r in job["ranks"]] == list(range(int(tp)))
    assert set(job) >= {
        "world_size",
        "expert_parallel",
        "busy_cores",
        "precision",
        "wall_time_s",
        "ranks",
    }


def test_steps_that_do_not_apply_are_a_dash(tmp_path, capsys):
    # relu2 experts have no gate/up halves: no reorder, in either variant.
    ckpt = _example(tmp_path / "relu2", activation="relu2")
    out = tmp_path / "r.json"
    rc, captured = _run(tmp_path, capsys, "--json", str(out), ckpt=ckpt)
    assert rc == 0
    row = next(line for line in captured.out.splitlines() if line.startswith("reorder"))
    assert row.split() == ["reorder", "-", "-", "-", "-"], row
    summary = json.loads(out.read_text())["ranks"][0]["summary"]
    for variant in ("legacy", "bounded"):
        assert summary[variant]["reorder"]["total_time_s"] is None
        assert summary[variant]["reorder"]["max_transient_bytes"] is None
    # Control: gated experts do reorder, and the row has figures.
    rc, captured = _run(tmp_path, capsys)
    row = next(line for line in captured.out.splitlines() if line.startswith("reorder"))
    assert "-" not in row.split()[1:], row


def test_plot_without_extension_writes_and_names_png(tmp_path, capsys):
    plot = tmp_path / "noext"
    rc, captured = _run(tmp_path, capsys, "--plot", str(plot))
    assert rc == 0
    assert f"wrote {plot}.png" in captured.out
    assert (tmp_path / "noext.png").read_bytes()[:4] == b"\x89PNG"
    assert not plot.exists()


@pytest.mark.parametrize("ext, magic", [("svg", b"<?xml"), ("pdf", b"%PDF")])
def test_plot_format_follows_the_extension(tmp_path, capsys, ext, magic):
    plot = tmp_path / f"p.{ext}"
    rc, captured = _run(tmp_path, capsys, "--plot", str(plot))
    assert rc == 0 and plot.read_bytes().startswith(magic)


def test_json_is_written_before_the_plot_and_survives_its_failure(
    tmp_path, capsys, monkeypatch
):
    import vllm.benchmarks.moe_weight_prep.run as job

    def broken_plot(result, path):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(job, "write_plot", broken_plot)
    out, plot = tmp_path / "r.json", tmp_path / "p.png"
    ckpt = _example(tmp_path / "ckpt")
    with pytest.raises(SystemExit) as exit_info:
        main(checkpoint_argv(ckpt, "--json", str(out), "--plot", str(plot)))
    assert exit_info.value.code == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"{PROG}: error: --plot {plot}: No space left on device"], err
    assert json.loads(out.read_text())["ranks"][0]["num_layers"] == 1
    # No plot, and no temporary file left beside it.
    assert not plot.exists()
    assert [p for p in os.listdir(tmp_path) if p.startswith(".")] == []


@pytest.mark.parametrize("how", ["sample", "full", "off"])
def test_precision_report_says_what_it_decoded(tmp_path, capsys, how):
    out = tmp_path / "r.json"
    rc, captured = _run(
        tmp_path,
        capsys,
        "--precision",
        how,
        "--json",
        str(out),
        "--global-scale-mode",
        "fold",
    )
    assert rc == 0
    job = json.loads(out.read_text())
    precision = job["ranks"][0]["precision"]
    assert job["precision"] == how
    if how == "off":
        assert precision == {} and "precision of the prepared" not in captured.out
        return
    assert precision["fold"]["sample"]["how"] == how
    said = {
        "sample": "--precision sample: decoded experts 0, 4, 7 of 8; blocks of "
        "128 rows x 1024 columns: w13 row tiles 0, 2, 3 of 4 x column spans 0 of "
        "1; w2 row tiles 0, 1 of 2 x column spans 0 of 1",
        "full": "--precision full: decoded all 8 experts, every row",
    }[how]
    assert said in captured.out, captured.out
    # Each mode's error is printed, "exact" exactly where it is zero (the
    # example writer gives gate and up different global scales).
    alpha = next(
        line for line in captured.out.splitlines() if line.startswith("alpha ")
    )
    fold = next(line for line in captured.out.splitlines() if line.startswith("fold "))
    alpha_error = precision["alpha"]["rel_rms"]
    assert alpha.split()[1] == f"{alpha_error:.4f}"
    assert alpha.endswith("exact") == (alpha_error == 0)
    assert float(fold.split()[1]) > 0.01 and not fold.endswith("exact")


def test_job_time_says_where_the_time_went(tmp_path, capsys):
    out = tmp_path / "r.json"
    ckpt = _example(tmp_path / "ckpt", layers=2)
    rc, captured = _run(tmp_path, capsys, "--json", str(out), ckpt=ckpt)
    job = json.loads(out.read_text())
    result = job["ranks"][0]
    phases = result["phase_times_s"]
    assert set(phases) == {
        "timed",
        "copy_in",
        "metered",
        "check",
        "precision",
        "weights",
    }
    assert sum(phases.values()) <= job["wall_time_s"]
    # "preparing" is the step table's time: its totals, legacy plus bounded
    # (before, it also held copying each layer in: 135.5 s said against a
    # table of 91.4 s).
    totals = [result["summary"][v]["total"]["total_time_s"] for v in VARIANTS]
    assert phases["timed"] == pytest.approx(sum(totals), rel=1e-12)
    assert phases["copy_in"] > 0
    line = next(x for x in captured.out.splitlines() if x.startswith("job: "))
    wall = job["wall_time_s"]
    assert line.startswith(
        f"job: {wall:.1f} s wall: preparing (the step table's time, legacy and "
        f"bounded) {phases['timed']:.1f} s"
    ), line
    copied = (
        "copying each layer in (a clone for legacy, a new layer for bounded; "
        f"not in the table) {phases['copy_in']:.1f} s"
    )
    assert copied in line, line
    # The printed totals add up to the printed "preparing" figure.
    row = next(x for x in captured.out.splitlines() if x.startswith("total "))
    legacy_s, bounded_s = (float(v) for v in row.split()[-4::2])
    assert abs(legacy_s + bounded_s - phases["timed"]) < 0.002, (row, line)
