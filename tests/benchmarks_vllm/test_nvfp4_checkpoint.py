# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The synthetic NVFP4 checkpoint writer: names, shapes, dtypes, scale
conventions of both formats (loading in vLLM: test_moe_weight_prep.py)."""

import json

import pytest
import torch
from safetensors import safe_open

from nvfp4_checkpoint import PRESETS, write_checkpoint

TINY = PRESETS["tiny"]
E, H, INTER = TINY.num_experts, TINY.hidden_size, TINY.intermediate_size
F8_E4M3_MAX, F4_E2M1_MAX = 448.0, 6.0


def _tensors(directory, layer: int = 0) -> dict[str, torch.Tensor]:
    with safe_open(directory / f"model-layer{layer:03d}.safetensors", "pt") as f:
        return {k: f.get_tensor(k) for k in list(f.keys())}


@pytest.fixture(scope="module")
def both(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    return (
        write_checkpoint(root / "mo", TINY, 1, "modelopt"),
        write_checkpoint(root / "ct", TINY, 1, "compressed-tensors"),
    )


def test_modelopt_expert_tensors(both):
    mo, _ = both
    t = _tensors(mo)
    p = "model.layers.0.mlp.experts.3"
    for proj, (n, k) in {
        "gate_proj": (INTER, H),
        "up_proj": (INTER, H),
        "down_proj": (H, INTER),
    }.items():
        assert t[f"{p}.{proj}.weight"].dtype == torch.uint8
        assert t[f"{p}.{proj}.weight"].shape == (n, k // 2)
        scale = t[f"{p}.{proj}.weight_scale"]
        assert scale.dtype == torch.float8_e4m3fn and scale.shape == (n, k // 16)
        assert scale.float().min() >= 32 and scale.float().max() <= F8_E4M3_MAX
        for name in ("weight_scale_2", "input_scale"):
            assert t[f"{p}.{proj}.{name}"].dtype == torch.float32
            assert t[f"{p}.{proj}.{name}"].shape == ()
    # Dequantization direction, amax / (6 * 448), one for gate and up.
    s2 = t[f"{p}.gate_proj.weight_scale_2"]
    assert torch.equal(s2, t[f"{p}.up_proj.weight_scale_2"])
    assert 0.05 <= s2 * F4_E2M1_MAX * F8_E4M3_MAX <= 0.5
    assert t["model.layers.0.mlp.gate.weight"].dtype == torch.bfloat16
    quant = json.loads((mo / "hf_quant_config.json").read_text())["quantization"]
    assert quant["quant_algo"] == "NVFP4" and quant["kv_cache_quant_algo"] is None
    assert "quantization_config" not in json.loads((mo / "config.json").read_text())


def test_compressed_tensors_is_the_same_draw_in_its_convention(both):
    mo, ct = both
    a, b = _tensors(mo), _tensors(ct)
    p = "model.layers.0.mlp.experts.5.up_proj"
    assert torch.equal(a[f"{p}.weight"], b[f"{p}.weight_packed"])
    assert torch.equal(
        a[f"{p}.weight_scale"].view(torch.uint8),
        b[f"{p}.weight_scale"].view(torch.uint8),
    )
    # Quantization direction: the inverse, shape [1].
    assert b[f"{p}.weight_global_scale"].shape == (1,)
    torch.testing.assert_close(
        b[f"{p}.weight_global_scale"] * a[f"{p}.weight_scale_2"], torch.ones(1)
    )
    torch.testing.assert_close(
        b[f"{p}.input_global_scale"] * a[f"{p}.input_scale"], torch.ones(1)
    )
    config = json.loads((ct / "config.json").read_text())["quantization_config"]
    assert config["format"] == "nvfp4-pack-quantized"
    assert not (ct / "hf_quant_config.json").exists()


def test_index_names_every_tensor(both):
    mo, _ = both
    index = json.loads((mo / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == {
        *_tensors(mo),
        "model.embed_tokens.weight",
        "lm_head.weight",
        "model.norm.weight",
    }


def test_rejects_unknown_format(tmp_path):
    with pytest.raises(ValueError, match="fmt must be one of"):
        write_checkpoint(tmp_path, TINY, 1, "gguf")
