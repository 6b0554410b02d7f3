# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The bounded, resumable W4A16 repack (flashinfer_w4a16_moe) against the
whole-tensor reference: the same bytes, round trips, the peak measured
within every cap, resumed after an interrupt at any chunk."""

import pytest
import torch

from tests.kernels.moe.nvfp4_w4a16_utils import (
    MiB,
    rand_scale,
    rand_weight,
)
from tests.kernels.moe.test_nvfp4_moe_prep_state import (
    Interrupt,
    RaiseAtCall,
)
from tests.kernels.utils import bytes_of
from vllm.model_executor.layers.quantization.utils.bounded_chunks import (
    ChunkProgress,
)
from vllm.model_executor.layers.quantization.utils.flashinfer_w4a16_layout import (
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
from vllm.utils.mem_utils import measure_peak_memory

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
    w = rand_weight(e, n, k, seed=n + rotate)
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
    s = rand_scale(e, n, k, seed=k + rotate)
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
    w, s = rand_weight(e, n, k, seed=rotate), rand_scale(e, n, k, seed=rotate + 1)
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
    w = rand_weight(e, n, k, seed=1)
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
    w = rand_weight(e, n, k, seed=cap % 1000)
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
    s = rand_scale(e, n, k, seed=cap % 1000, top=0x7E)
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
    w = rand_weight(1, 512, 4096, seed=2)
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
    w, s = rand_weight(e, n, k, seed=3), rand_scale(e, n, k, seed=4)
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
    w = rand_weight(e, n, k, seed=5)
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
