# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The main job, ``vllm bench moe-weight-prep``, end to end on one layer."""

import json

import pytest

from vllm.entrypoints.cli.main import main

MIB = 1 << 20


def test_qwen36_one_layer_report_json_and_plot(tmp_path, capsys):
    out_json, out_png = tmp_path / "r.json", tmp_path / "p.png"
    main(["bench", "moe-weight-prep", "--model", "qwen3.6-35b-a3b",
          "--backend", "flashinfer_b12x", "--num-layers", "1", "--no-progress",
          "--memory-limit", "100MiB", "--json", str(out_json),
          "--plot", str(out_png)])  # fmt: skip
    text = capsys.readouterr().out
    assert "free memory needed above the resident weights: legacy 288.0 MiB" in text
    assert "legacy EXCEEDS, bounded fits" in text
    result = json.loads(out_json.read_text())
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


@pytest.mark.parametrize("fmt", ["modelopt", "compressed-tensors"])
def test_checkpoint_directory(tmp_path, capsys, fmt):
    from vllm.model_executor.model_loader.nvfp4_checkpoint_writer import (
        main as write_example,
    )

    ckpt = tmp_path / "ckpt"
    write_example([str(ckpt), "--format", fmt, "--num-layers", "2",
                   "--num-experts", "8", "--hidden-size", "256",
                   "--intermediate-size", "256"])  # fmt: skip
    out_json = tmp_path / "r.json"
    main(["bench", "moe-weight-prep", "--checkpoint", str(ckpt), "--tp", "2",
          "--no-progress", "--json", str(out_json)])  # fmt: skip
    text = capsys.readouterr().out
    assert f"({fmt}), checkpoint weights" in text
    result = json.loads(out_json.read_text())
    assert result["num_layers"] == 2 and result["tp_size"] == 2
    # Per layer: w13 [8, 256, 128] + scales [8, 256, 16] at TP 2.
    assert result["shapes"]["w13_weight"] == [8, 256, 128]
    legacy = result["summary"]["legacy"]["reorder"]["max_transient_bytes"]
    assert legacy == 8 * 256 * (128 + 16)
    assert result["summary"]["bounded"]["total"]["max_transient_bytes"] < legacy
