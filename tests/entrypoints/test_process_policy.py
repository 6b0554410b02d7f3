# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The commands' process-wide policy around a weight preparation
(``vllm.entrypoints.process_policy``): one intra-op thread on CPU, restored
after; Ctrl-C held to the end of the block, never lost, never where SIGINT
is ignored."""

import os
import signal
import threading

import pytest
import torch

from tests.sigint import sigint_raises_keyboard_interrupt
from vllm.entrypoints.process_policy import (
    PREP_CPU_THREADS,
    deferred_sigint,
    intra_op_threads,
    preparing_weights,
)


@pytest.mark.parametrize(
    "device, threads, inside",
    [("cpu", PREP_CPU_THREADS, 1), ("cpu", 0, 2), ("cpu", 3, 3), ("meta", 1, 2)],
    ids=["cpu-default", "cpu-torch-setting", "cpu-3", "not-a-cpu"],
)
def test_preparing_weights_sets_the_threads_and_restores_them(
    two_threads, device, threads, inside
):
    with preparing_weights(device, threads):
        assert torch.get_num_threads() == inside
    assert torch.get_num_threads() == 2


def test_the_thread_setting_is_restored_after_an_exception(two_threads):
    with pytest.raises(KeyError), intra_op_threads(1):
        assert torch.get_num_threads() == 1
        raise KeyError
    assert torch.get_num_threads() == 2


@pytest.mark.parametrize("bad", [-1, 1.5, True, "2"])
def test_a_bad_thread_count_is_refused(bad):
    with pytest.raises(ValueError, match="intra-op threads"), intra_op_threads(bad):
        pass


def test_a_held_back_sigint_is_raised_when_the_block_ends():
    reached = []
    with sigint_raises_keyboard_interrupt():
        with pytest.raises(KeyboardInterrupt), deferred_sigint():
            os.kill(os.getpid(), signal.SIGINT)
            reached.append("after the signal")  # the block runs on
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
        with deferred_sigint():  # control: no signal, no KeyboardInterrupt
            pass
    assert reached == ["after the signal"]


def test_an_ignored_sigint_stays_ignored():
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        with deferred_sigint():
            assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
            os.kill(os.getpid(), signal.SIGINT)  # ignored: nothing raised
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, previous)


def test_outside_the_main_thread_nothing_is_changed():
    seen = []

    def run():
        with deferred_sigint():
            seen.append(signal.getsignal(signal.SIGINT))

    with sigint_raises_keyboard_interrupt():
        t = threading.Thread(target=run)
        t.start()
        t.join()
    assert seen == [signal.default_int_handler]
