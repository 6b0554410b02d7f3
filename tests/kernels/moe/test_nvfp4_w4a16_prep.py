# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""W4A16 preparation in place: the reference's bytes, in bounded memory
(measured), resumable at any torch call, reloadable; the layer exposes
FlashInfer's ``packed_weights`` over its own parameters."""

import dataclasses
import importlib.util
import types

import pytest
import torch

from tests.kernels.moe.flashinfer_b12x_utils import apply_experts
from tests.kernels.moe.moe_reference import torch_moe, torch_topk
from tests.kernels.moe.test_nvfp4_moe_prep_state import (
    Interrupt,
    RaiseAtCall,
    _load_through_loader,
)
from tests.kernels.moe.utils import (
    bf16_experts,
    dequantized_experts,
    load_nvfp4_experts,
    quantize_experts_modelopt,
    rel_rms_error,
)
from tests.kernels.utils import bytes_of
from vllm.model_executor.layers.fused_moe.layer import FusedMoE
from vllm.model_executor.layers.fused_moe.weight_prep_state import PrepStatus
from vllm.model_executor.layers.quantization.modelopt import ModelOptNvFp4Config
from vllm.model_executor.layers.quantization.utils.bounded_chunks import (
    ChunkProgress,
)
from vllm.model_executor.layers.quantization.utils.flashinfer_w4a16_layout import (
    w4a16_alpha,
    w4a16_dequantize,
    w4a16_global_scale,
    w4a16_pack_blockscale,
    w4a16_pack_weight,
    w4a16_scale_exponent,
)
from vllm.model_executor.layers.quantization.utils.flashinfer_w4a16_moe import (
    pack_w4a16_blockscale_,
    repack_w4a16_weight_,
    unpack_w4a16_blockscale_,
    unrepack_w4a16_weight_,
    w4a16_min_transient_bytes,
)
from vllm.model_executor.layers.quantization.utils.nvfp4_utils import (
    swizzle_blockscale,
)
from vllm.utils.mem_utils import measure_peak_memory

BACKEND = "flashinfer_b12x_emulated"
MiB = 1 << 20


def _rand_weight(e, n, k, seed):
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (e, n, k // 2), dtype=torch.uint8, generator=gen)


def _rand_scale(e, n, k, seed, top=0x60):
    gen = torch.Generator().manual_seed(seed)
    b = torch.randint(0, top, (e, n, k // 16), dtype=torch.uint8, generator=gen)
    return b.view(torch.float8_e4m3fn)


# --- the bounded functions against the reference -------------------------------

# (E, N, K, rotate, cap): whole experts per chunk (A) and strips plus
# cycle-following (B, caps below one expert), rotation on and off, one
# chunk and many.
BOUNDED = [
    (3, 128, 256, 0, 64 * MiB),
    (3, 128, 256, 64, 64 * MiB),
    (5, 64, 32, 0, 12_000),  # tiny experts, several per chunk
    (2, 256, 2048, 0, 200_000),  # B: the 256 KiB expert does not fit
    (2, 256, 2048, 192, 200_000),
    (2, 384, 1024, 128, 140_000),
]
BOUNDED_IDS = ["A", "A_rot", "A_tiny", "B", "B_rot", "B_rot_3strips"]


@pytest.mark.parametrize("e,n,k,rotate,cap", BOUNDED, ids=BOUNDED_IDS)
def test_bounded_weight_equals_reference_and_round_trips(e, n, k, rotate, cap):
    w = _rand_weight(e, n, k, seed=n + rotate)
    x = w.clone()
    with measure_peak_memory("cpu") as mem:
        out = repack_w4a16_weight_(x, rotate=rotate, max_transient_bytes=cap)
    assert mem.peak_bytes <= min(cap, 2 * MiB), mem.peak_bytes
    assert out.data_ptr() == x.data_ptr() and out.dtype == torch.int32
    assert torch.equal(out, w4a16_pack_weight(w, rotate))
    with measure_peak_memory("cpu") as mem:
        back = unrepack_w4a16_weight_(x, rotate=rotate, max_transient_bytes=cap)
    assert mem.peak_bytes <= min(cap, 2 * MiB), mem.peak_bytes
    assert back is x and torch.equal(x, w)


@pytest.mark.parametrize("e,n,k,rotate,cap", BOUNDED, ids=BOUNDED_IDS)
def test_bounded_scale_equals_reference_and_round_trips(e, n, k, rotate, cap):
    cap = min(cap, max(w4a16_min_transient_bytes(n, k, scale=True), 5 * n * k // 32))
    s = _rand_scale(e, n, k, seed=k + rotate)
    x = w4a16_scale_exponent(s)
    y = s.clone()
    with measure_peak_memory("cpu") as mem:
        out = pack_w4a16_blockscale_(y, x, rotate=rotate, max_transient_bytes=cap)
    assert mem.peak_bytes <= cap, mem.peak_bytes
    want = w4a16_pack_blockscale(s, x, rotate)
    assert out.shape == want.shape and out.data_ptr() == y.data_ptr()
    assert torch.equal(bytes_of(out), bytes_of(want))
    unpack_w4a16_blockscale_(y, x, rotate=rotate, max_transient_bytes=cap)
    kept = s.float() * 2.0**x >= 2.0**-6
    assert torch.equal(y.view(torch.uint8)[kept], s.view(torch.uint8)[kept])
    assert (y.view(torch.uint8)[~kept] == 0).all()


@pytest.mark.parametrize("rotate", [64, 128, 192])
@pytest.mark.parametrize(
    "e,n,k,cap", [(2, 256, 256, 64 * MiB), (1, 256, 2048, 150_000)], ids=["A", "B"]
)
def test_every_rotation_the_contract_accepts_equals_the_reference(e, n, k, cap, rotate):
    # N = 256 (four strips): every multiple of 64 below N, on both paths
    # (A: whole experts; B: 150 KB is below one expert's codes and scales).
    # 64 and 192 are where rotating by +r and -r give different rows.
    w, s = _rand_weight(e, n, k, seed=rotate), _rand_scale(e, n, k, seed=rotate + 1)
    x = w4a16_scale_exponent(s)
    t = w.clone()
    out = repack_w4a16_weight_(t, rotate=rotate, max_transient_bytes=cap)
    assert torch.equal(out, w4a16_pack_weight(w, rotate))
    unrepack_w4a16_weight_(t, rotate=rotate, max_transient_bytes=cap)
    assert torch.equal(t, w)
    t = s.clone()
    out = pack_w4a16_blockscale_(t, x, rotate=rotate, max_transient_bytes=cap)
    assert torch.equal(bytes_of(out), bytes_of(w4a16_pack_blockscale(s, x, rotate)))
    unpack_w4a16_blockscale_(t, x, rotate=rotate, max_transient_bytes=cap)
    kept = s.float() * 2.0**x >= 2.0**-6  # the others are flushed to 0
    assert torch.equal(bytes_of(t)[kept.view(-1)], bytes_of(s)[kept.view(-1)])


def test_cycle_following_path_runs_below_one_expert():
    # The strip + cycle path is the one a cap smaller than an expert takes:
    # its peak stays below the expert's own size, and so does every chunk.
    e, n, k = 1, 512, 4096  # a 1 MiB expert
    w = _rand_weight(e, n, k, seed=1)
    cap = 400_000
    x, progress = w.clone(), ChunkProgress()
    with measure_peak_memory("cpu") as mem:
        repack_w4a16_weight_(x, rotate=256, max_transient_bytes=cap, progress=progress)
    assert mem.peak_bytes <= cap < n * k // 2
    assert progress.total > n // 64  # strips, then the cycle chunks
    assert torch.equal(
        x.view(torch.int32).view(e, k // 16, -1), w4a16_pack_weight(w, 256)
    )


def _min_cap(n, k, scale=False):
    return w4a16_min_transient_bytes(n, k, scale=scale)


# (E, N, K, cap): the strip path (B) at caps from the smallest the call
# accepts (scales) up to 4 MiB, with an expert larger than the budget each
# time (on CPU the budget is at most the 2 MiB tile). 210,920 B at N = 256,
# K = 2048 is the cap where a budget split that gave the strips all of it
# (not half) takes two 97 KiB strips a chunk instead of one and goes over.
STRIP_CAPS = [
    (2, 256, 2048, 210_920),
    (2, 256, 2048, 300_000),
    (1, 1024, 4096, 1 * MiB),
    (1, 1024, 4096, 4 * MiB),
]
STRIP_SCALE_CAPS = [
    (1, 512, 2048, _min_cap(512, 2048, scale=True)),
    (2, 512, 2048, 210_920),
    (1, 2048, 4096, 1 * MiB),
    (1, 2048, 4096, 4 * MiB),
]


def _path_a_bytes(n, k):
    """What path A would allocate for one expert of codes: its planes (1.5x
    the codes) and 512 B a strip."""
    return n // 64 * (64 * (k // 16) * 12 + 512)


def _cap_id(case):
    e, n, k, cap = case
    return f"E{e}_N{n}_K{k}_cap{cap}"


@pytest.mark.parametrize("e,n,k,cap", STRIP_CAPS, ids=map(_cap_id, STRIP_CAPS))
def test_strip_path_weight_peak_is_within_every_cap(e, n, k, cap):
    w = _rand_weight(e, n, k, seed=cap % 1000)
    bound = min(cap, 2 * MiB)
    assert _path_a_bytes(n, k) > bound  # path B: an expert does not fit
    x = w.clone()
    with measure_peak_memory("cpu") as mem:
        out = repack_w4a16_weight_(x, rotate=64, max_transient_bytes=cap)
    assert mem.peak_bytes <= bound, (mem.peak_bytes, bound)
    assert torch.equal(out, w4a16_pack_weight(w, 64))
    with measure_peak_memory("cpu") as mem:
        unrepack_w4a16_weight_(x, rotate=64, max_transient_bytes=cap)
    assert mem.peak_bytes <= bound, (mem.peak_bytes, bound)
    assert torch.equal(x, w)


@pytest.mark.parametrize(
    "e,n,k,cap", STRIP_SCALE_CAPS, ids=map(_cap_id, STRIP_SCALE_CAPS)
)
def test_strip_path_scale_peak_is_within_every_cap(e, n, k, cap):
    s = _rand_scale(e, n, k, seed=cap % 1000, top=0x7E)
    x = w4a16_scale_exponent(s)
    bound = min(cap, 2 * MiB)
    assert n * (5 * k // 16 + 16) > bound  # path B: an expert does not fit
    y = s.clone()
    with measure_peak_memory("cpu") as mem:
        out = pack_w4a16_blockscale_(y, x, rotate=64, max_transient_bytes=cap)
    assert mem.peak_bytes <= bound, (mem.peak_bytes, bound)
    assert torch.equal(bytes_of(out), bytes_of(w4a16_pack_blockscale(s, x, 64)))
    with measure_peak_memory("cpu") as mem:
        unpack_w4a16_blockscale_(y, x, rotate=64, max_transient_bytes=cap)
    assert mem.peak_bytes <= bound, (mem.peak_bytes, bound)


def test_bounded_errors_name_the_tensor_and_leave_it_intact():
    w = _rand_weight(1, 512, 4096, seed=2)
    x = w.clone()
    with pytest.raises(ValueError, match=r"max_transient_bytes=1000 .*weight"):
        repack_w4a16_weight_(x, max_transient_bytes=1000)
    with pytest.raises(ValueError, match="rotate must be a multiple of 64"):
        repack_w4a16_weight_(x, rotate=32)
    with pytest.raises(ValueError, match="weight must be a contiguous torch.uint8"):
        repack_w4a16_weight_(x.transpose(1, 2))
    with pytest.raises(ValueError, match="scale must be a contiguous"):
        pack_w4a16_blockscale_(x, 0)
    with pytest.raises(TypeError, match="weight must be a torch.Tensor"):
        repack_w4a16_weight_(x.numpy())
    assert torch.equal(x, w)


@pytest.mark.parametrize("path", ["A", "B"])
def test_interrupted_bounded_calls_resume_to_the_same_bytes(path):
    # Interrupted at any torch call of the call, then retried with the same
    # progress record: the reference's bytes, as uninterrupted.
    # A: 3 experts of 16 KiB; B: one 32 KiB expert under a 44 KB cap (two
    # strip chunks, then the cycle-following).
    e, n, k, cap = (3, 128, 128, 64 * MiB) if path == "A" else (1, 128, 512, 44_000)
    w, s = _rand_weight(e, n, k, seed=3), _rand_scale(e, n, k, seed=4)
    x = w4a16_scale_exponent(s)
    scale_cap = cap if path == "A" else w4a16_min_transient_bytes(n, k, scale=True)
    cases = [
        (
            w,
            lambda t, p: repack_w4a16_weight_(
                t, rotate=64, max_transient_bytes=cap, progress=p
            ),
            bytes_of(w4a16_pack_weight(w, 64)),
        ),
        (
            s,
            lambda t, p: pack_w4a16_blockscale_(
                t, x, rotate=64, progress=p, max_transient_bytes=scale_cap
            ),
            bytes_of(w4a16_pack_blockscale(s, x, 64)),
        ),
    ]
    for src, call, want in cases:
        t, progress = src.clone(), ChunkProgress()
        with RaiseAtCall() as counter:
            call(t, progress)
        assert counter.calls > 10
        for k_call in range(1, counter.calls + 1):
            t, progress = src.clone(), ChunkProgress()
            with pytest.raises(Interrupt), RaiseAtCall(k_call):
                call(t, progress)
            call(t, progress)
            assert torch.equal(bytes_of(t), want), k_call


def test_stopping_one_chunk_short_is_seen():
    # Control for the chunk bookkeeping: the same call stopped before its
    # last chunk (a cycle-following chunk here) leaves bytes that differ from
    # the reference, so the tests above would see a skipped chunk.
    e, n, k, cap = 1, 256, 2048, 200_000
    w = _rand_weight(e, n, k, seed=5)
    full = ChunkProgress()
    repack_w4a16_weight_(w.clone(), max_transient_bytes=cap, progress=full)
    z, partial = w.clone(), ChunkProgress()
    with pytest.raises(Interrupt), _StopAfterChunks(full.total - 1, partial):
        repack_w4a16_weight_(z, max_transient_bytes=cap, progress=partial)
    assert partial.done == full.total - 1
    want = w4a16_pack_weight(w)
    assert not torch.equal(z.view(torch.int32).view(want.shape), want)
    repack_w4a16_weight_(z, max_transient_bytes=cap, progress=partial)
    assert torch.equal(z.view(torch.int32).view(want.shape), want)


class _StopAfterChunks(RaiseAtCall):
    """Raise ``Interrupt`` at the first torch call once ``progress.done``
    reaches ``chunks``."""

    def __init__(self, chunks: int, progress: ChunkProgress):
        super().__init__(None)
        self.chunks, self.progress = chunks, progress

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if self.progress.done >= self.chunks:
            raise Interrupt("stop")
        return func(*args, **(kwargs or {}))


# --- the layer ------------------------------------------------------------------


def _w4a16_layer(e, h, i, gated, *, cap=None, place_w3w1=True, **kwargs):
    experts_kwargs = {} if cap is None else {"max_transient_bytes": cap}
    return FusedMoE(
        num_experts=e,
        top_k=2,
        hidden_size=h,
        intermediate_size=i,
        activation="silu" if gated else "relu2",
        quant_config=ModelOptNvFp4Config.for_mode("w4a16"),
        moe_backend=BACKEND,
        place_w3w1_at_load=place_w3w1,
        experts_kwargs=experts_kwargs,
        **kwargs,
    )


def _tensors(e, h, i, gated, seed, std=0.02):
    w1, w2 = bf16_experts(e, i, h, gated=gated, seed=seed)
    # Real checkpoint magnitudes: expert weights of std ``std``.
    return quantize_experts_modelopt(
        w1.float() * std * h**0.5, w2.float() * std * i**0.5, gated
    )


def _prepare(layer):
    layer.quant_method.process_weights_after_loading(layer)
    return layer


def _w3w1(t, i):
    """Checkpoint tensors with w13 as [w3; w1] (what the layer's loader
    places for b12x; a layer made with place_w3w1 takes them as they are)."""
    out = dict(t)
    out["w13_weight"] = torch.roll(t["w13_weight"], i, dims=1)
    scale = torch.roll(t["w13_weight_scale"].view(torch.uint8), i, dims=1)
    out["w13_weight_scale"] = scale.view(torch.float8_e4m3fn)
    out["w13_weight_scale_2"] = t["w13_weight_scale_2"].flip(1)
    return out


def _expected_packed(t, gated, i):
    """The reference's packed weights of checkpoint tensors ([w1; w3])."""
    x13 = w4a16_scale_exponent(t["w13_weight_scale"])
    x2 = w4a16_scale_exponent(t["w2_weight_scale"])
    e = t["w13_weight"].shape[0]
    s13 = t["w13_weight_scale_2"].reshape(e, -1)
    return {
        "w13": w4a16_pack_weight(t["w13_weight"]),
        "w13_scale": w4a16_pack_blockscale(t["w13_weight_scale"], x13),
        "w13_global_scale": w4a16_global_scale(s13[:, 0], x13),
        "w2": w4a16_pack_weight(t["w2_weight"]),
        "w2_scale": w4a16_pack_blockscale(t["w2_weight_scale"], x2),
        "w2_global_scale": w4a16_global_scale(t["w2_weight_scale_2"], x2),
    }


def _packed_bytes(layer) -> dict[str, torch.Tensor]:
    pw = layer.quant_method.experts.prepared
    return {
        f: bytes_of(getattr(pw, f).contiguous()).clone()
        for f in (
            "w13",
            "w13_scale",
            "w13_global_scale",
            "w2",
            "w2_scale",
            "w2_global_scale",
        )
    }


# (E, H, I, gated): I = 96 (a [w3; w1] rotation of 96 rows: the half swap);
# relu2 with I = 64 (one tile of rows).
LAYERS = [(4, 256, 128, True), (3, 192, 96, True), (3, 128, 64, False)]
LAYER_IDS = ["E4_H256_I128_silu", "E3_H192_I96_silu", "E3_H128_I64_relu2"]


@pytest.mark.parametrize("place_w3w1", [True, False], ids=["w3w1", "w1w3"])
@pytest.mark.parametrize("shape", LAYERS, ids=LAYER_IDS)
def test_layer_packed_weights_are_the_reference_in_the_parameters(shape, place_w3w1):
    e, h, i, gated = shape
    t = _tensors(e, h, i, gated, seed=1)
    layer = _w4a16_layer(e, h, i, gated, place_w3w1=place_w3w1)
    _load_through_loader(layer, t)
    ptrs = {n: p.untyped_storage().data_ptr() for n, p in layer.named_parameters()}
    _prepare(layer)
    pw = layer.quant_method.experts.prepared
    want = _expected_packed(t, gated, i)
    for field, ref in want.items():
        got = getattr(pw, field)
        assert got.dtype == ref.dtype and got.shape == ref.shape, field
        assert torch.equal(bytes_of(got.contiguous()), bytes_of(ref)), field
    # w13 / w2 and their scales are the loaded parameters' own storage.
    for field, name in (
        ("w13", "w13_weight"),
        ("w2", "w2_weight"),
        ("w13_scale", "w13_weight_scale"),
        ("w2_scale", "w2_weight_scale"),
    ):
        assert getattr(pw, field).untyped_storage().data_ptr() == ptrs[name]
    assert layer.weight_prep_state.status is PrepStatus.PREPARED


@pytest.mark.parametrize("shape", LAYERS, ids=LAYER_IDS)
def test_layer_runs_within_bf16_tolerance_of_the_dequantized_moe(shape):
    # Emulation vs the BF16 MoE on the checkpoint's exact dequantized
    # weights: rounding only (see test_flashinfer_b12x_moe.WEIGHTS_ONLY_TOL).
    e, h, i, gated = shape
    t = _tensors(e, h, i, gated, seed=2)
    layer = _w4a16_layer(e, h, i, gated)
    _load_through_loader(layer, t)
    _prepare(layer)
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(12, h, generator=gen).bfloat16()
    logits = torch.randn(12, e, generator=gen)
    out = layer(x, logits)
    act = "silu" if gated else "relu2"
    dw1, dw2 = dequantized_experts(t, gated)
    ref = torch_moe(x, dw1, dw2, logits, 2, True, act)
    assert rel_rms_error(out, ref) < 0.01
    # Input scales are not read: loading some changes nothing.
    t2 = dict(
        t,
        w13_input_scale=t["w13_input_scale"] * 7,
        w2_input_scale=t["w2_input_scale"] * 3,
    )
    other = _w4a16_layer(e, h, i, gated)
    _load_through_loader(other, t2)
    assert torch.equal(_prepare(other)(x, logits), out)


@pytest.mark.parametrize("i", [128, 96], ids=["I128_rotated", "I96_half_swap"])
def test_differing_gate_and_up_scales_go_to_fc2_alpha(i):
    # The layer places w13 as [w3; w1]: I = 128 is undone by the rotation,
    # I = 96 by the half swap, whose [E, 2] global scales must swap too.
    e, h = 4, 256
    w1, w2 = bf16_experts(e, i, h, gated=True, seed=4)
    t = quantize_experts_modelopt(
        w1.float() * 0.02 * h**0.5,
        w2.float() * 0.02 * i**0.5,
        True,
        shared_w13_scale=False,
    )
    s13 = t["w13_weight_scale_2"]
    assert not torch.equal(s13[:, 0], s13[:, 1])
    layer = _w4a16_layer(e, h, i, True)
    _load_through_loader(layer, t)
    _prepare(layer)
    gen = torch.Generator().manual_seed(5)
    x, logits = (
        torch.randn(16, h, generator=gen).bfloat16(),
        torch.randn(16, e, generator=gen),
    )
    dw1, dw2 = dequantized_experts(t, True)
    ref = torch_moe(x, dw1, dw2, logits, 2, True)
    assert rel_rms_error(layer(x, logits), ref) < 0.01
    # Control: with FC2's alpha left at s_w2 (the ratio dropped) the output
    # misses by the ratio.
    pw = layer.quant_method.experts.prepared
    x2 = w4a16_scale_exponent(t["w2_weight_scale"])
    pw.w2_global_scale.copy_(w4a16_global_scale(t["w2_weight_scale_2"], x2))
    assert rel_rms_error(layer(x, logits), ref) > 0.05


def _shift_exponent(t, name, x):
    """``t`` with ``name``'s block scales divided by 2^x and its global
    scale multiplied by 2^x: the same weights, FlashInfer's exponent x
    larger (exact: every scale stays a normal E4M3 number)."""
    out = dict(t)
    s = t[f"{name}_weight_scale"].float()
    assert s[s > 0].min() / 2**x >= 2**-6
    out[f"{name}_weight_scale"] = (s / 2**x).to(torch.float8_e4m3fn)
    out[f"{name}_weight_scale_2"] = t[f"{name}_weight_scale_2"] * 2**x
    return out


@pytest.mark.parametrize("shifted", ["w13", "w2"])
def test_w13_and_w2_with_different_scale_exponents(shifted):
    # Each weight has its own power-of-two factor 2^x (the checkpoints of
    # the other tests share x = 0). Packing w2's scales with w13's x = 4
    # overflows FP16 (448 * 2^4 * 2^7 > 65504); its alpha with w13's x is
    # off by 2^4.
    e, h, i = 4, 256, 128
    t = _shift_exponent(_tensors(e, h, i, True, seed=8), shifted, 4)
    x13 = w4a16_scale_exponent(t["w13_weight_scale"])
    x2 = w4a16_scale_exponent(t["w2_weight_scale"])
    assert (x13, x2) == ((4, 0) if shifted == "w13" else (0, 4))
    layer = _w4a16_layer(e, h, i, True)
    _load_through_loader(layer, t)
    loaded = {n: bytes_of(p.detach()).clone() for n, p in layer.named_parameters()}
    _prepare(layer)
    gen = torch.Generator().manual_seed(9)
    x = torch.randn(12, h, generator=gen).bfloat16()
    logits = torch.randn(12, e, generator=gen)
    out = layer(x, logits)
    assert torch.isfinite(out.float()).all()
    dw1, dw2 = dequantized_experts(t, True)
    assert rel_rms_error(out, torch_moe(x, dw1, dw2, logits, 2, True)) < 0.01
    pw = layer.quant_method.experts.prepared
    want = w4a16_global_scale(t["w2_weight_scale_2"], x2)
    assert torch.equal(pw.w2_global_scale, want)
    # The restore unpacks each weight's scales with its own exponent too.
    layer.quant_method.restore_load_layout(layer)
    for n, p in layer.named_parameters():
        assert torch.equal(bytes_of(p.detach()), loaded[n]), n


def test_emulation_rounds_fc1_and_the_activation_to_bf16():
    # The kernel keeps FC1's output and the activation in BF16; the
    # emulation must too. The reference here, from the packed weights, does
    # both roundings; the control without FC1's rounding differs in most of
    # the 12 x 256 outputs, the emulation in almost none (op order only).
    e, h, i = 4, 256, 128
    t = _tensors(e, h, i, True, seed=10)
    layer = _w4a16_layer(e, h, i, True)
    _load_through_loader(layer, t)
    _prepare(layer)
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(12, h, generator=gen).bfloat16()
    logits = torch.randn(12, e, generator=gen)
    out = layer(x, logits)
    pw = layer.quant_method.experts.prepared
    weights, ids = torch_topk(logits, 2, renormalize=True)

    def reference(round_fc1: bool) -> torch.Tensor:
        a1, a2 = w4a16_alpha(pw.w13_global_scale), w4a16_alpha(pw.w2_global_scale)
        w13 = w4a16_dequantize(pw.w13, pw.w13_scale)  # [E, 2I, H], [gate; up]
        w2 = w4a16_dequantize(pw.w2, pw.w2_scale)  # [E, H, I]
        y = torch.zeros(12, h)
        for tok in range(12):
            for j in range(2):
                ex = int(ids[tok, j])
                fc1 = (x[tok].float() @ w13[ex].t()) * a1[ex]
                if round_fc1:
                    fc1 = fc1.bfloat16().float()
                gate, up = fc1[:i], fc1[i:]
                act = (torch.nn.functional.silu(gate) * up).bfloat16().float()
                y[tok] += (act @ w2[ex].t()) * (weights[tok, j] * a2[ex])
        return y.bfloat16()

    differ = (out != reference(True)).float().mean().item()
    control = (out != reference(False)).float().mean().item()
    assert differ < 0.05, differ
    assert control > 0.3, control


def test_prepared_twice_is_a_no_op_and_forward_refuses_before():
    e, h, i, gated = LAYERS[0]
    layer = _w4a16_layer(e, h, i, gated)
    _load_through_loader(layer, _tensors(e, h, i, gated, seed=6))
    x = torch.zeros(2, h, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="process_weights_after_loading"):
        layer(x, torch.zeros(2, e))
    before = _packed_bytes(_prepare(layer))
    with RaiseAtCall() as counter:
        _prepare(layer)
    # No preparation step ran again: no torch op wrote into a parameter
    # (the conversion and the kernel's views are rebuilt: tiny tensors).
    params = {p.untyped_storage().data_ptr() for p in layer.parameters()}
    assert not counter.written & params, counter.names
    assert all(
        torch.equal(a, b)
        for a, b in zip(before.values(), _packed_bytes(layer).values(), strict=True)
    )


@pytest.mark.parametrize(
    "shape", [(2, 128, 64, True), (2, 192, 96, True)], ids=["I64", "I96_halves"]
)
def test_interrupted_layer_preparation_resumes_to_the_same_bytes(shape):
    e, h, i, gated = shape
    t = _tensors(e, h, i, gated, seed=7)
    cap = 24 << 10  # several chunks per step

    def fresh():
        layer = _w4a16_layer(e, h, i, gated, cap=cap)
        load_nvfp4_experts(layer, _w3w1(t, i))  # the layer places [w3; w1]
        return layer

    want = _packed_bytes(_prepare(fresh()))
    layer = fresh()
    with RaiseAtCall() as counter:
        _prepare(layer)
    # Every call of the smaller layer; every 5th (and the last ones) of the
    # one with the half swap (its calls are the same steps, more of them).
    step = 1 if i == 64 else 5
    for k in [*range(1, counter.calls + 1, step), counter.calls]:
        layer = fresh()
        with pytest.raises(Interrupt), RaiseAtCall(k):
            _prepare(layer)
        _prepare(layer)
        got = _packed_bytes(layer)
        assert all(torch.equal(got[f], want[f]) for f in want), k


@pytest.mark.parametrize("shape", LAYERS, ids=LAYER_IDS)
def test_reload_into_prepared_layer_equals_fresh_layer(shape):
    e, h, i, gated = shape
    old, new = _tensors(e, h, i, gated, seed=8), _tensors(e, h, i, gated, seed=9)
    cap = 64 << 10
    layer = _w4a16_layer(e, h, i, gated, cap=cap)
    _load_through_loader(layer, old)
    _prepare(layer)
    storages = {n: p.untyped_storage().data_ptr() for n, p in layer.named_parameters()}
    with measure_peak_memory("cpu") as mem:
        _load_through_loader(layer, new)
        _prepare(layer)
    assert mem.peak_bytes <= cap
    for n, p in layer.named_parameters():
        assert p.untyped_storage().data_ptr() == storages[n], n
    fresh = _w4a16_layer(e, h, i, gated, cap=cap)
    _load_through_loader(fresh, new)
    _prepare(fresh)
    got, want = _packed_bytes(layer), _packed_bytes(fresh)
    assert all(torch.equal(got[f], want[f]) for f in want)


def test_restore_gives_the_loaded_bytes_back():
    e, h, i, gated = LAYERS[0]
    t = _tensors(e, h, i, gated, seed=10)
    layer = _w4a16_layer(e, h, i, gated, cap=64 << 10)
    _load_through_loader(layer, t)
    loaded = {n: bytes_of(p.detach()).clone() for n, p in layer.named_parameters()}
    _prepare(layer)
    layer.quant_method.restore_load_layout(layer)
    assert layer.weight_prep_state.status is PrepStatus.LOADING
    assert layer.quant_method.experts.prepared is None
    for n, p in layer.named_parameters():
        # no scale of these checkpoint-magnitude weights is flushed
        assert torch.equal(bytes_of(p.detach()), loaded[n]), n


def test_qwen36_layer_peak_at_the_default_cap():
    # The Qwen3.6-35B-A3B layer (H = 2048, I = 512) with 2 of its 256
    # experts: the default cap chunks one expert at a time (1.5 MiB of planes
    # for the 1 MiB w13 expert, less for the others), so the peak does not
    # grow with E: at most 2 MiB (FlashInfer: 481 MiB public, 96.6 MiB in
    # place, for the whole layer).
    e, h, i = 2, 2048, 512
    layer = _w4a16_layer(e, h, i, True)
    load_nvfp4_experts(layer, _tensors(e, h, i, True, seed=11, std=0.02))
    with measure_peak_memory("cpu") as mem:
        _prepare(layer)
    assert mem.peak_bytes <= 2 * MiB, mem.peak_bytes


def test_deepseek_v3_expert_within_a_4_mib_cap():
    # DeepSeek-V3's routed expert (H = 7168, I = 2048): w13 is 14 MiB, w2
    # 7 MiB; under a 4 MiB cap every step goes strip by strip and through the
    # cycle-following, and gives the reference's bytes.
    e, h, i = 1, 7168, 2048
    gen = torch.Generator().manual_seed(12)
    t = {
        "w13_weight": torch.randint(
            0, 256, (e, 2 * i, h // 2), dtype=torch.uint8, generator=gen
        ),
        "w13_weight_scale": _rand_scale(e, 2 * i, h, seed=13, top=0x7E),
        "w13_weight_scale_2": torch.full((e, 2), 2.0**-12),
        "w2_weight": torch.randint(
            0, 256, (e, h, i // 2), dtype=torch.uint8, generator=gen
        ),
        "w2_weight_scale": _rand_scale(e, h, i, seed=14, top=0x7E),
        "w2_weight_scale_2": torch.full((e,), 2.0**-11),
    }
    layer = _w4a16_layer(e, h, i, True, cap=4 * MiB, place_w3w1=False)
    load_nvfp4_experts(layer, t)
    with measure_peak_memory("cpu") as mem:
        _prepare(layer)
    assert mem.peak_bytes <= 4 * MiB, mem.peak_bytes
    want = _expected_packed(t, True, i)
    got = _packed_bytes(layer)
    for field, ref in want.items():
        assert torch.equal(got[field], bytes_of(ref)), field


# --- FlashInfer 0.7.4 as the oracle of the layer --------------------------------


@pytest.mark.skipif(
    importlib.util.find_spec("flashinfer") is None,
    reason="needs flashinfer-python (the oracle)",
)
@pytest.mark.parametrize("shape", LAYERS, ids=LAYER_IDS)
def test_layer_packed_weights_equal_flashinfer(shape, monkeypatch):
    sms = types.SimpleNamespace(multi_processor_count=2)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d=None: sms)
    from flashinfer.fused_moe.cute_dsl.blackwell_sm12x import moe_w4a16_prepare as fi

    e, h, i, gated = shape
    t = _tensors(e, h, i, gated, seed=15)
    out = fi.prepare_w4a16_modelopt_nvfp4_weights(
        t["w13_weight"],
        swizzle_blockscale(t["w13_weight_scale"]),
        t["w13_weight_scale_2"][:, 0].contiguous(),
        t["w2_weight"],
        swizzle_blockscale(t["w2_weight_scale"]),
        t["w2_weight_scale_2"],
        activation="silu" if gated else "relu2",
        w13_layout="w31",
    )
    layer = _w4a16_layer(e, h, i, gated)
    _load_through_loader(layer, t)
    got = _packed_bytes(_prepare(layer))
    for field in got:
        ref = getattr(out, field)
        assert getattr(layer.quant_method.experts.prepared, field).shape == ref.shape
        assert torch.equal(got[field], bytes_of(ref.contiguous())), field


@pytest.mark.skipif(
    importlib.util.find_spec("flashinfer") is None,
    reason="needs flashinfer-python (the real signature)",
)
def test_kernel_call_binds_to_flashinfers_launch(monkeypatch):
    # The call FlashInferB12xW4A16Experts.apply makes, bound to FlashInfer
    # 0.7.4's own launch_sm120_moe signature and W4A16PackedWeights fields:
    # the prepared weights go in as they are (the same tensors, no copy), with
    # the expert map of expert parallelism.
    import inspect

    from flashinfer.fused_moe.cute_dsl.blackwell_sm12x import moe_dispatch

    from vllm.model_executor.layers.fused_moe.experts import flashinfer_b12x_w4a16 as m
    from vllm.model_executor.layers.fused_moe.experts.flashinfer_b12x_call import (
        flashinfer_w4a16_prepared_call,
    )

    sms = types.SimpleNamespace(multi_processor_count=3)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d=None: sms)
    assert flashinfer_w4a16_prepared_call()
    e, h, i = 4, 256, 128
    layer = _w4a16_layer(2 * e, h, i, True, ep_rank=1, ep_size=2)
    _load_through_loader(layer, _tensors(2 * e, h, i, True, seed=16))
    _prepare(layer)
    experts = layer.quant_method.experts
    pw = experts.prepared
    prepared = m.flashinfer_packed_weights(pw, torch.device("cpu"))
    assert prepared.workspace.shape == (3 * 4 + 2,)
    for field in (
        "w13",
        "w13_scale",
        "w13_global_scale",
        "w2",
        "w2_scale",
        "w2_global_scale",
    ):
        assert getattr(prepared, field) is getattr(pw, field)
    x = torch.zeros(3, h, dtype=torch.bfloat16)
    ids = torch.tensor([[0, 5], [7, 4], [1, 2]], dtype=torch.int32)
    kwargs = m.w4a16_launch_kwargs(
        experts.moe_config,
        pw,
        prepared,
        x,
        layer.w13_weight,
        layer.w2_weight,
        torch.ones(3, 2),
        ids,
        layer.expert_map,
        torch.empty_like(x),
    )
    bound = inspect.signature(moe_dispatch.launch_sm120_moe).bind(**kwargs)
    assert bound.arguments["_prepared_weights"] is prepared
    assert bound.arguments["num_experts"] == 2 * e
    assert bound.arguments["num_local_experts"] == e
    assert bound.arguments["quant_mode"] == "w4a16"
    # Rank 1 of 2 holds global experts 4..7 at local 0..3.
    emap = bound.arguments["expert_map"]
    assert emap.dtype == torch.int32 and emap.tolist() == [-1] * 4 + [0, 1, 2, 3]


@pytest.mark.parametrize("ep_rank", [0, 1])
def test_launch_arguments_under_expert_parallelism_without_flashinfer(ep_rank):
    # The keyword arguments of launch_sm120_moe, built on CPU (FlashInfer not
    # needed: ``prepared`` stands in for its packed-weights object). Rank r
    # of 2 holds global experts 4r..4r+3 at local ids 0..3.
    from vllm.model_executor.layers.fused_moe.experts.flashinfer_b12x_w4a16 import (
        w4a16_launch_kwargs,
    )

    e, h, i = 4, 256, 128
    layer = _w4a16_layer(2 * e, h, i, True, ep_rank=ep_rank, ep_size=2)
    _load_through_loader(layer, _tensors(2 * e, h, i, True, seed=16))
    _prepare(layer)
    experts = layer.quant_method.experts
    pw, prepared = experts.prepared, object()
    x = torch.zeros(3, h, dtype=torch.bfloat16)
    ids = torch.tensor([[0, 5], [7, 4], [1, 2]], dtype=torch.int64)
    weights = torch.full((3, 2), 0.5, dtype=torch.bfloat16)
    out = torch.empty_like(x)
    kw = w4a16_launch_kwargs(
        experts.moe_config,
        pw,
        prepared,
        x,
        layer.w13_weight,
        layer.w2_weight,
        weights,
        ids,
        layer.expert_map.long(),  # whatever map dtype: the kernel's is int32
        out,
    )
    assert kw["num_experts"] == 2 * e and kw["num_local_experts"] == e
    assert kw["top_k"] == 2 and kw["quant_mode"] == "w4a16"
    emap = kw["expert_map"]
    assert emap.dtype == torch.int32
    want = [-1] * 8
    want[4 * ep_rank : 4 * ep_rank + 4] = [0, 1, 2, 3]
    assert emap.tolist() == want
    assert kw["topk_ids"].dtype == torch.int32 and kw["topk_ids"].tolist() == [
        [0, 5],
        [7, 4],
        [1, 2],
    ]
    assert kw["topk_weights"].dtype == torch.float32
    assert kw["_prepared_weights"] is prepared and kw["scatter_output"] is out
    assert kw["a"] is x and kw["w1_weight"] is layer.w13_weight
    assert kw["w1_weight_sf"] is pw.w13_scale and kw["w2_weight_sf"] is pw.w2_scale
    assert kw["w1_alpha"] is pw.w13_global_scale
    assert kw["w2_alpha"] is pw.w2_global_scale
    assert pw.num_experts == e and pw.w13.shape[0] == e
    # Without expert parallelism: no map, every expert local.
    single = _w4a16_layer(e, h, i, True)
    _load_through_loader(single, _tensors(e, h, i, True, seed=17))
    _prepare(single)
    ex1 = single.quant_method.experts
    kw = w4a16_launch_kwargs(
        ex1.moe_config,
        ex1.prepared,
        prepared,
        x,
        single.w13_weight,
        single.w2_weight,
        weights,
        ids % e,
        single.expert_map,
        out,
    )
    assert kw["expert_map"] is None
    assert kw["num_experts"] == kw["num_local_experts"] == e
    # top_k is the config's (3 here), not a constant.
    top3 = dataclasses.replace(ex1.moe_config, experts_per_token=3)
    ids3 = torch.tensor([[0, 1, 2], [3, 2, 1], [1, 0, 3]])
    kw = w4a16_launch_kwargs(
        top3,
        ex1.prepared,
        prepared,
        x,
        single.w13_weight,
        single.w2_weight,
        torch.full((3, 3), 1 / 3),
        ids3,
        None,
        out,
    )
    assert kw["top_k"] == 3


def test_apply_launches_with_the_layers_expert_map(monkeypatch):
    # The kernel experts' apply under expert parallelism hands its expert map
    # on to launch_sm120_moe (a recorder here, FlashInfer not needed): rank 1
    # of 2 holds global experts 4..7 at local 0..3.
    import sys

    from vllm.model_executor.layers.fused_moe.experts import flashinfer_b12x_moe as m
    from vllm.model_executor.layers.fused_moe.experts.flashinfer_b12x_call import (
        Support,
    )

    e, h, i = 4, 256, 128
    layer = _w4a16_layer(2 * e, h, i, True, ep_rank=1, ep_size=2)
    _load_through_loader(layer, _tensors(2 * e, h, i, True, seed=16))
    _prepare(layer)
    experts = layer.quant_method.experts
    experts.__class__ = m.FlashInferB12xExperts  # the emulation's base
    experts._flashinfer_packed = packed = object()  # FlashInfer's object
    calls = []
    dispatch = types.SimpleNamespace(launch_sm120_moe=lambda **kw: calls.append(kw))
    monkeypatch.setitem(
        sys.modules,
        "flashinfer.fused_moe.cute_dsl.blackwell_sm12x",
        types.SimpleNamespace(moe_dispatch=dispatch),
    )
    monkeypatch.setattr(m, "flashinfer_w4a16_prepared_call", Support.yes)
    x = torch.zeros(3, h, dtype=torch.bfloat16)
    ids = torch.tensor([[0, 5], [7, 4], [1, 2]], dtype=torch.int32)
    out = apply_experts(
        experts,
        layer,
        x,
        torch.ones(3, 2),
        ids,
        experts.moe_config.activation,
        2 * e,
        expert_map=layer.expert_map,
    )
    (kw,) = calls
    assert kw["_prepared_weights"] is packed and kw["scatter_output"] is out
    assert kw["expert_map"].tolist() == [-1] * 4 + [0, 1, 2, 3]


def test_w4a16_layer_takes_the_alpha_mode_only():
    # W4A4's experts options: "alpha" (what W4A16 does) is accepted, "fold"
    # refused with the reason; a geometry the layout cannot hold is named.
    _w4a16_layer(2, 128, 64, True, cap=None)
    with pytest.raises(ValueError, match="global_scale_mode must be 'alpha'"):
        FusedMoE(
            num_experts=2,
            top_k=1,
            hidden_size=128,
            intermediate_size=64,
            quant_config=ModelOptNvFp4Config.for_mode("w4a16"),
            moe_backend=BACKEND,
            experts_kwargs={"global_scale_mode": "fold"},
        )
    with pytest.raises(
        ValueError, match="hidden size must be a positive multiple of 64"
    ):
        FusedMoE(
            num_experts=2,
            top_k=1,
            hidden_size=96,
            intermediate_size=64,
            quant_config=ModelOptNvFp4Config.for_mode("w4a16"),
            moe_backend=BACKEND,
        )


@pytest.mark.parametrize(
    "name, index, shard",
    [
        ("w13_weight_scale_2", (1, 1), "w1"),  # loaded as [w3; w1]: column 1 is w1
        ("w2_weight_scale_2", (0,), "w2"),
    ],
)
def test_bad_global_scale_is_refused_before_any_write(name, index, shard):
    e, h, i, gated = LAYERS[0]
    layer = _w4a16_layer(e, h, i, gated)
    _load_through_loader(layer, _tensors(e, h, i, gated, seed=6))
    # Control: a W4A16 layer reads no input scales, so a bad one is ignored.
    control = _w4a16_layer(e, h, i, gated)
    _load_through_loader(control, _tensors(e, h, i, gated, seed=6))
    control.w13_input_scale.data.fill_(float("nan"))
    _prepare(control)
    getattr(layer, name).data[index] = float("nan")
    before = {n: bytes_of(p).clone() for n, p in layer.named_parameters()}
    with pytest.raises(
        ValueError,
        match=rf"{name} of expert {index[0]} \({shard}\) "
        "is nan",
    ):
        _prepare(layer)
    for n, p in layer.named_parameters():
        assert torch.equal(bytes_of(p), before[n]), n


def test_the_w4a16_gate_adds_the_prepared_call_to_the_b12x_gate(monkeypatch):
    # On a b12x device the W4A16 mode is supported only where FlashInfer runs
    # prepared weights (no copying fallback); off one, the b12x reason.
    from vllm.model_executor.layers.fused_moe.experts import flashinfer_b12x_moe as m
    from vllm.model_executor.layers.fused_moe.experts.flashinfer_b12x_call import (
        Support,
    )
    from vllm.model_executor.layers.fused_moe.modular_kernel import (
        FusedMoEActivationFormat,
    )
    from vllm.model_executor.layers.quantization.utils.quant_utils import (
        kNvfp4Dynamic,
        kNvfp4Static,
    )

    cls = m.FlashInferB12xExperts
    moe = _w4a16_layer(2, 128, 64, True).moe_config

    def supported(activation_key):
        return cls.is_supported_config(
            cls, moe, kNvfp4Static, activation_key, FusedMoEActivationFormat.Standard
        )

    monkeypatch.setattr(cls, "_supports_current_device", staticmethod(lambda: True))
    monkeypatch.setattr(
        m, "flashinfer_w4a16_prepared_call", lambda: Support.no("no _prepared_weights")
    )
    assert supported(None) == (False, "no _prepared_weights")
    assert supported(kNvfp4Dynamic) == (True, None)  # W4A4 does not need it
    monkeypatch.setattr(m, "flashinfer_w4a16_prepared_call", Support.yes)
    assert supported(None) == (True, None)
    monkeypatch.setattr(cls, "_supports_current_device", staticmethod(lambda: False))
    monkeypatch.setattr(
        m, "is_flashinfer_b12x_moe_available", lambda: Support.no("not SM12x")
    )
    ok, reason = supported(None)
    assert not ok and reason.endswith("not SM12x")
