# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The whole b12x weight preparation: exact, bounded, and measured."""

import pytest
import torch

from tests.kernels.moe.utils import (
    fold_reference,
    load_nvfp4_experts,
    make_nvfp4_layer,
    random_layer_tensors,
    whole_tensor_preparation,
)
from tests.kernels.utils import DEVICES, bytes_of, random_bits
from vllm.model_executor.layers.quantization.utils.blockscale_fold import (
    fold_global_scale_into_blockscale_,
)
from vllm.model_executor.layers.quantization.utils.blockscale_swizzle import (
    blockscale_storage_for_swizzle,
    swizzle_blockscale_bounded,
    unswizzle_blockscale_bounded_,
)
from vllm.model_executor.layers.quantization.utils.nvfp4_format import (
    unswizzle_blockscale,
)
from vllm.model_executor.layers.quantization.utils.nvfp4_utils import (
    swizzle_blockscale,
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


def _layer(e, h, i, gated, device, cap, mode="alpha"):
    return make_nvfp4_layer(
        e,
        2,
        h,
        i,
        gated,
        BACKEND,
        device=device,
        max_transient_bytes=cap,
        global_scale_mode=mode,
    )


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", ["alpha", "fold"])
@pytest.mark.parametrize("cap", CAPS, ids=lambda c: f"cap{c >> 10}KiB")
@pytest.mark.parametrize(
    "shape",
    LAYER_SHAPES,
    ids=lambda s: "E{}_H{}_I{}_{}".format(
        s[0], s[1], s[2], "silu" if s[3] else "relu2"
    ),
)
def test_bounded_preparation_is_bit_identical_to_whole_tensor(shape, cap, mode, device):
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
    out = swizzle_blockscale_bounded(
        scale, max_transient_bytes=cap, storage_has_room=True
    )
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
