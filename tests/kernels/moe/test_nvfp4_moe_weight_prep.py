# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The whole b12x weight preparation: exact, bounded, and measured."""

import pytest
import torch

from tests.kernels.moe.moe_reference import torch_moe
from tests.kernels.moe.utils import (
    bf16_experts,
    dequantized_experts,
    fold_reference,
    load_nvfp4_experts,
    make_nvfp4_layer,
    quantize_experts_modelopt,
    rel_rms_error,
)
from tests.kernels.utils import DEVICES, bytes_of, random_bits
from vllm.benchmarks.legacy_moe_prep import (
    legacy_fold,
    legacy_preparation_steps,
    split_cat_halves,
)
from vllm.benchmarks.moe_model_presets import get_preset
from vllm.benchmarks.moe_prep_precision import prepared_weight_precision
from vllm.benchmarks.moe_synthetic_weights import synthetic_layer_tensors
from vllm.model_executor.layers.quantization.utils.blockscale_fold import (
    fold_global_scale_into_blockscale_,
)
from vllm.model_executor.layers.quantization.utils.blockscale_swizzle import (
    blockscale_storage_for_swizzle,
    swizzle_blockscale_bounded,
    unswizzle_blockscale_bounded_,
)
from vllm.model_executor.layers.quantization.utils.nvfp4_utils import (
    swizzle_blockscale,
    unswizzle_blockscale,
)
from vllm.utils.mem_utils import measure_peak_memory

MIB = 1 << 20
BACKEND = "flashinfer_b12x_emulated"  # same preparation as flashinfer_b12x

# (E, H, I, gated): scaled-down real shapes; I = 80 needs row padding
# (2I or I not a multiple of 128) and H/16 or I/16 not a multiple of 4 needs
# column padding.
LAYER_SHAPES = [
    (4, 256, 128, True),
    (3, 192, 80, True),
    (2, 320, 80, False),
    (4, 128, 64, False),
]
CAPS = [16 << 10, 4 * MIB, 64 * MIB]


def random_layer_tensors(e, h, i, gated, seed, device="cpu"):
    """Random ModelOpt tensors (valid FP8 scales; w1/w3 scales differ)."""
    rows = 2 * i if gated else i
    gen = torch.Generator().manual_seed(seed)

    def scales(shape):
        raw = torch.randint(0x08, 0x78, shape, dtype=torch.uint8, generator=gen)
        return raw.view(torch.float8_e4m3fn)

    shards = 2 if gated else 1
    tensors = {
        "w13_weight": random_bits((e, rows, h // 2), torch.uint8, "cpu", seed + 1),
        "w13_weight_scale": scales((e, rows, h // 16)),
        "w13_weight_scale_2": torch.rand(e, shards, generator=gen) * 4 + 0.01,
        "w13_input_scale": torch.rand(e, shards, generator=gen),
        "w2_weight": random_bits((e, h, i // 2), torch.uint8, "cpu", seed + 2),
        "w2_weight_scale": scales((e, h, i // 16)),
        "w2_weight_scale_2": torch.rand(e, generator=gen) * 4 + 0.01,
        "w2_input_scale": torch.rand(e, generator=gen),
    }
    return {k: v.to(device) for k, v in tensors.items()}


def whole_tensor_preparation(t: dict, gated: bool, mode: str = "alpha") -> dict:
    """Test-side reference: the same preparation done the straightforward way,
    on whole tensors (float32 fold, split+cat reorder, padded swizzle).

    ``mode="fold"``: every global scale folded into the block scales, then 1.
    ``mode="alpha"``: every block scale as loaded (reordered and swizzled
    only). The [E, 2] global scales stay as loaded.
    Also the kernel's alphas: ``w1_alpha`` = the gate's (w1's) global
    scale, ``w2_alpha`` = w2's times s_w3 / s_w1 times FC2's input scale as
    the kernel gets it (``1 / a2_gscale``, ``a2_gscale = 1 / input_scale``);
    1 and 1 after a fold."""
    s13, s2 = t["w13_weight_scale"].cpu(), t["w2_weight_scale"].cpu()
    g13, g2 = t["w13_weight_scale_2"].cpu(), t["w2_weight_scale_2"].cpu()
    if mode == "fold":
        s13, s2 = fold_reference(s13, g13), fold_reference(s2, g2)
        g13, g2 = torch.ones_like(g13), torch.ones_like(g2)
    alpha1, alpha2 = g13[:, 0], g2
    if gated:
        alpha2 = g2 * (g13[:, 1] / g13[:, 0])
    if mode == "alpha":
        alpha2 = alpha2 * (1.0 / (1.0 / t["w2_input_scale"].cpu().float()))
    w13 = t["w13_weight"].cpu()
    if gated:
        w13, s13 = split_cat_halves(w13, -2), split_cat_halves(s13, -2)
    return {
        "w13_weight": w13,
        "w13_weight_scale": swizzle_blockscale(s13),
        "w2_weight": t["w2_weight"].cpu(),
        "w2_weight_scale": swizzle_blockscale(s2),
        "w13_weight_scale_2": g13.contiguous(),
        "w2_weight_scale_2": g2,
        "w1_alpha": alpha1,
        "w2_alpha": alpha2,
    }


def _layer(e, h, i, gated, device, cap, mode="alpha"):
    return make_nvfp4_layer(
        e, 2, h, i, gated, BACKEND, device=device, max_transient_bytes=cap,
        global_scale_mode=mode,
    )  # fmt: skip


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", ["alpha", "fold"])
@pytest.mark.parametrize("cap", CAPS, ids=lambda c: f"cap{c >> 10}KiB")
@pytest.mark.parametrize("shape", LAYER_SHAPES, ids=lambda s: "E{}_H{}_I{}_{}".format(
    s[0], s[1], s[2], "silu" if s[3] else "relu2"))  # fmt: skip
def test_bounded_preparation_is_bit_identical_to_whole_tensor(shape, cap, mode,
                                                             device):  # fmt: skip
    e, h, i, gated = shape
    tensors = random_layer_tensors(e, h, i, gated, seed=sum(shape), device=device)
    want = whole_tensor_preparation(tensors, gated, mode)
    layer = _layer(e, h, i, gated, device, cap, mode)
    load_nvfp4_experts(layer, tensors)
    before = {name: p for name, p in layer.named_parameters()}
    storages = {n: p.untyped_storage().data_ptr() for n, p in before.items()}
    layer.quant_method.process_weights_after_loading(layer)
    alphas = {k: want.pop(k) for k in ("w1_alpha", "w2_alpha")}
    for name, expected in want.items():
        got = getattr(layer, name).detach().cpu()
        assert got.shape == expected.shape, name
        assert torch.equal(bytes_of(got.contiguous()), bytes_of(expected)), name
    # Every parameter is the same object (a padded scale's data became a
    # larger view of the same storage).
    for name, param in layer.named_parameters():
        assert param is before[name], name
    # Padded or not, the swizzled scales live in the storage the layer was
    # created with (it had room for the padding): nothing new was allocated.
    for name in ("w13_weight_scale", "w2_weight_scale"):
        new, old = getattr(layer, name), storages[name]
        assert new.untyped_storage().data_ptr() == old
    # The quant config holds the scale parameters themselves (as upstream);
    # the kernel's MMA-layout views, on the experts, read the same bytes.
    experts = layer.quant_method.experts
    qc = experts.quant_config
    assert qc.w1_scale is layer.w13_weight_scale
    assert qc.w2_scale is layer.w2_weight_scale
    assert qc.g1_alphas is layer.w13_weight_scale_2
    assert experts.w1_sf_mma.data_ptr() == layer.w13_weight_scale.data_ptr()
    assert experts.w2_sf_mma.data_ptr() == layer.w2_weight_scale.data_ptr()
    # The kernel's alphas: the gate's global scale, and w2's carrying the
    # up/gate ratio (random scales here: every expert's differ); 1 after a
    # fold.
    assert torch.equal(experts.prepared.w1_alpha.cpu(), alphas["w1_alpha"])
    assert torch.equal(experts.prepared.w2_alpha.cpu(), alphas["w2_alpha"])


def test_separate_w1_w3_global_scales_are_exact():
    # Up (w3) weights 4x larger than gate (w1): their global scales differ 4x.
    e, h, i, topk = 4, 256, 128, 2
    w1, w2 = bf16_experts(e, i, h, gated=True, seed=31)
    w1[:, i:] *= 4
    tensors = quantize_experts_modelopt(w1, w2, gated=True, shared_w13_scale=False)
    s2 = tensors["w13_weight_scale_2"]
    ratio = s2[:, 1] / s2[:, 0]
    assert ((ratio > 3) & (ratio < 5)).all(), ratio
    layer = make_nvfp4_layer(e, topk, h, i, True, BACKEND, weights_only=True)
    load_nvfp4_experts(layer, tensors)
    layer.quant_method.process_weights_after_loading(layer)
    gen = torch.Generator().manual_seed(32)
    x = torch.randn(32, h, generator=gen).bfloat16()
    logits = torch.randn(32, e, generator=gen)
    dw1, dw2 = dequantized_experts(tensors, gated=True)
    ref = torch_moe(x, dw1, dw2, logits, topk, renormalize=True)
    out = layer(x, logits)
    # Tolerance: the weights-only tolerance of test_flashinfer_b12x_moe (0.01):
    # the up/gate ratio rides on w2_alpha, no block scale is rewritten.
    assert rel_rms_error(out, ref) < 0.01
    # ...and the block scales are the loaded ones, reordered and swizzled.
    want = swizzle_blockscale(split_cat_halves(tensors["w13_weight_scale"], -2))
    assert torch.equal(bytes_of(layer.w13_weight_scale.data), bytes_of(want))
    # The benchmark's precision report sees the same: exact up to float32
    # rounding of the alphas (the fold would be ~1e-2 here).
    report = prepared_weight_precision(layer, tensors, "full")
    assert report["rel_rms"] < 1e-6, report
    # Control: folding both halves with w1's scale (dropping w3's, as the
    # legacy fold did) misses by far.
    dropped = dict(tensors)
    dropped["w13_weight_scale_2"] = s2[:, :1].expand(e, 2).contiguous()
    dw1_dropped, _ = dequantized_experts(dropped, gated=True)
    ref_dropped = torch_moe(x, dw1_dropped, dw2, logits, topk, renormalize=True)
    assert rel_rms_error(out, ref_dropped) > 0.5
    # ...and the legacy fold's scale bytes do differ from the exact ones.
    legacy = legacy_fold(tensors["w13_weight_scale"], s2)
    exact = fold_reference(tensors["w13_weight_scale"], s2)
    assert not torch.equal(bytes_of(legacy), bytes_of(exact))


def _prep_peak(layer, device) -> int:
    with measure_peak_memory(device) as mem:
        layer.quant_method.process_weights_after_loading(layer)
    return mem.peak_bytes


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("cap", [64 * MIB, 4 * MIB], ids=["64MiB", "4MiB"])
@pytest.mark.parametrize("model", ["qwen3.6-35b-a3b", "nemotron-3-nano-30b-a3b"])
def test_whole_preparation_of_a_real_layer_stays_within_cap(model, cap, device):
    # Qwen3.6-35B-A3B: gated, no padding. Nemotron-3-Nano: relu2, I = 1856
    # rows, so its w13 block scales need padding to 1920 rows.
    preset = get_preset(model)
    tensors = synthetic_layer_tensors(preset, 1, torch.device(device), seed=0)
    layer = make_nvfp4_layer(
        preset.num_experts, preset.top_k, preset.hidden_size,
        preset.intermediate_size, preset.is_gated, BACKEND, device=device,
        max_transient_bytes=cap,
    )  # fmt: skip
    load_nvfp4_experts(layer, tensors)
    peak = _prep_peak(layer, device)
    assert 0 < peak <= cap, f"{peak / MIB:.1f} MiB > {cap / MIB:.0f} MiB"
    # ...and it produced the right bytes, not only a small peak.
    want = whole_tensor_preparation(tensors, preset.is_gated)
    kernel = layer.quant_method.experts.prepared
    for key in ("w1_alpha", "w2_alpha"):
        assert torch.equal(getattr(kernel, key).cpu(), want.pop(key)), key
    for name, expected in want.items():
        got = getattr(layer, name).detach().cpu().contiguous()
        assert torch.equal(bytes_of(got), bytes_of(expected)), name

    # Control: the legacy pipeline on the same layer needs a full copy of w13
    # (288 MiB for Qwen3.6) and 4x-size float32 temporaries of the scales.
    legacy = {k: v.clone() for k, v in tensors.items()}
    peaks = {}
    for name, step in legacy_preparation_steps(legacy, gated=preset.is_gated):
        with measure_peak_memory(device) as mem:
            step()
        peaks[name] = mem.peak_bytes
    w13_scale_bytes = tensors["w13_weight_scale"].numel()
    if preset.is_gated:
        assert peaks["reorder"] >= tensors["w13_weight"].numel() + w13_scale_bytes
    assert peaks["fold"] >= 4 * w13_scale_bytes
    assert max(peaks.values()) > 4 * cap


@pytest.mark.parametrize("device", DEVICES)
def test_padded_swizzle_in_place_with_room(device):
    # Nemotron's 1856 rows pad to 1920: with storage made for it, the swizzle
    # expands in place; the call allocates only its buffer.
    scale = blockscale_storage_for_swizzle(8, 1856, 116, device=device)
    scale.view(torch.uint8).copy_(
        random_bits((8, 1856, 116), torch.uint8, device, seed=43) % 0x70 + 8
    )
    want = swizzle_blockscale(scale.cpu())
    cap = 256 << 10
    with measure_peak_memory(device) as mem:
        out = swizzle_blockscale_bounded(
            scale, max_transient_bytes=cap, storage_has_room=True
        )
    assert mem.peak_bytes <= cap
    assert out.untyped_storage().data_ptr() == scale.untyped_storage().data_ptr()
    assert torch.equal(bytes_of(out.cpu()), bytes_of(want))


# (E, R, C, cap): a cap of exactly one group of 128 rows (128 * Cp bytes), so
# the in-place padded swizzle moves one group per chunk, last to first. A
# first-to-last order would overwrite groups not yet read.
ONE_GROUP_CASES = [(2, 300, 5, 1024), (3, 1856, 168, 128 * 168)]


@pytest.mark.parametrize("case", ONE_GROUP_CASES, ids=["E2_R300_C5", "nemotron_w13"])
def test_padded_swizzle_in_place_one_group_at_a_time(case):
    e, r, c, cap = case
    scale = blockscale_storage_for_swizzle(e, r, c)
    src = random_bits((e, r, c), torch.uint8, "cpu", seed=r) % 0x70 + 8
    scale.view(torch.uint8).copy_(src)
    want = swizzle_blockscale(src.view(torch.float8_e4m3fn))
    out = swizzle_blockscale_bounded(scale, max_transient_bytes=cap,
                                     storage_has_room=True)  # fmt: skip
    assert out.untyped_storage().data_ptr() == scale.untyped_storage().data_ptr()
    assert torch.equal(bytes_of(out), bytes_of(want))
    # And back, in place: the exact linear bytes.
    back = unswizzle_blockscale_bounded_(out, r, c, max_transient_bytes=cap)
    assert back.untyped_storage().data_ptr() == scale.untyped_storage().data_ptr()
    assert torch.equal(bytes_of(back), bytes_of(src))


@pytest.mark.parametrize("device", DEVICES)
def test_padded_swizzle_without_room_allocates_only_its_result(device):
    # A plain [E, 1856, 116] tensor has no room for 1920 rows: the padded
    # result is new (it replaces the source); besides it, only the buffer.
    scale = random_bits((8, 1856, 116), torch.uint8, device, seed=41)
    scale = (scale % 0x70 + 8).view(torch.float8_e4m3fn)
    cap = 1 * MIB
    with measure_peak_memory(device) as mem:
        out = swizzle_blockscale_bounded(scale, max_transient_bytes=cap)
    result_bytes = out.numel()
    assert out.shape == (8, 1920, 116)
    assert mem.peak_bytes <= result_bytes + cap
    assert torch.equal(bytes_of(unswizzle_blockscale(out, 1856, 116)), bytes_of(scale))


@pytest.mark.parametrize("device", DEVICES)
def test_fold_is_chunked(device):
    scale = (random_bits((16, 512, 64), torch.uint8, device, seed=42) % 0x70 + 8).view(
        torch.float8_e4m3fn
    )
    scale_2 = torch.rand(16, 2, device=device) + 0.5
    want = fold_reference(scale.cpu(), scale_2.cpu())
    with measure_peak_memory(device) as mem:
        fold_global_scale_into_blockscale_(scale, scale_2, max_transient_bytes=64 << 10)
    assert mem.peak_bytes <= 64 << 10
    assert torch.equal(bytes_of(scale.cpu()), bytes_of(want))


def test_preparation_input_errors():
    s = torch.zeros(2, 128, 4, dtype=torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        swizzle_blockscale_bounded(torch.zeros(2, 128, 4))
    with pytest.raises(ValueError, match="below one group of 128 rows"):
        swizzle_blockscale_bounded(s, max_transient_bytes=100)
    with pytest.raises(ValueError, match="must be positive"):
        swizzle_blockscale_bounded(s, max_transient_bytes=0)
    with pytest.raises(ValueError, match=r"scale_2 must be \[E\] or \[E, G\]"):
        fold_global_scale_into_blockscale_(s, torch.ones(3))
    # 512 (factors) + 1024 (codes) + 2560 (one segment's tables, offset and
    # 128-element index), each block counted as the CUDA allocator rounds it.
    with pytest.raises(ValueError, match=r"at least 4096 for the fold of 2"):
        fold_global_scale_into_blockscale_(s, torch.ones(2), max_transient_bytes=2)
    with pytest.raises(TypeError, match="scale_2 must be a torch.Tensor"):
        fold_global_scale_into_blockscale_(s, 1.0)
