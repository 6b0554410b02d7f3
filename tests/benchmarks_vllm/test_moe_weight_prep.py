# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""benchmarks/moe_weight_prep.py end to end at a tiny shape, release and branch
each in vLLM 0.34.0's own loader; its measurement against known allocations."""

import hashlib
import json
import subprocess
import sys

import pytest
import torch
from safetensors import safe_open

import moe_weight_prep
from nvfp4_checkpoint import PRESETS, write_checkpoint

TINY = PRESETS["tiny"]
E, H, INTER = TINY.num_experts, TINY.hidden_size, TINY.intermediate_size
LAYERS = 2
W13_BYTES = E * 2 * INTER * H // 2
# One expert's gate (or up) half and its block-scale half: the reorder's buffer.
W13_HALF, SCALE_HALF = INTER * H // 2, INTER * H // 16
# Per-expert float32 vectors the quant method makes meanwhile (a global scale
# column, 1 / input scale, ...): E of them at 4 bytes, a few at once.
PER_EXPERT = 8 * 4 * E


def _codes_digests(checkpoint, layer: int) -> dict[str, str]:
    """sha256 of w13 as [up; gate] per expert (the kernels' [w3; w1]) and of w2,
    read from the checkpoint."""
    w13, w2 = hashlib.sha256(), hashlib.sha256()
    prefix = f"model.layers.{layer}.mlp.experts"
    path = checkpoint / f"model-layer{layer:03d}.safetensors"
    with safe_open(path, "pt") as f:
        names = set(f.keys())
        name = "weight" if f"{prefix}.0.up_proj.weight" in names else "weight_packed"
        for e in range(E):
            for proj in ("up_proj", "gate_proj"):
                w13.update(f.get_tensor(f"{prefix}.{e}.{proj}.{name}").numpy())
            w2.update(f.get_tensor(f"{prefix}.{e}.down_proj.{name}").numpy())
    return {"w13_weight": w13.hexdigest(), "w2_weight": w2.hexdigest()}


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory, release_tree):
    out = tmp_path_factory.mktemp("out")
    run = subprocess.run(
        [
            sys.executable,
            moe_weight_prep.__file__,
            "--model=tiny",
            f"--num-layers={LAYERS}",
            f"--out={out}",
            f"--release-vllm={release_tree}",
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stdout + run.stderr[-4000:]
    return out, run.stdout


@pytest.mark.slow
def test_json_shape_and_last_line(tiny_run):
    out, stdout = tiny_run
    json_path = out / "moe_weight_prep.json"
    assert stdout.splitlines()[-1].endswith(f"results: {json_path}")
    report = json.loads(json_path.read_text())
    assert report["model"] == "tiny"
    names = [f"model.layers.{i}.mlp.experts.routed_experts" for i in range(LAYERS)]
    assert list(report["layers"]) == names
    keys = {"peak_bytes", "peak_rss_bytes", "seconds", "resident_bytes", "vllm"}
    for entry in report["layers"].values():
        for side in ("release", "branch"):
            assert keys <= entry[side].keys()
    assert report["vllm"]["release"]["describe"] == "v0.34.0"
    assert report["vllm"]["release"]["path"] != report["vllm"]["branch"]["path"]
    assert report["total"]["release"]["layers"] == LAYERS
    # Nothing is copied for good: both keep exactly the loaded tensors.
    for entry in report["layers"].values():
        assert entry["release"]["resident_bytes"] == entry["branch"]["resident_bytes"]


@pytest.mark.slow
def test_branch_peak_is_one_expert_release_a_whole_copy(tiny_run):
    out, _ = tiny_run
    report = json.loads((out / "moe_weight_prep.json").read_text())
    for entry in report["layers"].values():
        assert entry["branch"]["peak_bytes"] <= W13_HALF + SCALE_HALF + PER_EXPERT
        # Negative control: the release's whole-tensor copies exceed that bound.
        assert entry["release"]["peak_bytes"] > W13_BYTES


@pytest.mark.slow
def test_prepared_codes_are_the_checkpoints_up_gate(tiny_run, tmp_path):
    out, _ = tiny_run
    report = json.loads((out / "moe_weight_prep.json").read_text())
    # The writer is deterministic: the same seed writes the run's checkpoint.
    checkpoint = write_checkpoint(tmp_path, TINY, LAYERS, "modelopt")
    for layer, entry in enumerate(report["layers"].values()):
        expected = _codes_digests(checkpoint, layer)
        for side in ("release", "branch"):
            digests = entry[side]["digests"]
            assert {k: digests[k] for k in expected} == expected
        assert entry["identical"]


@pytest.mark.slow
@pytest.mark.parametrize("side", ["release", "branch"])
def test_compressed_tensors_checkpoint_loads(side, tmp_path, release_tree):
    checkpoint = write_checkpoint(tmp_path / "ct", TINY, 1, "compressed-tensors")
    args = moe_weight_prep._parse(
        [f"--out={tmp_path}", f"--release-vllm={release_tree}"]
    )
    bar = moe_weight_prep._SimpleBar(None)
    run = moe_weight_prep._run_worker(side, "timed", args, checkpoint, bar)
    (entry,) = run["layers"].values()
    expected = _codes_digests(checkpoint, 0)
    assert {k: entry["digests"][k] for k in expected} == expected


def test_profiled_peak_is_torchs_running_allocation():
    def prepare(layer):
        a = torch.empty(1 << 20, dtype=torch.uint8)
        del a
        b = torch.empty(2 << 20, dtype=torch.uint8)
        c = b.clone()  # 2 + 2 MiB at once
        del b, c

    call, figures = moe_weight_prep._measured(prepare, True, "layer")
    call(torch.nn.Linear(4, 4))
    assert figures == {"peak_bytes": 4 << 20}


def test_profiled_peak_sees_a_whole_copy():
    layer = torch.nn.Linear(512, 256, bias=False)  # 512 KiB of float32
    call, figures = moe_weight_prep._measured(
        lambda m: m.weight.data.copy_(m.weight.flip(0)), profiled=True, name="layer"
    )
    call(layer)
    assert figures["peak_bytes"] >= layer.weight.nbytes


def test_timed_pass_reports_rss_and_resident_bytes():
    layer = torch.nn.Linear(64, 32)
    call, figures = moe_weight_prep._measured(
        lambda m: torch.ones(64 << 20, dtype=torch.uint8).sum(),
        profiled=False,
        name="layer",
    )
    call(layer)
    assert figures["peak_rss_bytes"] >= 64 << 20
    assert figures["resident_bytes"] == (64 * 32 + 32) * 4
    assert figures["seconds"] >= 0
