# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The routing a MoE checkpoint's config declares (``NVFP4MoECheckpoint.
routing``): softmax top-k, renormalized as ``norm_topk_prob`` or the
architecture says; anything else refused naming the key."""

import json

import pytest
import torch

from tests.kernels.moe.moe_reference import torch_moe
from tests.kernels.moe.utils import dequantized_checkpoint_layer, rel_rms_error
from vllm.model_executor.layers.fused_moe.layer import FusedMoE
from vllm.model_executor.model_loader.moe_routing import (
    MoERouting,
    moe_routing_from_config,
)
from vllm.model_executor.model_loader.nvfp4_checkpoint_writer import (
    random_bf16_experts,
    write_nvfp4_moe_checkpoint,
)
from vllm.model_executor.model_loader.nvfp4_moe_checkpoint import NVFP4MoECheckpoint

E, H, I, TOPK = 8, 256, 128, 2  # noqa: E741

READABLE = [
    # (config, renormalize, source)
    ({"model_type": "qwen3_moe"}, False, "norm_topk_prob default of qwen3_moe"),
    ({"model_type": "qwen3_moe", "norm_topk_prob": True}, True, "norm_topk_prob"),
    ({"model_type": "qwen2_moe"}, False, "norm_topk_prob default of qwen2_moe"),
    ({"model_type": "olmoe"}, False, "norm_topk_prob default of olmoe"),
    ({"model_type": "qwen3_next"}, True, "norm_topk_prob default of qwen3_next"),
    ({"model_type": "qwen3_next", "norm_topk_prob": False}, False, "norm_topk_prob"),
    ({"model_type": "mixtral"}, True, "model_type mixtral"),
    ({"model_type": "qwen3_5_moe_text"}, True, "model_type qwen3_5_moe_text"),
    (
        {"model_type": "qwen3_5_moe_text", "norm_topk_prob": True},
        True,
        "model_type qwen3_5_moe_text",
    ),
    ({"norm_topk_prob": False}, False, "norm_topk_prob"),  # no model_type
    (
        {
            "model_type": "qwen3_moe",
            "scoring_func": "softmax",
            "n_group": 1,
            "topk_group": 1,
            "routed_scaling_factor": 1.0,
            "topk_method": "greedy",
        },
        False,
        "norm_topk_prob default of qwen3_moe",
    ),
]


@pytest.mark.parametrize("config,renormalize,source", READABLE)
def test_declared_routing_is_read(config, renormalize, source):
    routing = moe_routing_from_config(config, TOPK, "config.json")
    assert routing == MoERouting(TOPK, renormalize, source)
    assert routing.layer_kwargs() == {"top_k": TOPK, "renormalize": renormalize}


REFUSED = [
    # (config, the key the message names)
    ({"model_type": "deepseek_v3"}, "model_type 'deepseek_v3'"),
    ({"model_type": "nemotron_h", "norm_topk_prob": True}, "model_type 'nemotron_h'"),
    ({"model_type": "qwen3_moe", "scoring_func": "sigmoid"}, "scoring_func"),
    ({"model_type": "qwen3_moe", "topk_method": "noaux_tc"}, "topk_method"),
    ({"model_type": "qwen3_moe", "n_group": 8}, "n_group"),
    ({"model_type": "qwen3_moe", "topk_group": 4}, "topk_group"),
    (
        {"model_type": "qwen3_moe", "routed_scaling_factor": 2.5},
        "routed_scaling_factor",
    ),
    ({"model_type": "qwen3_moe", "n_group": True}, "n_group"),
    ({"model_type": "qwen3_moe", "norm_topk_prob": "yes"}, "norm_topk_prob"),
    ({"model_type": "qwen3_moe", "norm_topk_prob": 1}, "norm_topk_prob"),
    ({"model_type": "qwen3_5_moe_text", "norm_topk_prob": False}, "norm_topk_prob"),
    ({"model_type": "some_moe"}, "norm_topk_prob"),
    ({}, "norm_topk_prob"),
]


@pytest.mark.parametrize("config,key", REFUSED)
def test_other_routing_is_refused_naming_the_key(config, key):
    with pytest.raises(ValueError, match="ckpt/config.json: .*" + key.split()[0]):
        moe_routing_from_config(config, TOPK, "ckpt/config.json")


def _checkpoint(tmp_path, config: dict) -> NVFP4MoECheckpoint:
    layers = {0: random_bf16_experts(E, H, I, True, seed=0)}
    base = {
        "hidden_size": H,
        "num_experts": E,
        "num_experts_per_tok": TOPK,
        "moe_intermediate_size": I,
    }
    write_nvfp4_moe_checkpoint(tmp_path, layers, {**base, **config})
    return NVFP4MoECheckpoint(tmp_path)


def test_a_nested_text_config_declares_the_routing(tmp_path):
    # Qwen3.5-MoE: the text model's config under text_config, whose
    # model_type always renormalizes; a contradiction there is refused.
    ckpt = _checkpoint(tmp_path / "a", {"model_type": "qwen3_5_moe"})
    assert ckpt.routing.renormalize
    layers = {0: random_bf16_experts(E, H, I, True, seed=0)}
    text = {
        "model_type": "qwen3_5_moe_text",
        "hidden_size": H,
        "num_experts": E,
        "num_experts_per_tok": TOPK,
        "moe_intermediate_size": I,
    }
    out = tmp_path / "b"
    write_nvfp4_moe_checkpoint(
        out, layers, {"model_type": "qwen3_5_moe", "text_config": text}
    )
    assert NVFP4MoECheckpoint(out).routing.source == "model_type qwen3_5_moe_text"
    cfg = json.loads((out / "config.json").read_text())
    cfg["text_config"]["norm_topk_prob"] = False
    (out / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=f"{out}/config.json: norm_topk_prob"):
        NVFP4MoECheckpoint(out).routing  # noqa: B018


@pytest.mark.parametrize("norm", [False, True])
def test_a_layer_built_with_the_checkpoints_routing_computes_its_function(
    tmp_path, norm
):
    # Qwen3-MoE with norm_topk_prob as written: the layer built with
    # ckpt.routing matches the reference routed the same way and misses the
    # other (the control: renormalizing or not changes every output).
    ckpt = _checkpoint(tmp_path, {"model_type": "qwen3_moe", "norm_topk_prob": norm})
    assert ckpt.routing.renormalize is norm
    layer = FusedMoE(
        num_experts=ckpt.num_experts,
        hidden_size=ckpt.hidden_size,
        intermediate_size=ckpt.intermediate_size,
        activation=ckpt.activation,
        quant_config=ckpt.quant_config(0),
        moe_backend="flashinfer_b12x_emulated",
        experts_kwargs={"bf16_activations": True},
        **ckpt.routing.layer_kwargs(),
    )
    ckpt.load_layer(layer, 0)
    layer.quant_method.process_weights_after_loading(layer)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(16, H, generator=gen).bfloat16()
    logits = torch.randn(16, E, generator=gen)
    w13, w2 = dequantized_checkpoint_layer(ckpt, 0, gated=True)
    out = layer(x, logits)
    same = torch_moe(x, w13, w2, logits, TOPK, renormalize=norm)
    other = torch_moe(x, w13, w2, logits, TOPK, renormalize=not norm)
    assert rel_rms_error(out, same) < 0.01
    assert rel_rms_error(out, other) > 0.1


def test_the_example_checkpoint_declares_its_routing(tmp_path):
    # The writer's example config (Qwen3.5-MoE's text model) renormalizes.
    from vllm.model_executor.model_loader.nvfp4_checkpoint_writer import main

    out = tmp_path / "example"
    main(
        [
            str(out),
            "--num-layers",
            "1",
            "--num-experts",
            "8",
            "--hidden-size",
            "256",
            "--intermediate-size",
            "128",
            "--top-k",
            "2",
        ]
    )
    routing = NVFP4MoECheckpoint(out).routing
    assert routing == MoERouting(2, True, "model_type qwen3_5_moe_text")
