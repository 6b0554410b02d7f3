# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The main job, ``vllm bench moe-weight-prep``, end to end on one layer."""

import json

import pytest
import torch

from tests.benchmarks.moe_prep_cli_utils import checkpoint_argv, example_checkpoint
from vllm.entrypoints.cli.main import main

MIB = 1 << 20


@pytest.mark.slow
def test_qwen36_one_layer_report_json_and_plot(tmp_path, capsys):
    out_json, out_png = tmp_path / "r.json", tmp_path / "p.png"
    main(
        [
            "bench",
            "moe-weight-prep",
            "--model",
            "qwen3.6-35b-a3b",
            "--backend",
            "flashinfer_b12x",
            "--num-layers",
            "1",
            "--no-progress",
            "--memory-limit",
            "100MiB",
            "--json",
            str(out_json),
            "--plot",
            str(out_png),
        ]
    )
    text = capsys.readouterr().out
    assert "free memory needed above the resident weights: legacy 288.0 MiB" in text
    assert "legacy EXCEEDS, bounded fits" in text
    result = json.loads(out_json.read_text())["ranks"][0]
    summary = result["summary"]
    assert summary["legacy"]["reorder"]["max_transient_bytes"] == 288 * MIB
    assert summary["legacy"]["fold"]["max_transient_bytes"] >= 4 * 32 * MIB
    for step in ("reorder", "swizzle", "fold", "total"):
        assert summary["bounded"][step]["max_transient_bytes"] <= 64 * MIB
    assert result["memory_limit_ok"] == {"legacy": False, "bounded": True}
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_list_and_errors(capsys):
    main(["bench", "moe-weight-prep", "--model", "list"])
    listing = capsys.readouterr().out
    for name in ("qwen3.6-35b-a3b", "deepseek-v3", "nemotron-3-nano-30b-a3b"):
        assert name in listing
    with pytest.raises(SystemExit):
        main(["bench", "moe-weight-prep", "--model", "no-such-model"])
    assert "unknown model preset" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["bench", "moe-weight-prep", "--model", "mixtral-8x7b", "--tp", "3"])
    assert "--tp 3" in capsys.readouterr().err


def _example(path, fmt="modelopt", layers=2):
    return example_checkpoint(path, "--format", fmt, layers=layers)


@pytest.mark.parametrize("fmt", ["modelopt", "compressed-tensors"])
def test_checkpoint_directory(tmp_path, capsys, fmt):
    ckpt = _example(tmp_path / "ckpt", fmt)
    out_json = tmp_path / "r.json"
    main(checkpoint_argv(ckpt, "--json", str(out_json)))
    text = capsys.readouterr().out
    assert f"({fmt}), checkpoint weights" in text
    result = json.loads(out_json.read_text())["ranks"][0]
    assert result["num_layers"] == 2 and result["tp_size"] == 1
    # Per layer: w13 [8, 512, 128] + scales [8, 512, 16].
    assert result["shapes"]["w13_weight"] == [8, 512, 128]
    legacy = result["summary"]["legacy"]["reorder"]["max_transient_bytes"]
    assert legacy == 8 * 512 * (128 + 16)
    assert result["summary"]["bounded"]["total"]["max_transient_bytes"] < legacy


# (flags, shard of rank r, w13 shape of each rank)
PARALLEL = {
    "tp2": ([], "TP {r}/2", [8, 256, 128]),
    "ep2": (["--enable-expert-parallel"], "EP {r}/2", [4, 512, 128]),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(PARALLEL))
def test_parallel_ranks_each_prepare_their_shard(tmp_path, capsys, case):
    flags, shard, w13 = PARALLEL[case]
    ckpt = _example(tmp_path / "ckpt")
    out_json = tmp_path / "r.json"
    main(checkpoint_argv(ckpt, "--tp", "2", *flags, "--json", str(out_json)))
    text = capsys.readouterr().out
    ranks = json.loads(out_json.read_text())["ranks"]
    assert [r["rank"] for r in ranks] == [0, 1]
    for r, result in enumerate(ranks):
        assert result["shard"] == shard.format(r=r)
        assert result["shapes"]["w13_weight"] == w13
        # Each rank's bounded peak within its cap, below its legacy peak.
        s = result["summary"]
        assert 0 < s["bounded"]["total"]["max_transient_bytes"] <= 64 * MIB
        assert (
            s["bounded"]["total"]["max_transient_bytes"]
            < (s["legacy"]["total"]["max_transient_bytes"])
        )
    # The per-rank table: one line per rank and their maximum.
    lines = text[text.index("per rank: 2 processes") :].splitlines()
    assert lines[2].split()[:3] == ["0", *shard.format(r=0).split()]
    assert lines[3].split()[:3] == ["1", *shard.format(r=1).split()]
    assert lines[4].startswith("max")


@pytest.mark.slow
def test_a_failing_rank_ends_the_job_with_its_error(tmp_path, capsys):
    # Rank 1's experts (4..7 under EP 2) include one with a NaN global
    # scale: rank 1 fails at load, rank 0 (waiting for it before the next
    # layer) is stopped; the job exits 1 with rank 1's error, promptly.
    import time

    from safetensors.torch import load_file, save_file

    ckpt = _example(tmp_path / "ckpt", layers=2)
    name = "model.layers.0.mlp.experts.6.down_proj.weight_scale_2"
    for f in ckpt.glob("*.safetensors"):
        tensors = load_file(f)
        if name in tensors:
            tensors[name] = torch.tensor(float("nan"))
            save_file(tensors, f)
    start = time.monotonic()
    with pytest.raises(SystemExit) as exit_info:
        main(checkpoint_argv(ckpt, "--tp", "2", "--enable-expert-parallel"))
    assert exit_info.value.code == 1
    # Well before the collectives' 600 s timeout (a hang would reach it);
    # seconds on a quiet machine, 69 s once with ~8 sessions on 2 cores.
    assert time.monotonic() - start < 300
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("vllm bench moe-weight-prep: error: rank 1: "), err
    assert "expert 6" in err[-1] and "Traceback" not in "\n".join(err)


BAD_ARGUMENTS = {
    "memory limit inf": (["--memory-limit", "inf"], "size must be finite"),
    "memory limit 1e400": (["--memory-limit", "1e400"], "size must be finite"),
    "memory limit nan": (["--memory-limit", "nan"], "size must be finite"),
    "memory limit zero": (["--memory-limit", "0"], "at least one byte"),
    "tiny cap": (["--max-transient", "1"], "below 64KiB"),
    "cap 63KiB": (["--max-transient", "63KiB"], "below 64KiB"),
    "tp 0": (
        ["--tp", "0"],
        "argument --tp/-tp/--tensor-parallel-size: must be at least 1, got 0",
    ),
    "num layers 0": (["--num-layers", "0"], "--num-layers: must be at least 1"),
    "busy cores -1": (["--busy-cores", "-1"], "--busy-cores: must be at least 0"),
    "json in a missing directory": (
        ["--json", "/nonexistent-dir/r.json"],
        "directory /nonexistent-dir does not exist",
    ),
    "plot is a directory": (["--plot", "/"], "--plot /: is a directory"),
    "checkpoint does not exist": (
        ["--checkpoint", "/nonexistent-ckpt"],
        "--checkpoint /nonexistent-ckpt: no such directory",
    ),
    "checkpoint is a file": (["--checkpoint", __file__], "not a directory"),
}


@pytest.mark.parametrize("case", sorted(BAD_ARGUMENTS))
def test_bad_arguments_are_one_line_errors_before_the_run(case, capsys, monkeypatch):
    argv, message = BAD_ARGUMENTS[case]
    import vllm.benchmarks.moe_weight_prep.run as job

    def never(*a, **k):
        raise AssertionError("the run started despite a bad argument")

    for name in ("rank_job", "run_ranks", "busy_cores"):
        monkeypatch.setattr(job, name, never)
    source = [] if "--checkpoint" in argv else ["--model", "qwen3.6-35b-a3b"]
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "moe-weight-prep", *source, "--no-progress", *argv])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2, err  # the error and the --help hint
    assert err[0].startswith("vllm bench moe-weight-prep: error:"), err
    assert message in err[0], err
    assert "--help" in err[1]


def test_memory_limit_exceeded_exits_non_zero(tmp_path, capsys):
    ckpt = _example(tmp_path / "ckpt", layers=1)
    args = ["bench", "moe-weight-prep", "--checkpoint", str(ckpt), "--no-progress"]
    assert main([*args, "--memory-limit", "1"]) == 1
    captured = capsys.readouterr()
    assert "bounded EXCEEDS" in captured.out
    assert "the bounded preparation exceeds --memory-limit" in captured.err
    # Control: a limit the bounded preparation fits in exits 0 (the legacy one
    # exceeding it is the baseline being shown, not a failure).
    assert main([*args, "--memory-limit", "400KiB"]) == 0
    assert "legacy EXCEEDS, bounded fits" in capsys.readouterr().out


def test_several_layers_are_each_timed_and_metered_once_per_shape(tmp_path, capsys):
    out_json = tmp_path / "r.json"
    ckpt = _example(tmp_path / "c", layers=3)
    main(checkpoint_argv(ckpt, "--json", str(out_json)))
    result = json.loads(out_json.read_text())["ranks"][0]
    layers = result["layers"]
    assert len(layers) == 3
    for variant in ("legacy", "bounded"):
        for i, layer in enumerate(layers):
            steps = {r["step"]: r for r in layer[variant]}
            assert all(r["time_s"] is not None for r in steps.values())
            # The preparation's allocations depend on shapes only: the first
            # layer of a shape is metered, the others are not paid for twice.
            metered = [r["peak_bytes"] is not None for r in steps.values()]
            assert all(metered) if i == 0 else not any(metered)
    # The totals line compares the two variants' summed times, whatever they
    # are (two within 5% read "as fast"): the phrase follows from the JSON.
    total = {
        v: result["summary"][v]["total"]["total_time_s"] for v in ("legacy", "bounded")
    }
    assert total["legacy"] > 0 and total["bounded"] > 0, total
    ratio = total["legacy"] / total["bounded"]
    if abs(ratio - 1) < 0.05:
        phrase = "as fast"
    elif ratio > 1:
        phrase = f"{ratio:.1f}x faster"
    else:
        phrase = f"{1 / ratio:.1f}x slower"
    text = capsys.readouterr().out
    totals = [line for line in text.splitlines() if line.startswith("totals: ")]
    assert len(totals) == 1 and totals[0].endswith(f"(bounded {phrase})"), totals


def test_busy_cores_start_and_stop():
    import multiprocessing

    from vllm.benchmarks.moe_weight_prep.busy_cores import busy_cores

    with busy_cores(1):
        children = multiprocessing.active_children()
        assert len(children) == 1 and children[0].is_alive()
    assert not children[0].is_alive()
    assert multiprocessing.active_children() == []


def test_help_is_plain_text_and_every_option_has_help(capsys):
    from vllm.entrypoints.cli.main import make_parser

    for argv in (["--help"], ["bench", "--help"], ["bench", "moe-weight-prep", "-h"]):
        with pytest.raises(SystemExit) as exit_info:
            main(argv)
        assert exit_info.value.code == 0
        text = capsys.readouterr().out
        assert "``" not in text and ":func:" not in text, text
    bench = make_parser()._subparsers._group_actions[0].choices["bench"]
    job = bench._subparsers._group_actions[0].choices["moe-weight-prep"]
    for action in job._actions:
        assert action.help, f"{action.option_strings} has no help text"


def test_global_scale_mode_help_says_no_block_scale_is_rewritten(capsys):
    # Since the exact alphas, differing gate/up global scales are no longer
    # folded into one half (the help said "about 3%"): the ratio rides on
    # the FC2 alpha, as the README and the design page say.
    with pytest.raises(SystemExit):
        main(["bench", "moe-weight-prep", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    start = text.index("how per-expert global scales reach the kernel")
    help_text = text[start : text.index("--precision", start)]
    assert "rewrites no block scale" in help_text, help_text
    assert "the ratio rides on the FC2 alpha" in help_text, help_text
    assert "folded into one half" not in help_text and "3%" not in help_text


def test_version(capsys):
    import vllm

    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.strip() == f"vllm {vllm.__version__}"


WRITER_ERRORS = {
    "no experts": (["--num-experts", "0"], "--num-experts: must be at least 1"),
    "hidden 100": (["--hidden-size", "100"], "--hidden-size must be a multiple of 16"),
    "top-k above experts": (
        ["--num-experts", "4", "--top-k", "8"],
        "--top-k 8 is more than --num-experts 4",
    ),
}


@pytest.mark.parametrize("case", sorted(WRITER_ERRORS))
def test_example_writer_errors_are_one_line(case, tmp_path, capsys):
    from vllm.model_executor.model_loader.nvfp4_checkpoint_writer import (
        main as write_example,
    )

    argv, message = WRITER_ERRORS[case]
    with pytest.raises(SystemExit) as exit_info:
        write_example([str(tmp_path / "ckpt"), *argv])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    prog = "python -m vllm.model_executor.model_loader.nvfp4_checkpoint_writer"
    assert len(err) == 2 and err[1] == f"Try '{prog} --help' for more information."
    assert err[0].startswith(f"{prog}: error:") and message in err[0], err
    assert not (tmp_path / "ckpt").exists()
