# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Bit-level tests of ``quantize_nvfp4_b12x_activation``, the model of how
FlashInfer 0.7.4's b12x W4A4 kernels quantize their activations.

The oracle here is a scalar transcription of the kernel source's arithmetic
(``flashinfer/cute_dsl/fp4_common.py``: ``quantize_block_fp4_fast`` and
``quantize_block_fp4``), one float32 operation at a time through ``struct``
(IEEE single rounding of the exact double result), with E4M3 and E2M1
rounding by nearest value from their bit definitions: it shares no code with
the function under test. Where flashinfer-python is installed
(``requirements/flashinfer-cpu.txt``), FlashInfer's own host-side NVFP4
reference (``flashinfer.experimental.b12x.testing.reference.helpers.
ref_fp4_quant``) is compared too.
"""

import importlib.util
import math
import struct

import pytest
import torch

from vllm.model_executor.layers.quantization.utils.flashinfer_b12x_w4a4_format import (
    quantize_nvfp4_b12x_activation,
)
from vllm.model_executor.layers.quantization.utils.nvfp4_format import (
    dequantize_nvfp4,
    e2m1_decode,
    unpack_fp4,
)


def f32(x: float) -> float:
    """Round a double to the nearest float32 (ties to even)."""
    return struct.unpack("f", struct.pack("f", x))[0]


TINY = 2.0**-126


def rcp_ftz(x: float) -> float:
    """rcp.approx.ftz.f32 as a correctly rounded reciprocal, subnormals
    flushed on the way in and out."""
    if abs(x) < TINY:
        return math.inf
    r = f32(1.0 / x)
    return 0.0 if abs(r) < TINY else r


def _nearest(value: float, table: list[tuple[int, float]]) -> int:
    """Code of the table entry nearest ``value`` >= 0; ties to the even code;
    beyond the largest, the largest (satfinite)."""
    value = min(value, max(v for _, v in table))  # inf too: no distance ties
    best = min(table, key=lambda cv: (abs(cv[1] - value), cv[0] & 1))
    return best[0]


# E4M3 (float8_e4m3fn) from its bits: 4 exponent bits (bias 7), 3 mantissa
# bits, exponent 0 subnormal; 0x7F is NaN, so 0x7E = 448 is the largest.
E4M3 = [
    (
        code,
        (code & 7) * 2.0**-9
        if code >> 3 == 0
        else (1 + (code & 7) / 8) * 2.0 ** ((code >> 3) - 7),
    )
    for code in range(0x7F)
]
# E2M1 magnitudes from their bits: 2 exponent bits (bias 1), 1 mantissa bit.
E2M1 = [
    (c, (c & 1) * 0.5 if c >> 1 == 0 else (1 + (c & 1) / 2) * 2.0 ** ((c >> 1) - 1))
    for c in range(8)
]


def e4m3_byte(s: float) -> int:
    return _nearest(min(s, 448.0), E4M3)


def e2m1_code(v: float) -> int:
    code = _nearest(abs(v), E2M1)
    return code | (8 if math.copysign(1.0, v) < 0 else 0)


def oracle_block(values, d, fast, reciprocal):
    """(codes, scale byte) of one 16-value block, as the kernel source
    computes them (the kernel reads the API scale as float32)."""
    d = f32(d)
    if reciprocal:
        d = rcp_ftz(d) if fast else f32(1.0 / d)
    m = max(abs(v) for v in values)
    if fast:
        g = rcp_ftz(d)
        s = f32(g * f32(m * f32(1.0 / 6.0)))
    else:
        s = f32(m / f32(6.0 * d))
    byte = e4m3_byte(s)
    qs = E4M3[byte][1]
    if qs == 0.0:
        return [0] * 16, byte
    inv = f32(rcp_ftz(qs) * g) if fast else f32(1.0 / f32(qs * d))
    return [e2m1_code(f32(v * inv)) for v in values], byte


def check_against_oracle(x, d, fast=True, reciprocal=False):
    """Compare every code and scale byte of ``x`` [R, K] (bf16) with the
    oracle; d is a float or one per row."""
    packed, scale = quantize_nvfp4_b12x_activation(
        x, d, fast_math=fast, scales_are_reciprocal=reciprocal
    )
    codes = unpack_fp4(packed).tolist()
    scale_bytes = scale.view(torch.uint8).tolist()
    rows = x.float().tolist()
    for r, row in enumerate(rows):
        dr = float(d[r]) if isinstance(d, torch.Tensor) and d.numel() > 1 else float(d)
        for b in range(len(row) // 16):
            want_codes, want_byte = oracle_block(
                row[16 * b : 16 * b + 16], dr, fast, reciprocal
            )
            assert scale_bytes[r][b] == want_byte, (r, b)
            assert codes[r][16 * b : 16 * b + 16] == want_codes, (r, b)


@pytest.mark.parametrize("fast", [True, False], ids=["fast", "precise"])
@pytest.mark.parametrize("std", [0.03, 0.3, 2.0])
def test_random_activations_match_the_kernel_arithmetic(fast, std):
    g = torch.Generator().manual_seed(int(std * 100) + fast)
    x = (torch.randn(6, 64, generator=g) * std).bfloat16()
    x[0, :16] = 0  # an all-zero block
    x[1, 3] = -0.0  # a negative zero inside a block
    calibrated = float(x.float().abs().max()) / (448 * 6)
    for d in (calibrated, 1.0, 4 * calibrated, calibrated / 64):
        check_against_oracle(x, d, fast)
    # One scale per row (per expert), and the reciprocal flag.
    per_row = torch.tensor([calibrated * (1 + r) for r in range(6)])
    check_against_oracle(x, per_row, fast)
    check_against_oracle(x, 1.0 / calibrated, fast, reciprocal=True)


def test_ties_round_to_even():
    # d = 1 and block max 1.5: the block scale is 0.25 (a power of two, so
    # the reciprocal is exact) and x * inv = 4x lands on every midpoint.
    mids = [0.0625, 0.1875, 0.3125, 0.4375, 0.625, 0.875, 1.25]  # 4x: 0.25 .. 5
    want = [0b0000, 0b0010, 0b0010, 0b0100, 0b0100, 0b0110, 0b0110]
    row = mids + [-v for v in mids] + [1.5, 0.0]
    x = torch.tensor([row], dtype=torch.bfloat16)
    packed, scale = quantize_nvfp4_b12x_activation(x, 1.0)
    assert scale.float().item() == 0.25
    codes = unpack_fp4(packed)[0].tolist()
    assert codes == want + [c | 8 for c in want] + [0b0111, 0b0000]
    check_against_oracle(x, 1.0)


def _order_sensitive_blocks(count: int):
    """(block max, d) pairs whose block scale byte differs between the fast
    path's order, rcp(d) * (m * rcp(6)), and the precise path's m / (6d):
    d at and around the float32 neighbours of m / (6 s) for an E4M3 midpoint
    s, where one ulp decides the rounding."""
    found = []
    mids = [f32((E4M3[c][1] + E4M3[c + 1][1]) / 2) for c in range(8, 0x7E, 5)]
    for m in [0.0390625, 0.3125, 1.171875, 1.90625]:  # exact in bf16
        for s in mids:
            d0 = f32(m / (6 * s))
            bits = struct.unpack("I", struct.pack("f", d0))[0]
            for k in range(-3, 4):
                d = struct.unpack("f", struct.pack("I", bits + k))[0]
                fast = oracle_block([m] + [0.0] * 15, d, True, False)[1]
                precise = oracle_block([m] + [0.0] * 15, d, False, False)[1]
                if fast != precise:
                    found.append((m, d))
                if len(found) == count:
                    return found
    return found


def test_fast_path_computes_the_scale_in_the_kernels_order():
    # One float32 ulp apart, the two orders round a block scale that sits on
    # an E4M3 midpoint to different bytes: only the kernel's order matches.
    cases = _order_sensitive_blocks(8)
    assert len(cases) == 8  # the search's own precondition
    for m, d in cases:
        x = torch.zeros(1, 16, dtype=torch.bfloat16)
        x[0, 0] = m
        check_against_oracle(x, d, fast=True)
        check_against_oracle(x, d, fast=False)


def test_block_scale_saturates_at_448_and_codes_at_6():
    # d far below the block's range: the scale clamps at 448 (byte 0x7E) and
    # every element beyond 6 * 448 * d saturates at code 7 (6.0).
    x = torch.linspace(-1, 1, 16).bfloat16().reshape(1, 16)
    d = 1e-6
    packed, scale = quantize_nvfp4_b12x_activation(x, d)
    assert scale.view(torch.uint8).item() == 0x7E
    codes = unpack_fp4(packed)[0]
    assert (codes[[0, 15]] == torch.tensor([0b1111, 0b0111], dtype=torch.uint8)).all()
    check_against_oracle(x, d)


def test_subnormal_and_flushed_block_scales():
    # d = 1: block max 0.006 -> scale 0.001 -> the E4M3 subnormal 2^-9
    # (byte 0x01); block max 0.002 -> 3.3e-4 < 2^-10 -> scale 0 and all-zero
    # codes, negatives included (no sign bits).
    small = torch.full((16,), 0.006)
    tiny = torch.full((16,), -0.002)
    tiny[0] = 0.002
    x = torch.cat([small, tiny]).bfloat16().reshape(1, 32)
    packed, scale = quantize_nvfp4_b12x_activation(x, 1.0)
    assert scale.view(torch.uint8).tolist() == [[0x01, 0x00]]
    assert (unpack_fp4(packed)[0, 16:] == 0).all()
    assert dequantize_nvfp4(packed, scale, 1.0)[0, 16:].abs().max() == 0
    check_against_oracle(x, 1.0)
    # The calibrated scale keeps the same block at full precision.
    d = 0.006 / (448 * 6)
    packed, scale = quantize_nvfp4_b12x_activation(x, d)
    assert scale.float().min() >= 2**-6  # normal E4M3 scales
    check_against_oracle(x, d)


def test_reciprocals_flush_subnormals():
    # rcp.approx.ftz: a scale whose reciprocal is subnormal (d > 2^126) reads
    # as 0 on the fast path, so every block scale and code is 0; the precise
    # path divides instead and keeps the normal block scales it can.
    # Here g * (m * rcp(6)) would be 1/6 (a normal block scale) without the
    # flush.
    x = torch.full((1, 16), 2.0**127).bfloat16()
    d = 2.0**127
    packed, scale = quantize_nvfp4_b12x_activation(x, d)
    assert (scale.view(torch.uint8) == 0).all() and (packed == 0).all()
    check_against_oracle(x, d)
    packed, scale = quantize_nvfp4_b12x_activation(x, d, fast_math=False)
    check_against_oracle(x, d, fast=False)
    # And the reciprocal flag's own reciprocal: 1 / d of a tiny d.
    check_against_oracle(x, 2.0**-127 * 3, reciprocal=True)
    # A subnormal d reads as 0 (rcp: inf): the block scale saturates at 448
    # (1 / d unflushed, 2^127, would give about 21) and so does every code.
    small = torch.full((1, 16), 2.0**-120).bfloat16()
    packed, scale = quantize_nvfp4_b12x_activation(small, 2.0**-127)
    assert scale.float().item() == 448.0 and (unpack_fp4(packed) == 7).all()
    check_against_oracle(small, 2.0**-127)


def test_mma_operand_times_scale_recovers_the_activation():
    # The direction: codes * block_scale is about x / d, so the kernel's
    # output multiplier d restores x (NVFP4's error, not a wrong magnitude).
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(8, 256, generator=g) * 0.05).bfloat16()
    d = float(x.float().abs().max()) / (448 * 6)
    packed, scale = quantize_nvfp4_b12x_activation(x, d)
    y = dequantize_nvfp4(packed, scale, 1.0) * d
    rel = ((y - x.float()).norm() / x.float().norm()).item()
    assert rel < 0.12, rel
    # Negative control: the quantization direction (1 / d) as the scale
    # underflows every block scale.
    packed, scale = quantize_nvfp4_b12x_activation(x, 1.0 / d)
    assert (scale.float() == 0).all()


@pytest.mark.parametrize(
    "scale,error",
    [
        (0.0, ValueError),
        (-1.0, ValueError),
        (math.inf, ValueError),
        (math.nan, ValueError),
        (torch.ones(3), ValueError),
    ],
)
def test_bad_scales_are_refused(scale, error):
    x = torch.zeros(2, 32, dtype=torch.bfloat16)
    with pytest.raises(error, match="scale"):
        quantize_nvfp4_b12x_activation(x, scale)


def test_bad_inputs_are_refused():
    with pytest.raises(TypeError, match="bfloat16"):
        quantize_nvfp4_b12x_activation(torch.zeros(1, 16, dtype=torch.int32), 1.0)
    with pytest.raises(ValueError, match="multiple of 16"):
        quantize_nvfp4_b12x_activation(torch.zeros(1, 24), 1.0)


@pytest.mark.skipif(
    importlib.util.find_spec("flashinfer") is None,
    reason="flashinfer-python is not installed (requirements/flashinfer-cpu.txt)",
)
@pytest.mark.parametrize("std", [0.03, 0.5, 2.0])
def test_agrees_with_flashinfers_host_reference(std):
    from flashinfer.experimental.b12x.testing.reference.helpers import ref_fp4_quant

    g = torch.Generator().manual_seed(7)
    x = (torch.randn(64, 512, generator=g) * std).bfloat16()
    d = torch.tensor(float(x.float().abs().max()) / (448 * 6))
    packed, scale = quantize_nvfp4_b12x_activation(x, d)
    # FlashInfer's reference takes the quantization direction; the kernel's
    # is rcp(d).
    ref_values, ref_scale = ref_fp4_quant(x.float(), 1.0 / d.float())
    assert torch.equal(scale.float(), ref_scale)
    ours = e2m1_decode(unpack_fp4(packed))
    differ = ours != ref_values
    # The reference rounds 1 / (qs / G) where the kernel computes rcp(qs) * G:
    # they may differ by an ulp, which moves only a value on a rounding
    # boundary, rarely.
    assert differ.float().mean() < 0.01
    if differ.any():
        qs = scale.float().repeat_interleave(16, dim=-1)
        product = x.float() * ((1.0 / qs) * (1.0 / d))
        mids = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
        gap = (product[differ].abs().unsqueeze(-1) - mids).abs().min(-1).values
        assert (gap <= 4e-7 * mids.max()).all()
