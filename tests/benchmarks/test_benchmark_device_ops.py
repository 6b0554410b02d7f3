# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""What benchmarks/kernels/benchmark_moe_weight_prep_steps.py says a step
would cost on a GPU: the ops it dispatches (views not counted, syncs and
allocations told apart), the bytes they read and write, CUDA's tile on CPU
tensors while counting, and the estimate from them."""

import dataclasses
import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

from vllm.benchmarks.moe_weight_prep import device_ops
from vllm.benchmarks.moe_weight_prep.presets import get_preset
from vllm.model_executor.layers.quantization.utils import bounded_chunks
from vllm.model_executor.layers.quantization.utils.flashinfer_fp4_moe import (
    reorder_w1w3_to_w3w1,
)

SCRIPT = (
    Path(__file__).resolve().parents[2]
    / "benchmarks"
    / "kernels"
    / "benchmark_moe_weight_prep_steps.py"
)


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("_bench_device_ops", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_views_are_not_counted_allocations_launch_nothing_syncs_are_told(bench):
    x = torch.zeros(8)
    with device_ops.DeviceOpCounter() as counter:
        y = x.view(2, 4)  # a view: no op
        y.add_(1)  # a kernel: reads and writes 32 bytes
        torch.empty(8)  # an allocation: an op, no kernel, no bytes
        bool(x.any())  # any (reads 32, writes 1), then a host sync (reads 1)
    assert counter.counts() == {
        "ops": 4,
        "launches": 3,
        "syncs": 1,
        "traffic_bytes": 32 + 32 + 32 + 1 + 1,
    }


@pytest.mark.parametrize(
    "op, traffic",
    [
        (lambda a, b: a.copy_(b), 200),  # the destination is only written
        (lambda a, b: a.add_(b), 300),  # read both, write a
        (lambda a, b: a + b, 300),  # read both, write the result
    ],
    ids=["copy_", "add_", "add"],
)
def test_traffic_is_what_an_op_reads_and_writes(bench, op, traffic):
    a, b = torch.zeros(100, dtype=torch.uint8), torch.ones(100, dtype=torch.uint8)
    with device_ops.DeviceOpCounter() as counter:
        op(a, b)
    assert counter.counts()["traffic_bytes"] == traffic


def test_cuda_tiling_is_set_for_cpu_tensors_and_restored(bench):
    cpu = torch.device("cpu")
    before = bounded_chunks.tile_bytes(cpu)
    with device_ops.cuda_tiling():
        assert bounded_chunks.tile_bytes(cpu) == bounded_chunks._TILE_BYTES["cuda"]
    assert bounded_chunks.tile_bytes(cpu) == before
    with pytest.raises(KeyError), device_ops.cuda_tiling():
        raise KeyError("restored on an error too")
    assert bounded_chunks.tile_bytes(cpu) == before


def test_the_cuda_tile_dispatches_fewer_ops_on_a_tensor_larger_than_a_cpu_tile(bench):
    # 8 MiB of w13 (8 experts of [w1; w3] 1024 x 1024 bytes): several CPU tiles,
    # half a CUDA tile. The same swap, fewer and larger chunks with CUDA's.
    def counted():
        w = torch.zeros(8, 1024, 1024, dtype=torch.uint8)
        s = torch.zeros(8, 1024, 64, dtype=torch.uint8)
        with device_ops.DeviceOpCounter() as counter:
            reorder_w1w3_to_w3w1(w, s)
        return counter.counts()

    at_cpu = counted()
    with device_ops.cuda_tiling():
        at_cuda = counted()
    # Fewer, larger chunks; the same bytes read and written.
    assert at_cuda["ops"] < at_cpu["ops"], (at_cuda, at_cpu)
    assert at_cuda["traffic_bytes"] == at_cpu["traffic_bytes"]


def test_moved_bytes_are_twice_what_a_step_rewrites_once_what_it_reads(bench):
    rewritten = {"validate": 10, "w13": 100, "w2": 50, "total": 150}
    moved = device_ops.moved_bytes(rewritten, ("validate",))
    assert moved == {"validate": 10, "w13": 200, "w2": 100, "total": 310}


def test_the_gpu_estimate_is_the_larger_of_host_time_and_bandwidth(bench):
    gpu = {"op_us": 10.0, "sync_us": 20.0, "bandwidth_gbs": 100.0}
    # 1,000 ops: 10 ms of host time against 1 MB at 100 GB/s (10 us).
    host_bound = {"ops": 1000, "syncs": 0}
    assert device_ops.gpu_estimate_s(host_bound, 10**6, gpu) == pytest.approx(0.01)
    # 1 op against 1 GB: 10 ms of bandwidth; two syncs add 40 us.
    bandwidth_bound = {"ops": 1, "syncs": 2}
    assert device_ops.gpu_estimate_s(bandwidth_bound, 10**9, gpu) == pytest.approx(
        0.01 + 40e-6
    )


@pytest.fixture
def small(bench, monkeypatch):
    preset = dataclasses.replace(
        get_preset("qwen3.6-35b-a3b"),
        num_experts=4,
        hidden_size=256,
        intermediate_size=128,
    )
    monkeypatch.setattr(bench, "get_preset", lambda name: preset)
    return preset


def test_device_ops_only_prints_counts_bytes_and_the_estimate(
    bench, small, monkeypatch, capsys, tmp_path
):
    out_json = tmp_path / "ops.json"
    monkeypatch.setattr(
        sys, "argv", ["steps", "--device-ops", "only", "--json", str(out_json)]
    )
    assert bench.main() == 0
    out = capsys.readouterr().out
    assert "ops@CUDA: with CUDA's 16 MiB tile set for CPU tensors" in out
    assert "estimated on a 16 GB SM120 card, assumed: 10 us of host time" in out
    for layout in ("w4a4 alpha", "w4a4 fold", "w4a16"):
        assert f"  {layout:<11}" in out  # its estimate line
    data = json.loads(out_json.read_text())
    assert data["gpu_assumptions"] == device_ops.GPU_ASSUMPTIONS
    w4a16 = data["device_ops"]["w4a16"]
    w13 = small.num_experts * 2 * small.intermediate_size * small.hidden_size
    codes_and_scales = w13 // 2 + w13 // 16
    assert w4a16["w13"]["rewritten_bytes"] == codes_and_scales
    assert w4a16["w13"]["moved_bytes"] == 2 * codes_and_scales
    # Its ops read and write at least what it must move.
    assert w4a16["w13"]["traffic_bytes"] >= w4a16["w13"]["moved_bytes"]
    assert w4a16["w13"]["ops_cuda_tile"]["ops"] > 0
    total = w4a16["total"]["ops_cuda_tile"]["ops"]
    steps = [s for s in w4a16 if s != "total"]
    assert total == sum(w4a16[s]["ops_cuda_tile"]["ops"] for s in steps)
    # alpha mode rewrites no block scale; the fold mode's fold step does.
    alpha, fold = data["device_ops"]["w4a4 alpha"], data["device_ops"]["w4a4 fold"]
    assert (
        alpha["fold"]["moved_bytes"] == 0 and alpha["fold"]["ops_cuda_tile"]["ops"] == 0
    )
    assert fold["fold"]["moved_bytes"] > 0 and fold["fold"]["ops_cuda_tile"]["ops"] > 0


def test_the_timing_tables_show_the_ops_beside_each_step(
    bench, small, monkeypatch, capsys
):
    monkeypatch.setattr(
        sys,
        "argv",
        ["steps", "--repeats", "1", "--busy-cores", "0", "--w4a16", "also"],
    )
    assert bench.main() == 0
    out = capsys.readouterr().out
    w4a16_header = next(
        x for x in out.splitlines() if x.startswith("step ") and "ops@CUDA" in x
    )
    assert "moved MiB" in w4a16_header
    w4a4_header = next(x for x in out.splitlines() if "ops at the CUDA tile" in x)
    assert w4a4_header.split()[:4] == ["step", "MiB", "memcpy", "moved"]
