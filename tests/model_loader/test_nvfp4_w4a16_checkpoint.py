# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""W4A16 (weight-only NVFP4) checkpoints: how the reader loads them (no input
scales), per layer, and the writer's W4A16 and mixed files."""

import json

import pytest
import torch

from tests.kernels.utils import bytes_of
from tests.model_loader.nvfp4_ckpt_utils import (
    EXPERTS,
    W4A4,
    W4A16,
    E,
    make_layer,
    quant_json,
    write_layers,
    writer_cli_args,
)
from vllm.model_executor.layers.quantization.modelopt import ModelOptNvFp4Config
from vllm.model_executor.model_loader import nvfp4_checkpoint_writer as writer
from vllm.model_executor.model_loader.nvfp4_moe_checkpoint import (
    COMPRESSED_TENSORS,
    MODELOPT,
    NVFP4MoECheckpoint,
)

LAYERS = (0, 1, 2)


def loaded(ckpt, idx):
    layer = make_layer(place=False, quant_config=ckpt.quant_config(idx))
    ckpt.load_layer(layer, idx)
    return layer


# (format, writer keywords) of every way a W4A16 checkpoint is declared
W4A16_WAYS = {
    "modelopt top-level": (MODELOPT, {}),
    "modelopt MIXED_PRECISION": (MODELOPT, {"per_layer": True}),
    "modelopt in config.json": (MODELOPT, {"quant_config_in_config_json": True}),
    "modelopt MIXED_PRECISION in config.json": (
        MODELOPT,
        {"per_layer": True, "quant_config_in_config_json": True},
    ),
    "compressed-tensors null input_activations": (COMPRESSED_TENSORS, {}),
}


@pytest.mark.parametrize("way", sorted(W4A16_WAYS))
def test_w4a16_checkpoints_declare_and_load_weight_only(tmp_path, way):
    fmt, kwargs = W4A16_WAYS[way]
    w4a16 = write_layers(tmp_path / "w4a16", fmt, quant_mode=W4A16, **kwargs)
    w4a4 = write_layers(tmp_path / "w4a4", fmt, **kwargs)
    # What the writer declared, as the format spells it.
    q = quant_json(w4a16)
    if fmt == COMPRESSED_TENSORS:
        assert q["config_groups"]["group_0"]["input_activations"] is None
        assert quant_json(w4a4)["config_groups"]["group_0"]["input_activations"]
    elif kwargs.get("per_layer"):
        assert q["quant_algo"] == "MIXED_PRECISION"
        entry = q["quantized_layers"]["model.layers.1.mlp.experts"]
        assert entry["quant_algo"] == "W4A16_NVFP4"
        assert q["quantized_layers"]["model.layers.1.self_attn.q_proj"] == {
            "quant_algo": "FP8"
        }  # tolerated: another module's algorithm
    else:
        assert q["quant_algo"] == "W4A16_NVFP4"
    ckpt, control = NVFP4MoECheckpoint(w4a16), NVFP4MoECheckpoint(w4a4)
    for idx in LAYERS:
        assert ckpt.quant_mode(idx) == W4A16 and control.quant_mode(idx) == W4A4
        config = ckpt.quant_config(idx)
        assert isinstance(config, ModelOptNvFp4Config) and config.is_weight_only
        assert not control.quant_config(idx).is_weight_only
    # No input scale in a W4A16 file; the weights are the W4A4 file's, bytes.
    names = [n for n in ckpt.weight_map if "input" in n]
    assert names == [] and any("input" in n for n in control.weight_map)
    a, b = loaded(ckpt, 1), loaded(control, 1)
    for name, p in b.named_parameters():
        q = getattr(a, name)
        if "input_scale" in name:
            assert (q == 1).all() and not (p == 1).all(), name
        elif p.dtype == torch.float32:  # CT stores the inverse: 1/(1/x)
            torch.testing.assert_close(q, p, rtol=2e-7, atol=0)
        else:
            assert torch.equal(bytes_of(q), bytes_of(p)), name


@pytest.mark.parametrize("fmt", [MODELOPT, COMPRESSED_TENSORS])
def test_present_input_scale_is_ignored_in_w4a16(tmp_path, fmt):
    from safetensors.torch import load_file, save_file

    path = write_layers(
        tmp_path,
        fmt,
        quant_mode=W4A16,
        w4a16_input_scales=True,
        max_shard_bytes=1 << 30,
    )
    suffix = "input_scale" if fmt == MODELOPT else "input_global_scale"
    shard = path / "model-00001-of-00001.safetensors"
    tensors = load_file(shard)
    names = [n for n in tensors if n.endswith(suffix)]
    assert len(names) == len(LAYERS) * E * 3
    # A value the W4A4 reader refuses (see the control below): never read.
    for n in names:
        tensors[n] = torch.full_like(tensors[n], float("nan"))
    save_file(tensors, shard)
    ckpt = NVFP4MoECheckpoint(path)
    yielded = {s for _, _, _, s, _ in ckpt.iter_layer_tensors(0)}
    assert yielded == {"weight", "weight_scale", "weight_scale_2"}
    layer = loaded(ckpt, 0)
    assert (layer.w13_input_scale == 1).all() and (layer.w2_input_scale == 1).all()
    # Control: the same file declared W4A4 reads the input scales and refuses.
    q = json.loads((path / "config.json").read_text())
    if fmt == MODELOPT:
        (path / "hf_quant_config.json").write_text(
            json.dumps({"quantization": {"quant_algo": "NVFP4"}})
        )
    else:
        group = q["quantization_config"]["config_groups"]["group_0"]
        group["input_activations"] = dict(group["weights"])
        (path / "config.json").write_text(json.dumps(q))
    control = NVFP4MoECheckpoint(path)
    with pytest.raises(ValueError, match="is nan"):
        control.load_layer(make_layer(place=False, mode=W4A4), 0)


MIXED = {0: W4A16, 1: W4A4, 2: W4A16}


@pytest.mark.parametrize("fmt", [MODELOPT, COMPRESSED_TENSORS])
def test_mixed_checkpoint_gives_each_layer_its_own_mode(tmp_path, fmt):
    path = write_layers(tmp_path, fmt, quant_mode=MIXED)
    q = quant_json(path)
    if fmt == MODELOPT:
        assert q["quant_algo"] == "MIXED_PRECISION"
    else:
        modes = {
            g["input_activations"] is None
            for g in q["config_groups"].values()
            if g["format"] == "nvfp4-pack-quantized"
        }
        assert modes == {True, False}  # one W4A16 group, one W4A4 group
    ckpt = NVFP4MoECheckpoint(path)
    assert {i: ckpt.quant_mode(i) for i in LAYERS} == MIXED
    assert {i: ckpt.quant_config(i).quant_mode for i in LAYERS} == MIXED
    assert ckpt.quant_config(0) is not ckpt.quant_config(0)  # each layer its own
    w4a4_layer = loaded(ckpt, 1)
    assert not (w4a4_layer.w13_input_scale == 1).all()  # read in W4A4
    w4a16_layer = loaded(ckpt, 2)
    assert (w4a16_layer.w13_input_scale == 1).all()
    # A layer built with the other layer's config is refused, untouched.
    wrong = make_layer(place=False, mode=W4A4)
    with pytest.raises(
        ValueError,
        match="layer 0's experts are w4a16, the layer "
        r"is built for w4a4.*quant_config\(0\)",
    ):
        ckpt.load_layer(wrong, 0)
    assert (wrong.w13_weight == 0).all()
    with pytest.raises(ValueError, match="layer 1's experts are w4a4"):
        ckpt.load_layer(make_layer(place=False, mode=W4A16), 1)
    with pytest.raises(ValueError, match="layer 7 has no routed experts"):
        ckpt.quant_mode(7)


def test_w4a4_checkpoint_loads_as_before(tmp_path):
    # The default writer output and the W4A4 reader: input scales loaded, the
    # mode W4A4 for every layer, a layer built with the default config works.
    ckpt = NVFP4MoECheckpoint(write_layers(tmp_path))
    assert [ckpt.quant_mode(i) for i in LAYERS] == [W4A4] * 3
    assert quant_json(tmp_path)["quant_algo"] == "NVFP4"
    layer = make_layer(place=False, quant_config=ModelOptNvFp4Config.for_mode())
    ckpt.load_layer(layer, 0)
    expected = torch.full((E, 2), 8.0 / (448 * 6))  # act_amax / (448 * 6)
    torch.testing.assert_close(layer.w13_input_scale.data, expected)


# --- the writer ---------------------------------------------------------------


def test_writer_refuses_bad_modes(tmp_path):
    for bad in ("w8a8", {0: W4A16}, {0: W4A16, 1: W4A4, 2: "nvfp4"}):
        with pytest.raises(ValueError, match="quant_mode must be 'w4a4' or"):
            write_layers(tmp_path, quant_mode=bad)
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("fmt", [MODELOPT, COMPRESSED_TENSORS])
@pytest.mark.parametrize("quant_mode", [W4A16, "mixed"])
def test_writer_cli(tmp_path, capsys, fmt, quant_mode):
    args = writer_cli_args(
        tmp_path, "--format", fmt, "--quant-mode", quant_mode, layers=3
    )
    writer.main(args)
    assert f"({fmt}, {quant_mode})" in capsys.readouterr().out
    ckpt = NVFP4MoECheckpoint(tmp_path)
    want = [W4A16] * 3 if quant_mode == W4A16 else [W4A16, W4A4, W4A16]
    assert [ckpt.quant_mode(i) for i in range(3)] == want
    if fmt == MODELOPT:
        algo = quant_json(tmp_path)["quant_algo"]
        assert algo == ("W4A16_NVFP4" if quant_mode == W4A16 else "MIXED_PRECISION")


def test_writer_cli_per_layer_and_bad_quant(tmp_path, capsys):
    writer.main(writer_cli_args(tmp_path, "--quant-mode", W4A16, "--per-layer"))
    q = quant_json(tmp_path)
    assert q["quant_algo"] == "MIXED_PRECISION"
    assert q["quantized_layers"][EXPERTS.format(0)]["quant_algo"] == "W4A16_NVFP4"
    assert NVFP4MoECheckpoint(tmp_path).quant_mode(0) == W4A16
    with pytest.raises(SystemExit) as exit_:
        writer.main([str(tmp_path / "x"), "--quant-mode", "w4a8"])
    assert exit_.value.code == 2
    assert "invalid choice: 'w4a8'" in capsys.readouterr().err
