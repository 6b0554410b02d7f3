# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""``vllm bench moe-weight-prep --quant-mode w4a16``: the FlashInfer baselines
(the modelled public path against FlashInfer's own functions where
flashinfer is installed), the run and its command line."""

import json

import pytest
import torch

from tests.benchmarks.moe_prep_cli_utils import checkpoint_argv, example_checkpoint
from tests.kernels.utils import bytes_of
from vllm.benchmarks.moe_weight_prep.baselines import (
    PACKED_FIELDS,
    flashinfer_w4a16_prepare,
    flashinfer_w4a16_unavailable_reason,
    public_copy_reference,
)
from vllm.benchmarks.moe_weight_prep.precision import w4a16_precision
from vllm.benchmarks.moe_weight_prep.presets import MoEModelPreset
from vllm.benchmarks.moe_weight_prep.synthetic_weights import synthetic_layer_tensors
from vllm.benchmarks.moe_weight_prep.w4a16_layers import run_w4a16_benchmark
from vllm.entrypoints.cli.main import main
from vllm.model_executor.layers.quantization.utils.nvfp4_utils import (
    swizzle_blockscale,
)
from vllm.utils.mem_utils import measure_peak_memory

MIB = 1 << 20
NO_FLASHINFER = flashinfer_w4a16_unavailable_reason()
needs_flashinfer = pytest.mark.skipif(
    NO_FLASHINFER is not None, reason=f"FlashInfer oracle: {NO_FLASHINFER}"
)
# (E, H, I, activation): I = 96 pads w13's 2I = 192 rows to the swizzle's 256.
SHAPES = [(4, 256, 128, "silu"), (3, 128, 64, "relu2"), (2, 128, 96, "silu")]


def _preset(e, h, i, act, layers=1):
    return MoEModelPreset("tiny", "tiny", layers, h, e, 2, i, act)


def _args(tensors):
    e = tensors["w13_weight"].shape[0]
    return {
        "w13": tensors["w13_weight"].clone(),
        "w13_scale_swizzled": swizzle_blockscale(tensors["w13_weight_scale"]),
        "w13_global": tensors["w13_weight_scale_2"][:, 0].clone(),
        "w2": tensors["w2_weight"].clone(),
        "w2_scale_swizzled": swizzle_blockscale(tensors["w2_weight_scale"]),
        "w2_global": tensors["w2_weight_scale_2"].reshape(e).clone(),
    }


@needs_flashinfer
@pytest.mark.parametrize("reuse", [False, True], ids=["public", "in_place"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_public_copy_reference_is_flashinfers_bytes(shape, reuse):
    e, h, i, act = shape
    tensors = synthetic_layer_tensors(_preset(*shape), 1, torch.device("cpu"), 0)
    want = flashinfer_w4a16_prepare(
        **_args(tensors), gated=act == "silu", reuse_input_storage=reuse
    )
    got = public_copy_reference(**_args(tensors), gated=act == "silu")
    for name in PACKED_FIELDS:
        assert got[name].shape == want[name].shape, name
        assert torch.equal(bytes_of(got[name]), bytes_of(want[name])), name
    # Negative control: FlashInfer told the halves are [up; gate] (it
    # rotates them) gives other bytes: the order is checked.
    if act == "silu":
        rotated = flashinfer_w4a16_prepare(
            **_args(tensors), gated=True, w13_layout="up_gate"
        )
        assert not torch.equal(bytes_of(rotated["w13"]), bytes_of(got["w13"]))


def test_public_copy_reference_keeps_a_full_copy_and_leaves_the_source():
    e, h, i = 2, 128, 64  # N multiples of 128, K/16 of 4: nothing padded
    tensors = synthetic_layer_tensors(_preset(e, h, i, "silu"), 1, "cpu", 1)
    args = _args(tensors)
    before = {k: bytes_of(v).clone() for k, v in args.items()}
    with measure_peak_memory("cpu") as mem:
        out = public_copy_reference(**args, gated=True)
    kept = sum(t.numel() * t.element_size() for t in out.values())
    nbytes = {n: tensors[n].numel() * tensors[n].element_size() for n in tensors}
    scales = nbytes["w13_weight_scale"] + nbytes["w2_weight_scale"]
    source = nbytes["w13_weight"] + nbytes["w2_weight"] + scales
    # The packed weights and scales are the source's size, plus two float32
    # [E] global scales: all of it kept (the public path's cache).
    assert kept == source + 2 * 4 * e
    assert mem.net_bytes == kept
    # Above it at the peak: the two unswizzled scale copies, and one
    # expert's temporaries (its codes unpacked, permuted, packed: a few
    # times one expert's w13 bytes).
    one_expert = nbytes["w13_weight"] // e
    assert kept + scales <= mem.peak_bytes <= kept + scales + 6 * one_expert
    for k, v in args.items():
        assert torch.equal(bytes_of(v), before[k]), k


def test_precision_is_exact_and_sees_a_wrong_scale():
    shape = (4, 256, 128, "silu")
    tensors = synthetic_layer_tensors(_preset(*shape), 1, torch.device("cpu"), 2)
    packed = public_copy_reference(**_args(tensors), gated=True)
    p = w4a16_precision(packed, tensors, [0, 3])
    assert p["rel_rms"] == 0.0 and p["flushed"] == 0
    assert p["total"] == 2 * (256 * 16 + 256 * 8)
    # Negative controls: one expert's global scale doubled; a block scale
    # zeroed (counted as flushed).
    packed["w2_global_scale"][3] *= 2
    assert w4a16_precision(packed, tensors, [3])["rel_rms"] > 0.3
    packed["w13_scale"][0].view(torch.uint8)[0, 0] = 0
    assert w4a16_precision(packed, tensors, [0])["flushed"] == 1


@pytest.mark.parametrize("shape", SHAPES[:2], ids=lambda s: "x".join(map(str, s)))
def test_run_compares_every_variant_and_adds_up_the_model(shape):
    e, h, i, act = shape
    result = run_w4a16_benchmark(
        _preset(*shape, layers=3),
        device=torch.device("cpu"),
        progress=False,
        flashinfer=False,
    )
    s = result["summary"]
    assert set(s) == {"flashinfer-public-model", "bounded"}
    assert result["flashinfer_skipped"]  # not requested (or not importable)
    public, bounded = s["flashinfer-public-model"], s["bounded"]
    rows = 2 * i if act == "silu" else i
    packed = e * (rows * h // 2 + rows * h // 16 + h * i // 2 + h * i // 16 + 8)
    assert public["kept_per_layer_bytes"] == packed
    assert public["model_kept_bytes"] == 3 * packed
    assert public["model_peak_bytes"] == 2 * packed + public["peak_per_layer_bytes"]
    assert public["model_time_s"] is None  # the reference is not timed
    assert bounded["model_time_s"] > 0
    assert [r["flashinfer-public-model"]["time_s"] for r in result["layers"]] == [
        None
    ] * 3
    # In place: only the two float32 [E] kernel global scales are new.
    assert bounded["kept_per_layer_bytes"] <= 2 * 4 * e
    assert bounded["model_peak_bytes"] <= 2 * bounded["peak_per_layer_bytes"]
    assert bounded["model_peak_bytes"] >= bounded["peak_per_layer_bytes"]
    assert bounded["peak_per_layer_bytes"] < public["peak_per_layer_bytes"]
    assert len(result["layers"]) == 3
    assert result["precision"]["rel_rms"] == 0.0


# --- the command line ------------------------------------------------------------


def _write(path, quant_mode, layers=2, fmt="modelopt"):
    return example_checkpoint(
        path,
        "--format",
        fmt,
        "--quant-mode",
        quant_mode,
        layers=layers,
        experts=4,
        intermediate=128,
    )


@pytest.mark.parametrize("fmt", ["modelopt", "compressed-tensors"])
def test_w4a16_checkpoint_auto(tmp_path, capsys, fmt):
    ckpt = _write(tmp_path / "ckpt", "w4a16", fmt=fmt)
    out_json = tmp_path / "r.json"
    main(checkpoint_argv(ckpt, "--json", str(out_json), "--memory-limit", "1MiB"))
    text = capsys.readouterr().out
    assert "W4A16 (weight-only NVFP4) preparation for b12x" in text
    assert f"({fmt}), checkpoint weights" in text
    assert "every variant gives the same bytes (checked per layer)" in text
    job = json.loads(out_json.read_text())
    assert job["world_size"] == 1 and len(job["ranks"]) == 1
    result = job["ranks"][0]
    assert result["quant_mode"] == "w4a16" and result["num_layers"] == 2
    assert result["memory_limit_ok"] is True
    # The writer gives gate and up their own global scales: FC2's alpha
    # carries up / gate, and the decode as the kernel computes is exact.
    assert result["gate_up_scales_differ"] == 4
    assert result["precision"]["rel_rms"] < 1e-6
    s = result["summary"]
    assert s["bounded"]["kept_per_layer_bytes"] <= 2 * 4 * 4  # global scales
    assert s["flashinfer-public-model"]["kept_per_layer_bytes"] > 4096


def test_mixed_checkpoint_takes_the_mode_asked_for(tmp_path, capsys):
    ckpt = _write(tmp_path / "ckpt", "mixed", layers=3)  # layers 0, 2 w4a16
    with pytest.raises(SystemExit):
        main(["bench", "moe-weight-prep", "--checkpoint", str(ckpt)])
    err = capsys.readouterr().err
    assert "mixes w4a4 and w4a16 MoE layers (w4a16: [0, 2])" in err
    out_json = tmp_path / "r.json"
    for quant_mode, layers in (("w4a16", 2), ("w4a4", 1)):
        main(checkpoint_argv(ckpt, "--quant-mode", quant_mode, "--json", str(out_json)))
        job = json.loads(out_json.read_text())
        assert job["ranks"][0]["num_layers"] == layers


W4A16_ERRORS = {
    "no w4a16 layers": (
        ["--quant-mode", "w4a16"],
        "w4a4",
        "no w4a16 MoE layers (its MoE layers are w4a4): pass --quant-mode w4a4",
    ),
    "tp": (["--tp", "2"], "w4a16", "--tp is not supported with --quant-mode w4a16"),
    "fold": (
        ["--global-scale-mode", "fold"],
        "w4a16",
        "--global-scale-mode fold is not supported with --quant-mode w4a16",
    ),
    "bad choice": (["--quant-mode", "w8a8"], "w4a16", "invalid choice: 'w8a8'"),
}


@pytest.mark.parametrize("case", sorted(W4A16_ERRORS))
def test_w4a16_argument_errors(tmp_path, capsys, case):
    flags, quant_mode, message = W4A16_ERRORS[case]
    ckpt = _write(tmp_path / "ckpt", quant_mode, layers=1)
    with pytest.raises(SystemExit) as exit_:
        main(["bench", "moe-weight-prep", "--checkpoint", str(ckpt), *flags])
    assert exit_.value.code != 0
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err, err
