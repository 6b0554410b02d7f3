# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""FlashInfer's W4A16 layout (flashinfer_w4a16_layout.w4a16_*):
positions and encodings from the definition, round trips, and FlashInfer
0.7.4's own prepare functions as the oracle (skipped without flashinfer)."""

import importlib.util
import types

import pytest
import torch

from tests.kernels.moe.utils import bf16_experts, quantize_experts_modelopt
from vllm.model_executor.layers.quantization.utils.flashinfer_w4a16_layout import (
    w4a16_alpha,
    w4a16_blockscale_inverse_table,
    w4a16_blockscale_table,
    w4a16_dequantize,
    w4a16_global_scale,
    w4a16_pack_blockscale,
    w4a16_pack_weight,
    w4a16_scale_exponent,
    w4a16_unpack_blockscale,
    w4a16_unpack_weight,
)
from vllm.model_executor.layers.quantization.utils.nvfp4_format import (
    dequantize_nvfp4,
    pack_fp4,
    unpack_fp4,
)
from vllm.model_executor.layers.quantization.utils.nvfp4_utils import (
    swizzle_blockscale,
)

HAS_FLASHINFER = importlib.util.find_spec("flashinfer") is not None


def _fp8(byte_values) -> torch.Tensor:
    return torch.tensor(byte_values, dtype=torch.uint8).view(torch.float8_e4m3fn)


# --- codes: every position of a tile, from the layout's definition --------------


def test_every_code_position_of_a_tile():
    # One tile (N = 64 rows, K = 16): put code 1 at one (n, k) at a time and
    # find it where the definition says: word col*16 + tr*4 + warp, nibble
    # slot h*4 + c*2 + ab, for n = warp*16 + c*8 + col, k = ab*8 + tr*2 + h.
    n_idx = torch.arange(64).view(64, 1).expand(64, 16).reshape(-1)
    k_idx = torch.arange(16).view(1, 16).expand(64, 16).reshape(-1)
    codes = torch.zeros(1024, 64, 16, dtype=torch.uint8)
    codes[torch.arange(1024), n_idx, k_idx] = 1
    packed = w4a16_pack_weight(pack_fp4(codes))  # [1024, 1, 128] int32
    warp, c, col = n_idx // 16, (n_idx // 8) % 2, n_idx % 8
    ab, tr, h = k_idx // 8, (k_idx // 2) % 4, k_idx % 2
    word = col * 16 + tr * 4 + warp
    slot = h * 4 + c * 2 + ab
    expected = torch.zeros(1024, 128, dtype=torch.int64)
    expected[torch.arange(1024), word] = 1 << (4 * slot)
    assert torch.equal(packed.view(1024, 128).long() & 0xFFFFFFFF, expected)


def test_code_literals_of_flashinfers_table():
    # FlashInfer's slot table for word 0 (th_id 0, warp 0): slot 1 is
    # k = tc_row + 8 of col1 = 0, slot 2 is k = tc_row of col2 = 8, slot 4
    # is k = tc_row + 1. Codes 1..3 there give the nibbles 0x0001_0320 read
    # from slot 0 up: [0, 1, 2, 0, 3, 0, 0, 0].
    codes = torch.zeros(1, 64, 16, dtype=torch.uint8)
    codes[0, 0, 8] = 1  # slot 1
    codes[0, 8, 0] = 2  # slot 2
    codes[0, 0, 1] = 3  # slot 4
    packed = w4a16_pack_weight(pack_fp4(codes))
    assert packed[0, 0, 0].item() == 0x00030210
    assert packed.count_nonzero().item() == 1


def test_tiles_are_k_major_and_rotation_moves_rows():
    # Two row tiles (N = 128) and two k tiles (K = 32): tile (kt, nt) at
    # words [kt, nt*128 : nt*128 + 128]. Rows 0..63 hold code 1 everywhere,
    # rows 64..127 code 2; rotating by 64 swaps which tile holds which.
    codes = torch.ones(1, 128, 32, dtype=torch.uint8)
    codes[0, 64:] = 2
    w = pack_fp4(codes)
    plain = w4a16_pack_weight(w).view(1, 2, 2, 128)
    assert (plain[0, :, 0] == 0x11111111).all() and (plain[0, :, 1] == 0x22222222).all()
    rotated = w4a16_pack_weight(w, rotate=64).view(1, 2, 2, 128)
    assert (rotated[0, :, 0] == 0x22222222).all()
    assert (rotated[0, :, 1] == 0x11111111).all()


@pytest.mark.parametrize("rotate", [0, 64, 128, 192])
def test_every_rotation_takes_output_row_j_from_input_row_j_plus_rotate(rotate):
    # N = 256: four row tiles, rows of tile t hold code t + 1 (codes 1..4
    # say where a tile went). Output row j is input row (j + rotate) % N, so
    # output tile j holds code (j + rotate / 64) % 4 + 1. Rotations 64 and
    # 192 are where +rotate and -rotate differ (N/2 = 128 cannot tell them).
    codes = (torch.arange(256) // 64 + 1).to(torch.uint8).view(1, 256, 1)
    w = pack_fp4(codes.expand(1, 256, 32).contiguous())
    packed = w4a16_pack_weight(w, rotate).view(1, 2, 4, 128)  # [E, kt, nt, word]
    for j in range(4):
        nibble = (j + rotate // 64) % 4 + 1
        assert (packed[0, :, j] == nibble * 0x11111111).all(), (j, nibble)
    # The same for random codes: the packing of the input rolled by -rotate
    # (torch.roll moves row i to i - rotate), and back.
    gen = torch.Generator().manual_seed(rotate)
    w = torch.randint(0, 256, (2, 256, 16), dtype=torch.uint8, generator=gen)
    packed = w4a16_pack_weight(w, rotate)
    assert torch.equal(packed, w4a16_pack_weight(torch.roll(w, -rotate, dims=1)))
    assert torch.equal(w4a16_unpack_weight(packed, rotate), w)
    s = torch.randint(0, 0x58, (2, 256, 2), dtype=torch.uint8, generator=gen)
    s = s.view(torch.float8_e4m3fn)
    rolled = torch.roll(s.view(torch.uint8), -rotate, dims=1).view(torch.float8_e4m3fn)
    packed_s = w4a16_pack_blockscale(s, 3, rotate)
    want_s = w4a16_pack_blockscale(rolled, 3)
    assert torch.equal(packed_s.view(torch.uint8), want_s.view(torch.uint8))


SHAPES = [(3, 128, 256), (2, 192, 96), (1, 64, 16), (2, 320, 48)]


@pytest.mark.parametrize("e,n,k", SHAPES, ids=lambda v: str(v))
@pytest.mark.parametrize("half", [False, True], ids=["rotate0", "rotateN/2"])
def test_weight_round_trip(e, n, k, half):
    rotate = n // 2 if half else 0  # N/2 = 96 for N = 192: not a tile multiple
    gen = torch.Generator().manual_seed(n + k + rotate)
    w = torch.randint(0, 256, (e, n, k // 2), dtype=torch.uint8, generator=gen)
    packed = w4a16_pack_weight(w, rotate)
    assert packed.dtype == torch.int32 and packed.shape == (e, k // 16, n // 64 * 128)
    assert torch.equal(w4a16_unpack_weight(packed, rotate), w)
    # Control: unpacking with the wrong rotation is not the input.
    assert not torch.equal(w4a16_unpack_weight(packed, (rotate + 32) % n), w)


def test_weight_shape_errors():
    with pytest.raises(ValueError, match="multiple of 64"):
        w4a16_pack_weight(torch.zeros(1, 96, 8, dtype=torch.uint8))
    with pytest.raises(ValueError, match="multiple of 16"):
        w4a16_pack_weight(torch.zeros(1, 64, 4, dtype=torch.uint8))


# --- block scales -----------------------------------------------------------------


def test_scale_table_literals():
    # 1.0 (0x38): x 2^0 x 2^7 = 128 = FP16 0x5800, bits 14..7 = 0xB0; with
    # exponent 2: 512 = 0x6000 -> 0xC0. 2^-9 (0x01, the smallest subnormal):
    # 2^-9 x 2^7 = 0.25 < 2: flushed at exponent 0; at exponent 5 it is
    # 2^-9 x 2^5 x 2^7 = 8 = 0x4800 -> 0x90. 448 (0x7E) at exponent 0:
    # 57344 = 0x7B00 -> 0xF6. 2^-6 (0x08) at exponent 0: 2.0 -> 0x80, kept;
    # 0x07 (7 x 2^-9) just below: flushed. Negative zero (0x80): 0.
    t0, t2, t5 = (w4a16_blockscale_table(x) for x in (0, 2, 5))
    assert t0[0x38] == 0xB0 and t2[0x38] == 0xC0
    assert t0[0x01] == 0 and t5[0x01] == 0x90
    assert t0[0x7E] == 0xF6 and t0[0x08] == 0x80 and t0[0x07] == 0
    assert t0[0x80] == 0 and t0[0x00] == 0
    # The inverse table undoes every kept byte in range (v * 2^x <= 448, as
    # the exponent guarantees) and sends 0 to 0.
    codes = torch.arange(0x7F, dtype=torch.uint8)
    values = codes.view(torch.float8_e4m3fn).float()
    for x in (0, 2, 5):
        table, inv = w4a16_blockscale_table(x), w4a16_blockscale_inverse_table(x)
        kept = codes[(table[:0x7F] != 0) & (values * 2.0**x <= 448)]
        assert kept.numel() > 60
        assert torch.equal(inv[table[kept.long()].long()], kept)
        assert inv[0] == 0


@pytest.mark.parametrize(
    "top,expected", [(0x7E, 0), (0x38, 8), (0x00, 0), (0x46, 7), (0x08, 14)]
)
def test_scale_exponent(top, expected):
    # The largest scale decides: 448 -> 0; 1.0 -> floor(log2 448) = 8; all
    # zero -> 0; 3.5 (0x46): 448 / 3.5 = 128 exactly -> 7 (not 6: no
    # rounding on the way); 2^-6 (0x08): log2(448 * 64) = 14.8 -> 14.
    s = _fp8([[[0x00, top], [top, 0x00]]])
    assert w4a16_scale_exponent(s) == expected


def test_scale_columns_literal():
    # One 64-row block, one scale column: row r holds 1.0 * 2^(r % 8) and
    # distinct mantissas so every row's byte is unique; the packed column p
    # must hold row [0, 16, 8, 24, 32, 48, 40, 56, 1, ...][p] (the 8x8
    # transpose, then [0, 2, 1, 3] within each 4).
    rows = torch.arange(64, dtype=torch.uint8) + 0x30  # 0.5 .. ~60, normal
    s = rows.view(1, 64, 1).view(torch.float8_e4m3fn)
    packed = w4a16_pack_blockscale(s, 0).view(torch.uint8)[0, 0]
    inv = w4a16_blockscale_inverse_table(0)
    got_rows = (inv[packed.long()] - 0x30).tolist()
    assert got_rows[:9] == [0, 16, 8, 24, 32, 48, 40, 56, 1]
    assert sorted(got_rows) == list(range(64))


@pytest.mark.parametrize("e,n,k", SHAPES, ids=lambda v: str(v))
@pytest.mark.parametrize("rotate", [0, 32])
def test_scale_round_trip_and_flush(e, n, k, rotate):
    gen = torch.Generator().manual_seed(n * 3 + k)
    b = torch.randint(0, 0x58, (e, n, k // 16), dtype=torch.uint8, generator=gen)
    s = b.view(torch.float8_e4m3fn)
    x = w4a16_scale_exponent(s)
    packed = w4a16_pack_blockscale(s, x, rotate)
    assert packed.dtype == torch.float8_e4m3fn and packed.shape == (e, k // 16, n)
    back = w4a16_unpack_blockscale(packed, x, rotate).view(torch.uint8)
    flushed = s.float() * 2.0**x < 2.0**-6
    assert flushed.any() and (~flushed).any()  # both cases occur here
    assert torch.equal(back[~flushed], b[~flushed])
    assert (back[flushed] == 0).all()


def test_global_scale_both_formats():
    scale_2 = torch.tensor([2.0**-10, 3.0 * 2**-12])
    got = w4a16_global_scale(scale_2, 3)
    assert torch.equal(got, scale_2 * 2.0**116)
    ct = w4a16_global_scale(1.0 / scale_2, 3, "compressed_tensors")
    assert torch.equal(ct, got)
    with pytest.raises(ValueError, match="source_format"):
        w4a16_global_scale(scale_2, 0, "gguf")


@pytest.mark.parametrize("gated", [True, False], ids=["silu", "relu2"])
def test_dequantize_reads_the_checkpoint_weights(gated):
    # The emulation's decode: packed codes and scales times alpha are the
    # checkpoint's own dequantized weights wherever no scale was flushed
    # (here none is), rows in the packed order ([w1; w3] from [w3; w1] by
    # the rotation).
    e, i, h = 2, 64, 128
    w1, w2 = bf16_experts(e, i, h, gated=gated, seed=5)
    t = quantize_experts_modelopt(w1 * 0.05, w2 * 0.05, gated=gated)
    n = 2 * i if gated else i
    rotate = i if gated else 0
    w = torch.roll(t["w13_weight"], rotate, dims=1)  # load layout [w3; w1]
    s = torch.roll(t["w13_weight_scale"].view(torch.uint8), rotate, dims=1)
    s = s.view(torch.float8_e4m3fn)
    x = w4a16_scale_exponent(s)
    g = t["w13_weight_scale_2"][:, 0]
    deq = w4a16_dequantize(
        w4a16_pack_weight(w, rotate), w4a16_pack_blockscale(s, x, rotate)
    )
    deq = deq * w4a16_alpha(w4a16_global_scale(g, x)).view(e, 1, 1)
    ref = dequantize_nvfp4(t["w13_weight"], t["w13_weight_scale"], 1.0)
    ref = ref * g.view(e, 1, 1)  # e2m1 * block scale * scale_2
    assert deq.shape == (e, n, h)
    torch.testing.assert_close(deq, ref, rtol=0, atol=0)
    # Control: a decode that skipped the rotation reads up as gate.
    if gated:
        assert not torch.equal(torch.roll(deq, i, dims=1), ref)


# --- FlashInfer 0.7.4 as the oracle ----------------------------------------------

flashinfer_only = pytest.mark.skipif(
    not HAS_FLASHINFER, reason="needs flashinfer-python (the oracle)"
)


@pytest.fixture
def fi_prepare(monkeypatch):
    """FlashInfer's W4A16 prepare functions, runnable on CPU tensors: only
    the workspace size reads the device's SM count."""
    monkeypatch.setattr(
        torch.cuda,
        "get_device_properties",
        lambda device=None: types.SimpleNamespace(multi_processor_count=2),
    )
    from flashinfer.fused_moe.cute_dsl.blackwell_sm12x import moe_w4a16_prepare

    return moe_w4a16_prepare


# (E, H, I, gated): 2I = 192 and H = 192 pad the swizzled scale rows FlashInfer
# reads (to 256) and I/16 = 6 its columns (to 8); relu2 with I = 64 pads the
# w13 rows to 128 and H = 320 the w2 rows to 384.
FI_SHAPES = [
    (3, 256, 128, True),
    (2, 192, 96, True),
    (2, 320, 64, False),
    (2, 128, 192, False),
]
FI_IDS = [
    "E3_H256_I128_silu",
    "E2_H192_I96_silu",
    "E2_H320_I64_relu2",
    "E2_H128_I192_relu2",
]


def fi_tensors(e, h, i, gated, regime, seed=0):
    """ModelOpt-layout tensors: ``checkpoint`` quantizes real-magnitude
    weights (std 0.02; block scales reach 448, exponent 0); ``small`` draws
    block-scale bytes below 0x48 (exponent > 0, some flushed)."""
    w1, w2 = bf16_experts(e, i, h, gated=gated, seed=seed)
    t = quantize_experts_modelopt(w1 * 0.02 * h**0.5, w2 * 0.02 * i**0.5, gated)
    if regime == "small":
        gen = torch.Generator().manual_seed(seed + 1)
        for name in ("w13_weight_scale", "w2_weight_scale"):
            b = torch.randint(0, 0x48, t[name].shape, dtype=torch.uint8, generator=gen)
            t[name] = b.view(torch.float8_e4m3fn)
    return t


@flashinfer_only
@pytest.mark.parametrize("shape", FI_SHAPES, ids=FI_IDS)
@pytest.mark.parametrize("regime", ["checkpoint", "small"])
@pytest.mark.parametrize("fmt", ["modelopt", "compressed_tensors"])
@pytest.mark.parametrize("w13_layout", ["w13", "w31"])
def test_reference_equals_flashinfer(fi_prepare, shape, regime, fmt, w13_layout):
    e, h, i, gated = shape
    t = fi_tensors(e, h, i, gated, regime)
    g13, g2 = t["w13_weight_scale_2"][:, 0].contiguous(), t["w2_weight_scale_2"]
    if fmt == "compressed_tensors":  # weight_global_scale = 1 / scale_2
        g13, g2 = 1.0 / g13, 1.0 / g2
    prepare = (
        fi_prepare.prepare_w4a16_modelopt_nvfp4_weights
        if fmt == "modelopt"
        else fi_prepare.prepare_w4a16_compressed_tensors_weights
    )
    out = prepare(
        t["w13_weight"],
        swizzle_blockscale(t["w13_weight_scale"]),
        g13,
        t["w2_weight"],
        swizzle_blockscale(t["w2_weight_scale"]),
        g2,
        activation="silu" if gated else "relu2",
        w13_layout=w13_layout,
    )
    # FlashInfer's "w13" layout is its W4A4 order [w3; w1]: rotated by I.
    rotate = i if gated and w13_layout == "w13" else 0
    x13 = w4a16_scale_exponent(t["w13_weight_scale"])
    x2 = w4a16_scale_exponent(t["w2_weight_scale"])
    if regime == "small":
        assert x13 > 0 and x2 > 0
    assert torch.equal(out.w13, w4a16_pack_weight(t["w13_weight"], rotate))
    assert torch.equal(out.w2, w4a16_pack_weight(t["w2_weight"]))
    cases = (
        (out.w13_scale, t["w13_weight_scale"], x13, rotate),
        (out.w2_scale, t["w2_weight_scale"], x2, 0),
    )
    for got, scale, x, rot in cases:
        want = w4a16_pack_blockscale(scale, x, rot)
        assert got.dtype == want.dtype and got.shape == want.shape
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    assert torch.equal(out.w13_global_scale, w4a16_global_scale(g13, x13, fmt))
    assert torch.equal(out.w2_global_scale, w4a16_global_scale(g2, x2, fmt))
    # Control: the codes differ from the unrotated (or rotated) packing.
    if gated:
        wrong = w4a16_pack_weight(t["w13_weight"], i - rotate)
        assert not torch.equal(out.w13, wrong)


def test_unpack_fp4_is_what_the_codes_mean():
    # A guard for the tests above: the E2M1 code order they rely on.
    assert unpack_fp4(torch.tensor([0x71], dtype=torch.uint8)).tolist() == [1, 7]
