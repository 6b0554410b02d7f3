# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Bit-exact tests of the NVFP4 reference: codes, packing, scales, layouts."""

import importlib.util
import math

import pytest
import torch

from tests.kernels.utils import DEVICES
from vllm.model_executor.layers.quantization.utils.flashinfer_b12x_w4a4_format import (
    blockscale_mma_layout_view,
    mma_layout_to_linear,
)
from vllm.model_executor.layers.quantization.utils.nvfp4_format import (
    E2M1_VALUES,
    FLOAT4_E2M1_MAX,
    FLOAT8_E4M3_MAX,
    NVFP4_BLOCK_SIZE,
    dequantize_nvfp4,
    e2m1_decode,
    e2m1_encode,
    global_scale_from_compressed_tensors,
    global_scale_from_modelopt,
    global_scale_to_compressed_tensors,
    global_scale_to_modelopt,
    nvfp4_global_scale,
    pack_fp4,
    quantize_nvfp4,
    unpack_fp4,
    unswizzle_blockscale,
)
from vllm.model_executor.layers.quantization.utils.nvfp4_utils import (
    swizzle_blockscale,
)


def test_constants():
    assert FLOAT4_E2M1_MAX == 6.0
    assert FLOAT8_E4M3_MAX == 448.0
    assert NVFP4_BLOCK_SIZE == 16


# Every code, from its definition: bit 3 sign, bits 2-1 exponent (bias 1),
# bit 0 mantissa; exponent 0 is subnormal (0 or 0.5).
CODE_VALUES = [
    (0b0000, 0.0),
    (0b0001, 0.5),
    (0b0010, 1.0),
    (0b0011, 1.5),
    (0b0100, 2.0),
    (0b0101, 3.0),
    (0b0110, 4.0),
    (0b0111, 6.0),
    (0b1000, -0.0),
    (0b1001, -0.5),
    (0b1010, -1.0),
    (0b1011, -1.5),
    (0b1100, -2.0),
    (0b1101, -3.0),
    (0b1110, -4.0),
    (0b1111, -6.0),
]


@pytest.mark.parametrize("code,value", CODE_VALUES, ids=lambda v: f"{v}")
def test_every_code_decodes_and_encodes(code, value):
    decoded = e2m1_decode(torch.tensor([code], dtype=torch.uint8))
    assert decoded.item() == value
    assert math.copysign(1.0, decoded.item()) == math.copysign(1.0, value)
    assert e2m1_encode(torch.tensor([value])).item() == code
    assert E2M1_VALUES[code].item() == value


# Ties: a value exactly between two neighbours rounds to the one with an even
# code (mantissa bit 0 clear).
#   0.25 between 0 (code 0) and 0.5 (code 1)   -> 0    (code 0, even)
#   0.75 between 0.5 (code 1) and 1 (code 2)   -> 1    (code 2, even)
#   1.25 between 1 (code 2) and 1.5 (code 3)   -> 1    (code 2, even)
#   1.75 between 1.5 (code 3) and 2 (code 4)   -> 2    (code 4, even)
#   2.5  between 2 (code 4) and 3 (code 5)     -> 2    (code 4, even)
#   3.5  between 3 (code 5) and 4 (code 6)     -> 4    (code 6, even)
#   5    between 4 (code 6) and 6 (code 7)     -> 4    (code 6, even)
TIES = [
    (0.25, 0.0),
    (0.75, 1.0),
    (1.25, 1.0),
    (1.75, 2.0),
    (2.5, 2.0),
    (3.5, 4.0),
    (5.0, 4.0),
]


@pytest.mark.parametrize("x,want", TIES)
@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_ties_round_to_even(x, want, sign):
    code = e2m1_encode(torch.tensor([sign * x]))
    assert e2m1_decode(code).item() == sign * want
    # Just off the tie, the nearest neighbour wins.
    eps = 1e-3
    below = e2m1_decode(e2m1_encode(torch.tensor([x - eps]))).item()
    above = e2m1_decode(e2m1_encode(torch.tensor([x + eps]))).item()
    assert below < above
    assert below <= x <= above


def test_rounds_to_nearest_between_ties():
    x = torch.tensor([0.1, 0.3, 0.6, 1.1, 1.4, 1.6, 2.2, 2.9, 3.2, 4.4, 5.5])
    want = [0.0, 0.5, 0.5, 1.0, 1.5, 1.5, 2.0, 3.0, 3.0, 4.0, 6.0]
    assert e2m1_decode(e2m1_encode(x)).tolist() == want


def test_saturates():
    x = torch.tensor([6.0, 7.0, 1e30, float("inf"), -6.5, -float("inf")])
    assert e2m1_encode(x).tolist() == [7, 7, 7, 7, 15, 15]


def test_signed_zero():
    x = torch.tensor([0.0, -0.0, -0.1, 0.1])
    assert e2m1_encode(x).tolist() == [0, 8, 8, 0]
    assert torch.signbit(e2m1_decode(torch.tensor([8], dtype=torch.uint8))).item()


def test_nibble_order_against_literal_bytes():
    # Element 2i in the low nibble: [0.5, 6.0] -> codes [1, 7] -> 0x71.
    codes = torch.tensor([[1, 7, 0, 15, 8, 2, 0xA, 0xC]], dtype=torch.uint8)
    packed = pack_fp4(codes)
    assert packed.tolist() == [[0x71, 0xF0, 0x28, 0xCA]]
    assert torch.equal(unpack_fp4(packed), codes)
    values = e2m1_decode(unpack_fp4(torch.tensor([0x71], dtype=torch.uint8)))
    assert values.tolist() == [0.5, 6.0]


def test_pack_unpack_round_trip_all_bytes():
    every_byte = torch.arange(256, dtype=torch.uint8).view(4, 64)
    assert torch.equal(pack_fp4(unpack_fp4(every_byte)), every_byte)


def test_pack_rejects_odd_length():
    with pytest.raises(ValueError, match="even last dimension"):
        pack_fp4(torch.zeros(3, dtype=torch.uint8))


# --- quantize / dequantize ------------------------------------------------------


def _representable(shape, gen, global_scale):
    """Values that NVFP4 holds exactly: e2m1 * a power-of-two block scale, with
    each block's amax 6 * scale so that the scale is recovered exactly."""
    e2m1 = E2M1_VALUES[torch.randint(0, 16, shape, generator=gen)]
    blocks = e2m1.unflatten(-1, (-1, NVFP4_BLOCK_SIZE))
    blocks[..., 0] = 6.0  # pin each block's amax
    exps = torch.randint(-4, 5, (*shape[:-1], shape[-1] // 16, 1), generator=gen)
    return (blocks * torch.exp2(exps.float()) / global_scale).flatten(-2)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_round_trip_exact_for_representable_values(device, dtype):
    gen = torch.Generator().manual_seed(0)
    x = _representable((4, 3, 64), gen, global_scale=8.0).to(dtype).to(device)
    packed, scale = quantize_nvfp4(x, 8.0)
    assert packed.shape == (4, 3, 32) and packed.dtype == torch.uint8
    assert scale.shape == (4, 3, 4) and scale.dtype == torch.float8_e4m3fn
    out = dequantize_nvfp4(packed, scale, 8.0, dtype=dtype)
    torch.testing.assert_close(out, x, rtol=0, atol=0)


def _sqnr_db(ref: torch.Tensor, approx: torch.Tensor) -> float:
    return (10 * torch.log10(ref.pow(2).mean() / (ref - approx).pow(2).mean())).item()


def test_sqnr_floor_on_random_data():
    # Derivation of the floor, for N(0, s^2) data. Each 16-block is scaled so
    # its amax lands on 6; the expected max |z| of 16 normals is about 2.0, so
    # in scaled units s ~ 3. The E2M1 grid has step 0.5 on [0, 2), 1 on
    # [2, 4), 2 on [4, 6]; rounding noise is step^2 / 12 in each region,
    # weighted by the mass there (|z| < 2/3: 0.50, < 4/3: 0.32, beyond: 0.18):
    #   noise ~ 0.50 * 0.021 + 0.32 * 0.083 + 0.18 * 0.333 ~ 0.098
    #   SQNR  ~ 10 * log10(9 / 0.098) ~ 19.6 dB   (measured here: 20.5 dB)
    # The floor is 18 dB. Negative control: dequantizing with a global scale
    # off by 1.5x leaves a third of the signal as error, 20*log10(3) ~ 9.5 dB.
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(64, 512, generator=gen)
    gs = nvfp4_global_scale(x.abs().amax())
    packed, scale = quantize_nvfp4(x, gs)
    sqnr = _sqnr_db(x, dequantize_nvfp4(packed, scale, gs))
    assert sqnr > 18.0, sqnr
    wrong = dequantize_nvfp4(packed, scale, gs * 1.5)
    assert _sqnr_db(x, wrong) < 10.0


def test_scales_never_nan_or_inf():
    x = torch.zeros(3, 64)
    x[1, :16] = 1e-30  # a block whose scale underflows FP8
    x[1, 16:32] = torch.linspace(-1, 1, 16)
    x[2] = 1e6  # saturating magnitudes
    for gs in (nvfp4_global_scale(x.abs().amax()), torch.tensor(1.0)):
        packed, scale = quantize_nvfp4(x, gs)
        assert torch.isfinite(scale.float()).all()
        out = dequantize_nvfp4(packed, scale, gs)
        assert torch.isfinite(out).all()
    assert nvfp4_global_scale(0.0).item() == 1.0
    assert torch.isfinite(nvfp4_global_scale(1e-45))
    packed, scale = quantize_nvfp4(torch.zeros(2, 32), nvfp4_global_scale(0.0))
    assert torch.equal(dequantize_nvfp4(packed, scale, 1.0), torch.zeros(2, 32))
    assert (unpack_fp4(packed) & 0x7).eq(0).all()


def test_per_expert_global_scale():
    gen = torch.Generator().manual_seed(2)
    w = torch.randn(3, 8, 32, generator=gen) * torch.tensor([1.0, 100.0, 0.01]).view(
        3, 1, 1
    )
    gs = nvfp4_global_scale(w.abs().amax(dim=(1, 2)))  # [E]
    assert gs.shape == (3,)
    packed, scale = quantize_nvfp4(w, gs)
    out = dequantize_nvfp4(packed, scale, gs)
    for e in range(3):
        p1, s1 = quantize_nvfp4(w[e], gs[e])
        assert torch.equal(p1, packed[e])
        assert torch.equal(s1.view(torch.uint8), scale[e].view(torch.uint8))
        assert _sqnr_db(w[e], out[e]) > 18.0
    # The largest block scale of each expert is at (not above) the FP8 max.
    assert scale.float().amax(dim=(1, 2)).tolist() == [448.0] * 3


def test_quantize_input_errors():
    with pytest.raises(ValueError, match="multiple of 16"):
        quantize_nvfp4(torch.zeros(2, 20), 1.0)
    with pytest.raises(TypeError, match="bfloat16, float16 or float32"):
        quantize_nvfp4(torch.zeros(2, 16, dtype=torch.float64), 1.0)
    with pytest.raises(ValueError, match="finite and positive"):
        quantize_nvfp4(torch.zeros(2, 16), float("inf"))
    with pytest.raises(ValueError, match="one entry per leading index"):
        quantize_nvfp4(torch.zeros(3, 2, 16), torch.ones(2))
    with pytest.raises(ValueError, match="does not match packed"):
        dequantize_nvfp4(
            torch.zeros(2, 8, dtype=torch.uint8),
            torch.zeros(2, 2, dtype=torch.float8_e4m3fn),
            1.0,
        )


# --- conventions ----------------------------------------------------------------


def test_modelopt_and_compressed_tensors_conventions_decode_the_same():
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(2, 4, 32, generator=gen)
    amax = w.abs().amax(dim=(1, 2))
    gs = nvfp4_global_scale(amax)
    packed, scale = quantize_nvfp4(w, gs)

    # ModelOpt stores weight_scale_2 = amax / (448 * 6): dequant multiplies.
    weight_scale_2 = global_scale_to_modelopt(gs)
    torch.testing.assert_close(weight_scale_2, amax / (448 * 6))
    # compressed-tensors stores weight_global_scale = 448 * 6 / amax.
    weight_global_scale = global_scale_to_compressed_tensors(gs)
    torch.testing.assert_close(weight_global_scale, 448 * 6 / amax)
    torch.testing.assert_close(weight_global_scale * weight_scale_2, torch.ones(2))

    via_modelopt = dequantize_nvfp4(
        packed, scale, global_scale_from_modelopt(weight_scale_2)
    )
    via_ct = dequantize_nvfp4(
        packed, scale, global_scale_from_compressed_tensors(weight_global_scale)
    )
    torch.testing.assert_close(via_modelopt, via_ct, rtol=1e-6, atol=0)
    by_hand = (
        e2m1_decode(unpack_fp4(packed)).unflatten(-1, (-1, 16))
        * scale.float().unsqueeze(-1)
        * weight_scale_2.view(2, 1, 1, 1)
    ).flatten(-2)
    torch.testing.assert_close(via_modelopt, by_hand, rtol=1e-6, atol=0)
    # Negative control: reading ModelOpt's scale as if it were the
    # quantization direction is off by a factor of (448 * 6 / amax)^2.
    misread = dequantize_nvfp4(packed, scale, weight_scale_2)
    assert (misread.abs().amax() / via_modelopt.abs().amax()) > 1e3


# --- swizzle ---------------------------------------------------------------------

SWIZZLE_SHAPES = [(1, 1), (100, 3), (200, 10), (300, 7), (128, 4), (256, 8)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape", SWIZZLE_SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("batch", [None, 3])
def test_swizzle_round_trip(device, shape, batch):
    full = shape if batch is None else (batch, *shape)
    gen = torch.Generator().manual_seed(4)
    scale = torch.randint(0, 256, full, dtype=torch.uint8, generator=gen)
    scale = scale.view(torch.float8_e4m3fn).to(device)
    sw = swizzle_blockscale(scale)
    rp = (shape[0] + 127) // 128 * 128
    cp = (shape[1] + 3) // 4 * 4
    assert sw.shape == ((rp, cp) if batch is None else (batch, rp, cp))
    back = unswizzle_blockscale(sw, *shape)
    assert torch.equal(back.view(torch.uint8), scale.view(torch.uint8))


def test_swizzle_small_case_by_hand():
    # 130 x 5 scales, value = r * 8 + c (fits in uint8 for the first rows we
    # check). Padded to 256 x 8: tiles (m_tile, k_tile) = (0,0),(0,1),(1,0),(1,1)
    # of 512 bytes each, in that order. Inside a tile, byte
    # outer_m * 16 + inner_m * 4 + inner_k holds row inner_m * 32 + outer_m,
    # column inner_k of the tile.
    r = torch.arange(130).view(130, 1)
    c = torch.arange(5).view(1, 5)
    scale = ((r * 8 + c) % 256).to(torch.uint8)
    flat = swizzle_blockscale(scale).reshape(-1)
    assert flat.numel() == 256 * 8
    # Tile (0, 0): byte 0 = (row 0, col 0); byte 1 = (0, 1); byte 4 = row 32.
    assert flat[0].item() == 0
    assert flat[1].item() == 1
    assert flat[3].item() == 3
    assert flat[4].item() == (32 * 8) % 256
    assert flat[16].item() == 1 * 8  # outer_m 1 -> row 1
    assert flat[16 + 2 * 4 + 3].item() == ((2 * 32 + 1) * 8 + 3) % 256
    # Tile (0, 1) starts at byte 512: row 0, column 4; column 5..7 are padding.
    assert flat[512].item() == 4
    assert flat[513].item() == 0
    # Tile (1, 0) starts at byte 1024: rows 128.., row 129 is outer_m 1.
    assert flat[1024].item() == (128 * 8) % 256
    assert flat[1024 + 16 + 1].item() == (129 * 8 + 1) % 256
    assert flat[1024 + 2 * 16].item() == 0  # row 130: padding


def test_unswizzle_rejects_wrong_shape():
    with pytest.raises(ValueError, match="does not hold"):
        unswizzle_blockscale(torch.zeros(128, 4, dtype=torch.uint8), 129, 4)


# --- MMA layout ---------------------------------------------------------------------


@pytest.mark.parametrize("m,k,e", [(128, 64, 1), (256, 256, 2), (200, 160, 3)])
def test_mma_layout_view_is_a_view_and_decodes_back(m, k, e):
    gen = torch.Generator().manual_seed(5)
    scale = torch.randint(0, 256, (e, m, k // 16), dtype=torch.uint8, generator=gen)
    sw = swizzle_blockscale(scale)
    mma = blockscale_mma_layout_view(sw, m, k, e)
    m_tiles, k_tiles = (m + 127) // 128, (k // 16 + 3) // 4
    assert mma.shape == (32, 4, m_tiles, 4, k_tiles, e)
    assert mma.data_ptr() == sw.data_ptr()
    assert mma.untyped_storage().data_ptr() == sw.untyped_storage().data_ptr()
    assert torch.equal(mma_layout_to_linear(mma, m, k), scale)
    # Spot-check the documented index map on one element.
    rr, cc, g = m - 1, k // 16 - 1, e - 1
    assert (
        mma[rr % 32, (rr % 128) // 32, rr // 128, cc % 4, cc // 4, g]
        == scale[g, rr, cc]
    )


def test_mma_layout_view_rejects_wrong_size():
    with pytest.raises(ValueError, match="groups"):
        blockscale_mma_layout_view(
            torch.zeros(2, 128, 4, dtype=torch.uint8), 128, 64, 3
        )


# --- cross-check against torchao's independent implementation -------------------

requires_torchao = pytest.mark.skipif(
    importlib.util.find_spec("torchao") is None,
    reason="torchao (a test-only dependency, requirements/test.txt) is not installed",
)


@requires_torchao
def test_against_torchao_codes_and_packing():
    from torchao.prototype.mx_formats.kernels import (
        f4_unpacked_to_f32,
        pack_uint4,
    )

    codes = torch.arange(16, dtype=torch.uint8)
    torch.testing.assert_close(
        e2m1_decode(codes), f4_unpacked_to_f32(codes), rtol=0, atol=0
    )
    pairs = torch.randint(0, 16, (4, 32), dtype=torch.uint8)
    assert torch.equal(pack_fp4(pairs), pack_uint4(pairs))


@requires_torchao
def test_against_torchao_quantize():
    from torchao.prototype.mx_formats.nvfp4_tensor import nvfp4_quantize

    gen = torch.Generator().manual_seed(6)
    x = torch.randn(16, 256, generator=gen)
    # A power-of-two global scale keeps both implementations' fp32 arithmetic
    # exact, so they must agree to the bit. torchao takes the dequantization
    # direction (per_tensor_scale = amax / (448 * 6)).
    gs = torch.tensor(256.0)
    ao_scale, ao_packed = nvfp4_quantize(
        x, per_tensor_scale=global_scale_to_modelopt(gs)
    )
    packed, scale = quantize_nvfp4(x, gs)
    assert torch.equal(scale.view(torch.uint8), ao_scale.view(torch.uint8).view(16, -1))
    assert torch.equal(packed, ao_packed.view(torch.uint8).view(16, -1))


@requires_torchao
@pytest.mark.parametrize("shape", SWIZZLE_SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_against_torchao_to_blocked(shape):
    from torchao.prototype.mx_formats.utils import to_blocked

    gen = torch.Generator().manual_seed(7)
    scale = torch.randint(0, 256, shape, dtype=torch.uint8, generator=gen)
    assert torch.equal(swizzle_blockscale(scale).reshape(-1), to_blocked(scale))


@pytest.mark.skipif(
    importlib.util.find_spec("flashinfer") is None,
    reason="flashinfer-python (GPU extra, requirements/cuda.txt) is not installed",
)
@pytest.mark.parametrize("m,k,e", [(256, 256, 2), (128, 512, 3), (200, 160, 2)])
def test_against_flashinfer_mma_layout(m, k, e):
    try:
        from flashinfer.cute_dsl.utils import convert_sf_to_mma_layout
    except ImportError as err:  # its CuTe DSL dependency may be missing
        pytest.skip(f"flashinfer.cute_dsl is not importable: {err}")
    gen = torch.Generator().manual_seed(8)
    scale = torch.randint(0, 256, (e, m, k // 16), dtype=torch.uint8, generator=gen)
    sw = swizzle_blockscale(scale)
    ours = blockscale_mma_layout_view(sw, m, k, e)
    theirs = convert_sf_to_mma_layout(sw.reshape(-1, sw.shape[-1]), m, k, e)
    assert ours.shape == theirs.shape and ours.stride() == theirs.stride()
    assert torch.equal(ours.contiguous(), theirs.contiguous())
