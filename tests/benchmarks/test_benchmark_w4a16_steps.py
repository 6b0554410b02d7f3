# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The W4A16 part of benchmarks/kernels/benchmark_moe_weight_prep_steps.py
runs quiet and with busy cores, each step against one quiet memcpy floor,
and refuses a preparation that differs from the reference before timing."""

import dataclasses
import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

from vllm.benchmarks.moe_weight_prep.presets import get_preset

SCRIPT = (
    Path(__file__).resolve().parents[2]
    / "benchmarks"
    / "kernels"
    / "benchmark_moe_weight_prep_steps.py"
)


@pytest.fixture
def bench():
    spec = importlib.util.spec_from_file_location("_bench_w4a16_steps", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    small = dataclasses.replace(
        get_preset("qwen3.6-35b-a3b"),
        num_experts=4,
        hidden_size=256,
        intermediate_size=128,
    )
    module.get_preset = lambda name: small
    return module


def _run(bench, monkeypatch, capsys, *args):
    monkeypatch.setattr(
        sys, "argv", ["steps", "--model", "qwen3.6-35b-a3b", "--repeats", "1", *args]
    )
    assert bench.main() == 0
    return capsys.readouterr().out


def test_w4a16_quiet_and_busy_against_one_floor(bench, monkeypatch, capsys, tmp_path):
    out_json = tmp_path / "w4a16.json"
    out = _run(
        bench,
        monkeypatch,
        capsys,
        "--w4a16",
        "only",
        "--busy-cores",
        "1",
        "--json",
        str(out_json),
    )
    assert "one thread, quiet;" in out
    assert "one thread, 1 busy process(es) on 1 thread(s) each;" in out
    assert "W4A16: busy / quiet = " in out
    data = json.loads(out_json.read_text())
    assert data["busy_cores"] == 1 and set(data["w4a16"]) == {"0", "1"}
    quiet, busy = data["w4a16"]["0"], data["w4a16"]["1"]
    small = bench.get_preset("")
    w13 = small.num_experts * 2 * small.intermediate_size * small.hidden_size
    assert quiet["w13"]["bytes"] == w13 // 2 + w13 // 16  # codes + block scales
    assert quiet["total"]["bytes"] == quiet["w13"]["bytes"] + quiet["w2"]["bytes"]
    for step in ("w13", "w2", "total"):
        assert quiet[step]["time_s"] > 0 and busy[step]["time_s"] > 0
        # one floor, measured quiet, for both conditions
        assert quiet[step]["memcpy_s"] == busy[step]["memcpy_s"] > 0


def test_quiet_only_with_no_busy_cores(bench, monkeypatch, capsys):
    out = _run(bench, monkeypatch, capsys, "--w4a16", "only", "--busy-cores", "0")
    assert "one thread, quiet;" in out and "busy process" not in out


def test_a_wrong_preparation_is_refused_before_timing(bench, monkeypatch, capsys):
    from vllm.model_executor.layers.quantization.utils import flashinfer_w4a16_layout

    real = flashinfer_w4a16_layout.w4a16_pack_weight

    def rotated_wrong(weight, rotate=0):
        return real(weight, (rotate + 64) % weight.shape[1])

    monkeypatch.setattr(flashinfer_w4a16_layout, "w4a16_pack_weight", rotated_wrong)
    monkeypatch.setattr(bench, "measure_w4a16", lambda *a, **k: pytest.fail("timed"))
    monkeypatch.setattr(sys, "argv", ["steps", "--w4a16", "only", "--repeats", "1"])
    with pytest.raises(SystemExit, match="W4A16 w13 differs from the reference"):
        bench.main()


def test_busy_processes_run_during_the_busy_measurement_on_one_thread(
    bench, monkeypatch, capsys
):
    import contextlib

    active = {"busy": None, "prep_threads": False}
    entered = []

    @contextlib.contextmanager
    def busy_cores(n, threads):
        entered.append(n)
        active["busy"] = n
        yield
        active["busy"] = None

    @contextlib.contextmanager
    def preparing_weights(device, threads):
        active["prep_threads"] = True
        yield
        active["prep_threads"] = False

    def measure(preset, tensors, repeats, floors=None):
        assert active["prep_threads"], "W4A16 timed outside preparing_weights"
        seconds = {0: 0.5, 1: 0.75}[active["busy"]]
        return {
            s: {"time_s": seconds, "bytes": 1, "memcpy_s": 0.1}
            for s in [*bench.W4A16_STEPS, "total"]
        }

    monkeypatch.setattr(bench, "busy_cores", busy_cores)
    monkeypatch.setattr(bench, "preparing_weights", preparing_weights)
    monkeypatch.setattr(bench, "measure_w4a16", measure)
    out = _run(bench, monkeypatch, capsys, "--w4a16", "only", "--busy-cores", "1")
    assert entered == [0, 1]
    assert "W4A16: busy / quiet = 1.50x" in out


def _parts():
    path = SCRIPT.parent / "benchmark_w4a16_repack_parts.py"
    spec = importlib.util.spec_from_file_location("_bench_w4a16_parts", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_repack_parts_are_each_measured_on_a_small_expert():
    parts = _parts()
    small = dataclasses.replace(
        get_preset("qwen3.6-35b-a3b"),
        num_experts=4,
        hidden_size=256,
        intermediate_size=128,
    )
    r = parts.measure(small, 2, None)
    assert list(r) == [
        "memcpy (cached)",
        "memcpy (layer rate)",
        "fill",
        "bit steps",
        "write-back",
        "whole",
        "scales",
    ]
    assert all(ms == ms for ms in r.values())  # no NaN
    assert all(r[k] > 0 for k in ("memcpy (cached)", "fill", "bit steps", "write-back"))


def test_the_chunk_given_to_torch_compile_is_the_layout():
    # Run eagerly here (compiling takes seconds): the same function the
    # script compiles gives the reference bytes; a wrong rotation does not.
    from vllm.model_executor.layers.quantization.utils.flashinfer_w4a16_layout import (
        w4a16_pack_weight,
    )

    w = torch.randint(0, 256, (2, 256, 128), dtype=torch.uint8)
    got = _parts()._compiled_chunk()(w.view(torch.int64).view(2, 4, 64, 16))
    want = w4a16_pack_weight(w).view(torch.int64).reshape(-1)
    assert torch.equal(got.reshape(-1), want)
    other = w4a16_pack_weight(w, 64).view(torch.int64).reshape(-1)
    assert not torch.equal(got.reshape(-1), other)
