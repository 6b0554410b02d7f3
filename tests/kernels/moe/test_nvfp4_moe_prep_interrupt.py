# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Ctrl-C during the bounded NVFP4 MoE preparation: a KeyboardInterrupt
delivered after any torch call of a step (where Python delivers a SIGINT
that arrives during the call) leaves the layer re-runnable to the same
bytes; the library installs no handler; a command holding SIGINT back
(``vllm.entrypoints.process_policy``) gets it after the block."""

import os
import signal

import pytest
import torch
from torch.overrides import TorchFunctionMode

from tests.kernels.moe.test_nvfp4_moe_prep_state import (
    SHAPES,
    Interrupt,
    _assert_same,
    _layer,
    _load_through_loader,
    _prepare,
    _snapshot,
    _tensors,
)
from tests.kernels.moe.utils import split_cat_halves
from tests.sigint import sigint_raises_keyboard_interrupt
from vllm.entrypoints.process_policy import deferred_sigint
from vllm.model_executor.layers.quantization.utils.bounded_chunks import (
    ChunkProgress,
    run_chunks,
)
from vllm.model_executor.layers.quantization.utils.flashinfer_fp4_moe import (
    reorder_w1w3_to_w3w1,
)


class InterruptAfterCall(TorchFunctionMode):
    """Run the ``k``-th torch call (1-based), then raise KeyboardInterrupt:
    its bytes have landed, as when Ctrl-C arrives during the call. ``k=None``
    only counts calls."""

    def __init__(self, k: int | None = None):
        super().__init__()
        self.k, self.calls = k, 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.calls += 1
        if self.calls == self.k:
            raise KeyboardInterrupt(f"after call {self.k}: {func}")
        return out


def _calls(fn) -> int:
    with InterruptAfterCall() as counter:
        fn()
    return counter.calls


# (shape, layer kwargs): W4A4 in both global-scale modes, and W4A16 (whose
# w13 rows must be a multiple of 64).
LAYERS = [
    (SHAPES[0], {}),
    (SHAPES[1], {"global_scale_mode": "fold"}),
    (SHAPES[2], {"quant_mode": "w4a16"}),
]
LAYER_IDS = ["w4a4-alpha", "w4a4-fold-relu2", "w4a16"]


@pytest.mark.parametrize("shape, kwargs", LAYERS, ids=LAYER_IDS)
def test_keyboard_interrupt_after_any_call_resumes_to_the_same_bytes(shape, kwargs):
    # An in-place chunk whose write landed but was not yet counted would be
    # applied twice by the retry: silently wrong bytes, not an error.
    tensors = _tensors(*shape, seed=3)
    want = _snapshot(_prepare(_layer(shape, tensors, **kwargs)))
    layer = _layer(shape, tensors, **kwargs)
    n = _calls(lambda: _prepare(layer))
    for k in range(1, n + 1):
        layer = _layer(shape, tensors, **kwargs)
        with pytest.raises(KeyboardInterrupt), InterruptAfterCall(k):
            _prepare(layer)
        _prepare(layer)  # the retry
        _assert_same(_snapshot(layer), want)


@pytest.mark.parametrize("shape, kwargs", LAYERS[::2], ids=LAYER_IDS[::2])
def test_keyboard_interrupt_after_any_call_of_a_reload_then_retry(shape, kwargs):
    # The reload's restore runs the inverse steps in place: the same holds.
    old, new = _tensors(*shape, seed=3), _tensors(*shape, seed=4)
    want = _snapshot(_prepare(_layer(shape, new, **kwargs)))
    layer = _prepare(_layer(shape, old, **kwargs))
    n = _calls(lambda: _load_through_loader(layer, new))
    for k in range(1, n + 1, 2):
        layer = _prepare(_layer(shape, old, **kwargs))
        with pytest.raises(KeyboardInterrupt), InterruptAfterCall(k):
            _load_through_loader(layer, new)
        _load_through_loader(layer, new)
        _prepare(layer)
        _assert_same(_snapshot(layer), want)


class SigintAtCopy(TorchFunctionMode):
    """Send this process a real SIGINT right after the ``k``-th ``copy_``."""

    def __init__(self, k: int):
        super().__init__()
        self.k, self.calls = k, 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.calls += getattr(func, "__name__", "") == "copy_"
        if self.calls == self.k:
            os.kill(os.getpid(), signal.SIGINT)
        return out


# 8 chunks of w (rows of 256 bytes in 128-byte pieces) + 1 of s, 3 copies
# each: the signal arrives after every copy of every chunk.
_SIGINT_POSITIONS = range(1, 28)


def _swap_inputs(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    w = torch.randint(0, 256, (4, 8, 64), dtype=torch.uint8, generator=gen)
    s = torch.randint(0, 256, (4, 8, 8), dtype=torch.uint8, generator=gen)
    return w, s


def test_real_sigint_inside_a_chunk_leaves_it_untouched():
    # No handler of the library's own: Python's KeyboardInterrupt lands right
    # after a copy's write (the signal arrives inside the torch call), and
    # the chunk in flight is undone, never left half-swapped; the retry then
    # finishes the swap exactly, wherever the signal came.
    w, s = _swap_inputs(10)
    # Python's own SIGINT handler, as in a terminal: a background pytest
    # (nohup ... &) inherits SIGINT ignored, and the signal would do nothing.
    with sigint_raises_keyboard_interrupt():
        for k in _SIGINT_POSITIONS:
            wk, sk, progress = w.clone(), s.clone(), ChunkProgress()
            with pytest.raises(KeyboardInterrupt), SigintAtCopy(k):
                reorder_w1w3_to_w3w1(wk, sk, max_transient_bytes=128, progress=progress)
            assert progress.done == (k - 1) // 3, k  # the chunk in flight undone
            reorder_w1w3_to_w3w1(wk, sk, max_transient_bytes=128, progress=progress)
            assert torch.equal(wk, split_cat_halves(w, -2)), k
            assert torch.equal(sk, split_cat_halves(s, -2)), k
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_sigint_held_back_by_the_command_lands_after_the_preparation():
    # A command's policy (vllm.entrypoints.process_policy): Ctrl-C waits for
    # the end of the block, so the call completes and nothing is resumed.
    w, s = _swap_inputs(10)
    with sigint_raises_keyboard_interrupt():
        for k in _SIGINT_POSITIONS:
            wk, sk, progress = w.clone(), s.clone(), ChunkProgress()
            with pytest.raises(KeyboardInterrupt), deferred_sigint(), SigintAtCopy(k):
                reorder_w1w3_to_w3w1(wk, sk, max_transient_bytes=128, progress=progress)
            assert progress.complete, k
            assert torch.equal(wk, split_cat_halves(w, -2)), k
            assert torch.equal(sk, split_cat_halves(s, -2)), k
            assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


class SigintThenRaise(TorchFunctionMode):
    """A real SIGINT after the first ``copy_``, then ``Interrupt`` instead of
    the second: both arrive inside the same chunk."""

    def __init__(self):
        super().__init__()
        self.copies = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") == "copy_":
            self.copies += 1
            if self.copies == 2:
                raise Interrupt("second copy")
        out = func(*args, **(kwargs or {}))
        if self.copies == 1 and getattr(func, "__name__", "") == "copy_":
            os.kill(os.getpid(), signal.SIGINT)
        return out


def test_held_back_sigint_is_not_lost_when_another_exception_leaves():
    w = torch.arange(4 * 8 * 64, dtype=torch.int64).to(torch.uint8).view(4, 8, 64)
    s = torch.zeros(4, 8, 8, dtype=torch.uint8)
    wk = w.clone()
    # Python's own SIGINT handler, whatever pytest inherited (see above).
    with sigint_raises_keyboard_interrupt():
        with (
            pytest.raises(KeyboardInterrupt) as info,
            deferred_sigint(),
            SigintThenRaise(),
        ):
            reorder_w1w3_to_w3w1(wk, s.clone(), max_transient_bytes=128)
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    assert isinstance(info.value.__context__, Interrupt)
    assert torch.equal(wk, w)  # the chunk in flight was left untouched


def test_the_preparation_installs_no_signal_handler():
    # Signal handling is the process's: the library never replaces it.
    seen = []

    class RecordHandler(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            seen.append(signal.getsignal(signal.SIGINT))
            return func(*args, **(kwargs or {}))

    shape = SHAPES[0]
    layer = _layer(shape, _tensors(*shape, seed=1))
    with sigint_raises_keyboard_interrupt(), RecordHandler():
        _prepare(layer)
    assert seen and set(seen) == {signal.default_int_handler}


def test_a_write_interrupted_after_it_landed_is_counted_not_repeated():
    # In place, a chunk that adds 1 would be applied twice by a retry that
    # redid it: run_chunks runs its write again (from the buffer) and counts
    # it before the interrupt goes on.
    t = torch.zeros(4, dtype=torch.int64)
    buf = torch.empty(1, dtype=torch.int64)
    landed = []

    def chunk(idx):
        torch.add(t[idx : idx + 1], 1, out=buf)  # the read, into the buffer

        def write():
            t[idx : idx + 1].copy_(buf)
            if idx == 1 and not landed:
                landed.append(idx)
                raise KeyboardInterrupt  # after the bytes landed

        return write

    progress = ChunkProgress()
    with pytest.raises(KeyboardInterrupt):
        run_chunks(4, chunk, progress)
    assert progress.done == 2
    run_chunks(4, chunk, progress)
    assert t.tolist() == [1, 1, 1, 1]


def test_a_write_that_fails_twice_leaves_the_progress_torn():
    t = torch.zeros(2, dtype=torch.int64)

    def chunk(idx):
        def write():
            t[idx] = 7
            raise RuntimeError("device lost")

        return write

    progress = ChunkProgress()
    with pytest.raises(RuntimeError, match="device lost"):
        run_chunks(2, chunk, progress)
    assert progress.torn == 0 and progress.done == 0
    with pytest.raises(ValueError, match="chunk 0 half-written"):
        run_chunks(2, chunk, progress)
