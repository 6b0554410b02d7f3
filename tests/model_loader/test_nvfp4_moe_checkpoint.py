# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Loading NVFP4 MoE checkpoints (ModelOpt, compressed-tensors) into FusedMoE:
the weight loader, the reader, transformers as the oracle, reload and a
load that fails between two files."""

import pytest
import torch

from tests.kernels.moe.utils import (
    dequantized_checkpoint_layer,
    rel_rms_error,
    split_cat_halves,
)
from tests.kernels.utils import bytes_of
from tests.model_loader.nvfp4_ckpt_utils import (
    TOPK,
    E,
    H,
    I,
    make_layer,
    params_bytes,
    qwen_config,
    write_ckpt,
)
from vllm.model_executor.layers.fused_moe import fused_topk
from vllm.model_executor.model_loader.nvfp4_checkpoint_writer import (
    random_bf16_experts,
    write_nvfp4_moe_checkpoint,
)
from vllm.model_executor.model_loader.nvfp4_moe_checkpoint import (
    COMPRESSED_TENSORS,
    MODELOPT,
    NVFP4MoECheckpoint,
)

# --- weight_loader -------------------------------------------------------------------


def _shard(rows, cols, value, dtype=torch.uint8):
    return torch.full((rows, cols), value, dtype=torch.uint8).view(dtype)


def test_weight_loader_places_shards_and_scalars():
    layer = make_layer(place=False)
    gate = _shard(I, H // 2, 1)
    up = _shard(I, H // 2, 2)
    assert layer.weight_loader(layer.w13_weight, gate, "gate", "w1", 3)
    assert layer.weight_loader(layer.w13_weight, up, "up", "w3", 3)
    assert (layer.w13_weight[3, :I] == 1).all() and (layer.w13_weight[3, I:] == 2).all()
    layer.weight_loader(layer.w13_weight_scale_2, torch.tensor(0.5), "g", "w1", 3)
    layer.weight_loader(layer.w13_weight_scale_2, torch.tensor(2.0), "u", "w3", 3)
    assert layer.w13_weight_scale_2[3].tolist() == [0.5, 2.0]
    layer.weight_loader(layer.w2_weight_scale_2, torch.tensor([0.25]), "d", "w2", 3)
    assert layer.w2_weight_scale_2[3].item() == 0.25

    placed = make_layer(place=True)  # [w3; w1] at load
    placed.weight_loader(placed.w13_weight, gate, "gate", "w1", 0)
    placed.weight_loader(placed.w13_weight, up, "up", "w3", 0)
    assert (placed.w13_weight[0, :I] == 2).all() and (
        placed.w13_weight[0, I:] == 1
    ).all()
    placed.weight_loader(placed.w13_weight_scale_2, torch.tensor(0.5), "g", "w1", 0)
    assert placed.w13_weight_scale_2[0].tolist() == [1.0, 0.5]


def test_weight_loader_tensor_parallel():
    # Full checkpoint tensors, rows/columns numbered so each rank's slice shows.
    full_w1 = (
        torch.arange(2 * 64, dtype=torch.int64)
        .view(64 * 2, 1)
        .expand(128, H // 2)
        .to(torch.uint8)
        .contiguous()
    )
    full_w2 = (
        torch.arange(I // 2, dtype=torch.uint8).view(1, -1).expand(H, -1).contiguous()
    )
    for rank in (0, 1):
        layer = make_layer(place=False, tp_rank=rank, tp_size=2)
        assert layer.w13_weight.shape == (E, I, H // 2)  # 2 * I/2 rows
        layer.weight_loader(layer.w13_weight, full_w1, "g", "w1", 0)
        layer.weight_loader(layer.w2_weight, full_w2, "d", "w2", 0)
        rows = layer.w13_weight[0, : I // 2, 0].tolist()
        assert rows == list(range(rank * 64, rank * 64 + 64))
        assert layer.w2_weight[0, 0].tolist() == list(range(rank * 32, rank * 32 + 32))


def test_weight_loader_expert_parallel():
    layer = make_layer(place=False, ep_rank=1, ep_size=2)
    assert layer.local_num_experts == 4 and layer.w13_weight.shape[0] == 4
    w = _shard(I, H // 2, 7)
    assert not layer.weight_loader(layer.w13_weight, w, "g", "w1", 2)  # rank 0's
    assert (layer.w13_weight == 0).all()
    assert layer.weight_loader(layer.w13_weight, w, "g", "w1", 5)  # local 1
    assert (layer.w13_weight[1, :I] == 7).all()
    assert layer.map_global_expert(4) == 0 and layer.map_global_expert(3) is None
    # The W4A4 kernel does not support expert parallelism; the layer says so.
    from vllm.model_executor.layers.fused_moe.experts.flashinfer_b12x_call import (
        b12x_config_problems,
    )

    problems = b12x_config_problems(layer.moe_config, weight_only=False)
    assert any("expert parallelism" in p for p in problems), problems


def test_weight_loader_errors_name_the_tensor():
    layer = make_layer(place=False)
    msg = (
        r"experts.0.gate_proj.weight: expected shape \(128, 128\) for "
        r"w13_weight\[w1\], got \(64, 128\)"
    )
    with pytest.raises(ValueError, match=msg):
        layer.weight_loader(
            layer.w13_weight,
            _shard(64, H // 2, 1),
            "experts.0.gate_proj.weight",
            "w1",
            0,
        )
    with pytest.raises(ValueError, match="expected dtype torch.float8_e4m3fn"):
        layer.weight_loader(layer.w13_weight_scale, _shard(I, H // 16, 1), "s", "w1", 0)
    with pytest.raises(ValueError, match="expected shape"):
        layer.weight_loader(layer.w2_weight, _shard(H, 3, 1), "d", "w2", 0)
    with pytest.raises(ValueError, match="floating scalar"):
        layer.weight_loader(layer.w2_weight_scale_2, torch.ones(2), "d", "w2", 0)
    with pytest.raises(ValueError, match="shard w2 cannot go into w13_weight"):
        layer.weight_loader(layer.w13_weight, _shard(I, H // 2, 1), "x", "w2", 0)
    with pytest.raises(ValueError, match="shard_id must be"):
        layer.weight_loader(layer.w13_weight, _shard(I, H // 2, 1), "x", "w4", 0)
    with pytest.raises(ValueError, match="out of range"):
        layer.weight_loader(layer.w13_weight, _shard(I, H // 2, 1), "x", "w1", E)
    assert (layer.w13_weight == 0).all()


# --- the reader -------------------------------------------------------------------


@pytest.mark.parametrize("place", [True, False], ids=["place_w3w1", "reorder_after"])
def test_both_formats_load_the_same_layer(tmp_path, place):
    write_ckpt(tmp_path / "mo", MODELOPT, max_shard_bytes=64 << 10)
    write_ckpt(tmp_path / "ct", COMPRESSED_TENSORS)
    write_ckpt(tmp_path / "mo_cfg", MODELOPT, quant_config_in_config_json=True)
    loaded = {}
    for name in ("mo", "ct", "mo_cfg"):
        ckpt = NVFP4MoECheckpoint(tmp_path / name)
        assert ckpt.moe_layers == [0, 1]
        assert (ckpt.num_experts, ckpt.top_k, ckpt.hidden_size) == (E, TOPK, H)
        layer = make_layer(place=place)
        ckpt.load_layer(layer, 1)
        loaded[name] = layer
    assert NVFP4MoECheckpoint(tmp_path / "ct").format == COMPRESSED_TENSORS
    assert len(set(NVFP4MoECheckpoint(tmp_path / "mo").weight_map.values())) > 1
    ref = loaded["mo"]
    for other in ("ct", "mo_cfg"):
        for n, p in ref.named_parameters():
            q = getattr(loaded[other], n)
            if p.dtype == torch.float32:  # CT stores the inverse: 1/(1/x)
                torch.testing.assert_close(q, p, rtol=2e-7, atol=0)
            else:
                assert torch.equal(bytes_of(q), bytes_of(p)), (other, n)
    # Per-shard global scales differ between gate and up (separate amax).
    assert (ref.w13_weight_scale_2[:, 0] != ref.w13_weight_scale_2[:, 1]).any()


def test_place_at_load_and_reorder_after_prepare_identically(tmp_path):
    write_ckpt(tmp_path)
    ckpt = NVFP4MoECheckpoint(tmp_path)
    placed, reordered = make_layer(place=True), make_layer(place=False)
    for layer in (placed, reordered):
        ckpt.load_layer(layer, 0)
    assert not torch.equal(placed.w13_weight, reordered.w13_weight)
    steps = [n for n, _ in placed.quant_method.preparation_steps(placed)]
    assert "reorder" in steps
    for layer in (placed, reordered):
        layer.quant_method.process_weights_after_loading(layer)
    a, b = params_bytes(placed), params_bytes(reordered)
    assert a.keys() == b.keys()
    # The [E, 2] global and input scales stay in each layer's load order
    # (gate first, or up first when placed at load): the same values with
    # their two columns exchanged. Everything else is the same bytes.
    per_shard = ("w13_weight_scale_2", "w13_input_scale")
    for n in a:
        if n in per_shard:
            p, r = getattr(placed, n), getattr(reordered, n)
            assert torch.equal(bytes_of(p.flip(-1).contiguous()), bytes_of(r)), n
        else:
            assert torch.equal(a[n], b[n]), n
    # (The writer gives gate and up their own global scales: the control.)
    assert not torch.equal(placed.w13_weight_scale_2, reordered.w13_weight_scale_2)
    # And the layers compute the same function, bit for bit.
    x = torch.randn(5, placed.moe_config.hidden_dim, dtype=torch.bfloat16)
    logits = torch.randn(5, placed.global_num_experts)
    assert torch.equal(placed(x, logits), reordered(x, logits))


# --- validation against transformers -------------------------------------------


def _transformers_experts(gated):
    pytest.importorskip("transformers")
    if gated:
        from transformers.models.qwen3_5_moe.configuration_qwen3_5_moe import (
            Qwen3_5MoeTextConfig as Config,
        )
        from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import (
            Qwen3_5MoeExperts as Experts,
        )

        experts = {"num_experts": E}
    else:
        from transformers import NemotronHConfig as Config
        from transformers.models.nemotron_h.modeling_nemotron_h import (
            NemotronHExperts as Experts,
        )

        experts = {"n_routed_experts": E}
    cfg = Config(
        hidden_size=H, moe_intermediate_size=I, num_experts_per_tok=TOPK, **experts
    )
    return cfg, Experts(cfg)


@pytest.mark.parametrize("fmt", [MODELOPT, COMPRESSED_TENSORS])
@pytest.mark.parametrize("gated", [True, False], ids=["qwen3_5_moe", "nemotron_h"])
def test_matches_transformers_experts(tmp_path, gated, fmt):
    cfg, experts = _transformers_experts(gated)
    assert cfg.hidden_size == H
    # transformers' experts get random weights, scaled so that every folded
    # block scale (block amax / 6) stays in FP8's normal range (>= 2^-6).
    first = experts.gate_up_proj if gated else experts.up_proj
    w13, w2 = (4 * w for w in random_bf16_experts(E, H, I, gated, seed=5))
    assert tuple(first.shape) == tuple(w13.shape)
    with torch.no_grad():
        first.copy_(w13)
        experts.down_proj.copy_(w2)
    w13, w2 = first.detach().clone(), experts.down_proj.detach().clone()
    # Export to an NVFP4 checkpoint. Power-of-two global scales make the
    # preparation's scale fold exact, so FusedMoE and transformers compute the
    # same function on the same (dequantized) weights.
    block, prefix = ("mlp", "model.layers") if gated else ("mixer", "backbone.layers")
    write_nvfp4_moe_checkpoint(
        tmp_path,
        {3: (w13, w2)},
        qwen_config(),
        fmt=fmt,
        gated=gated,
        block=block,
        prefix=prefix,
        pow2_global_scales=True,
    )
    ckpt = NVFP4MoECheckpoint(tmp_path)
    assert ckpt.activation == ("silu" if gated else "relu2")
    layer = make_layer(gated=gated, experts_kwargs={"bf16_activations": True})
    ckpt.load_layer(layer, 3, progress=True)
    layer.quant_method.process_weights_after_loading(layer)

    dw13, dw2 = dequantized_checkpoint_layer(ckpt, 3, gated)
    # The file holds the BF16 source weights (up to NVFP4 rounding, ~0.1
    # relative RMS), in the right order: an export that swapped gate and up
    # (or the halves of a non-gated w13) would be ~1.4 away.
    assert rel_rms_error(dw13, w13) < 0.15 and rel_rms_error(dw2, w2) < 0.15
    assert rel_rms_error(dw13, split_cat_halves(w13, dim=1)) > 1.0
    with torch.no_grad():
        first.copy_(dw13)
        experts.down_proj.copy_(dw2)
    gen = torch.Generator().manual_seed(6)
    x = torch.randn(32, H, generator=gen).bfloat16()
    logits = torch.randn(32, E, generator=gen)
    weights, ids = fused_topk(x, logits, TOPK, renormalize=True)
    out = layer(x, logits)
    ref = experts.float()(x.float(), ids.long(), weights)
    # Tolerance: the two differ only where FusedMoE rounds to BF16 (the
    # intermediate and the output: 8 significant bits, relative rounding
    # <= 2^-9 ~ 0.002 each), so the relative RMS error is a few 1e-3 (0.0024).
    err = rel_rms_error(out, ref)
    assert err < 0.01, err
    # Negative control: transformers with the two halves of w13 swapped (gate
    # and up, or the I rows of a non-gated expert) misses by far.
    with torch.no_grad():
        first.copy_(split_cat_halves(dw13, dim=1))
    wrong = experts(x.float(), ids.long(), weights)
    assert rel_rms_error(out, wrong) > 50 * 0.01


@pytest.mark.parametrize("fmt", [MODELOPT, COMPRESSED_TENSORS])
def test_load_layer_into_a_prepared_layer_equals_a_fresh_layer(tmp_path, fmt):
    # An RL weight update: a second checkpoint loaded into the live, prepared
    # layer, then prepared again.
    for name, seed in (("a", 0), ("b", 7)):
        layers = {0: random_bf16_experts(E, H, I, True, seed=seed)}
        write_nvfp4_moe_checkpoint(tmp_path / name, layers, qwen_config(), fmt=fmt)
    first = NVFP4MoECheckpoint(tmp_path / "a")
    second = NVFP4MoECheckpoint(tmp_path / "b")
    layer = make_layer()
    first.load_layer(layer, 0)
    layer.quant_method.process_weights_after_loading(layer)
    second.load_layer(layer, 0)
    layer.quant_method.process_weights_after_loading(layer)
    fresh = make_layer()
    second.load_layer(fresh, 0)
    fresh.quant_method.process_weights_after_loading(fresh)
    a, b = params_bytes(layer), params_bytes(fresh)
    for n in a:
        assert torch.equal(a[n], b[n]), n
    x = torch.randn(8, H, generator=torch.Generator().manual_seed(1)).bfloat16()
    logits = torch.randn(8, E, generator=torch.Generator().manual_seed(2))
    assert torch.equal(layer(x, logits), fresh(x, logits))


# --- a load that fails between two files ---------------------------------------------


@pytest.mark.parametrize("prepared", [False, True], ids=["fresh", "reload"])
def test_unreadable_second_file_leaves_the_layer_torn_not_mixed(tmp_path, prepared):
    """load_layer holds the layer for the whole load: when a later file
    cannot be read after earlier tensors were written, the layer is torn
    (preparation and forward refused) until a complete reload; that reload
    gives the bytes of a clean load."""
    write_ckpt(tmp_path, max_shard_bytes=64 << 10)
    ckpt = NVFP4MoECheckpoint(tmp_path)
    names = [n for n, *_ in ckpt.iter_layer_tensors(0, range(E))]
    first, last = ckpt.weight_map[names[0]], ckpt.weight_map[names[-1]]
    assert first != last  # the error comes after the first file's tensors
    clean = make_layer()
    ckpt.load_layer(clean, 0)
    clean.quant_method.process_weights_after_loading(clean)

    layer = make_layer()
    if prepared:  # a reload of other weights into a prepared layer
        ckpt.load_layer(layer, 1)
        layer.quant_method.process_weights_after_loading(layer)
    good = (tmp_path / last).read_bytes()
    (tmp_path / last).write_bytes(good[: len(good) // 2])
    # Opened anew, the checkpoint is refused before any layer (every
    # shard's header is read); opened while it was whole, as here, the
    # damage is met in the middle of the load.
    with pytest.raises(ValueError, match=last):
        NVFP4MoECheckpoint(tmp_path)
    with pytest.raises(ValueError, match=last):
        ckpt.load_layer(layer, 0)
    with pytest.raises(RuntimeError, match="torn"):
        layer.quant_method.process_weights_after_loading(layer)
    x = torch.randn(3, H, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="torn|not prepared"):
        layer(x, torch.randn(3, E))

    (tmp_path / last).write_bytes(good)
    NVFP4MoECheckpoint(tmp_path).load_layer(layer, 0)
    layer.quant_method.process_weights_after_loading(layer)
    got, want = params_bytes(layer), params_bytes(clean)
    assert got.keys() == want.keys()
    for n in want:
        assert torch.equal(got[n], want[n]), n
    assert torch.equal(layer(x, torch.ones(3, E)), clean(x, torch.ones(3, E)))
