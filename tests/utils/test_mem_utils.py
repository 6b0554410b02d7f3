# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The peak-memory meter reads what torch allocates, on CPU and CUDA."""

import gc

import pytest
import torch

from tests.kernels.utils import DEVICES
from vllm.utils.mem_utils import CUDA_ALLOCATION_ROUNDING, measure_peak_memory

MIB = 1 << 20


@pytest.mark.parametrize("device", DEVICES)
def test_clone_reads_its_size(device):
    x = torch.zeros(3 * MIB, dtype=torch.uint8, device=device)
    with measure_peak_memory(device) as mem:
        y = x.clone()
    assert mem.peak_bytes == 3 * MIB
    assert mem.net_bytes == 3 * MIB
    del y


@pytest.mark.parametrize("device", DEVICES)
def test_allocate_free_allocate_reads_the_max_not_the_sum(device):
    with measure_peak_memory(device) as mem:
        a = torch.empty(2 * MIB, dtype=torch.uint8, device=device)
        del a
        b = torch.empty(5 * MIB, dtype=torch.uint8, device=device)
        del b
        c = torch.empty(MIB, dtype=torch.uint8, device=device)
        del c
    assert mem.peak_bytes == 5 * MIB
    assert mem.net_bytes == 0


@pytest.mark.parametrize("device", DEVICES)
def test_live_together_reads_the_sum(device):
    with measure_peak_memory(device) as mem:
        a = torch.empty(2 * MIB, dtype=torch.uint8, device=device)
        b = torch.empty(3 * MIB, dtype=torch.uint8, device=device)
        del a, b
    assert mem.peak_bytes == 5 * MIB


@pytest.mark.parametrize("device", DEVICES)
def test_freeing_preexisting_memory(device):
    x = torch.empty(4 * MIB, dtype=torch.uint8, device=device)
    with measure_peak_memory(device) as mem:
        del x
        y = torch.empty(MIB, dtype=torch.uint8, device=device)
        z = torch.empty(4 * MIB, dtype=torch.uint8, device=device)
    if device == "cuda":
        # Level above the start: the 4 MiB freed offsets what came after.
        assert (mem.peak_bytes, mem.net_bytes) == (MIB, MIB)
    else:
        # The CPU allocator reports frees only of what it saw allocated: the
        # block's own allocations are counted, a conservative upper bound.
        assert (mem.peak_bytes, mem.net_bytes) == (5 * MIB, 5 * MIB)
    del y, z


def test_cpu_timeline_is_ordered():
    with measure_peak_memory("cpu") as mem:
        a = torch.empty(MIB, dtype=torch.uint8)
        b = torch.empty(2 * MIB, dtype=torch.uint8)
        del a, b
    assert [level for _, level in mem.timeline] == [MIB, 3 * MIB, 2 * MIB, 0]
    assert mem.peak_mib == 3.0


def test_errors_in_the_block_propagate_and_stop_the_profiler():
    with pytest.raises(RuntimeError, match="boom"), measure_peak_memory("cpu"):
        raise RuntimeError("boom")
    with measure_peak_memory("cpu") as mem:
        z = torch.empty(MIB, dtype=torch.uint8)
    assert mem.peak_bytes == MIB
    del z


def test_unsupported_device():
    with pytest.raises(ValueError, match="cpu and cuda"), measure_peak_memory("meta"):
        pass


def test_cpu_figure_does_not_depend_on_the_garbage_collector():
    # Cyclic garbage holding a tensor allocated in an earlier measured block:
    # collected in the middle of the next block (here explicitly, as the
    # automatic collector may), its free is reported by torch; counted, it
    # would drop the figure (to -3 MiB net). Only the block's own allocations
    # are matched with frees.
    class Box:
        pass

    with measure_peak_memory("cpu"):
        t = torch.empty(4 * MIB, dtype=torch.uint8)
    gc.disable()  # keep the cycle alive until the next block starts
    try:
        box = Box()
        box.self, box.t = box, t
        del t, box
    finally:
        gc.enable()
    with measure_peak_memory("cpu") as mem:
        y = torch.empty(MIB, dtype=torch.uint8)
        gc.collect()
    assert (mem.peak_bytes, mem.net_bytes) == (MIB, MIB)
    assert gc.isenabled()
    del y


def test_frees_are_matched_to_the_blocks_own_allocations():
    # torch's CPU size table can keep a stale entry for an address freed while
    # no profiler ran; a later free of an older tensor at that address is then
    # reported with the stale size (the flaky (0, -11 MiB) readings of
    # test_freeing_preexisting_memory). Such a free matches no allocation of
    # the block and is ignored; a free of the block's own allocation counts
    # the size it was allocated with.
    from vllm.utils.mem_utils import _own_allocation_levels

    events = [
        (1, MIB, 0xA),
        (2, -16 * MIB, 0xDEAD),
        (3, 4 * MIB, 0xB),
        (4, -MIB, 0xA),
        (5, -4 * MIB, 0xB),
    ]
    assert _own_allocation_levels(events) == [
        (1, MIB),
        (3, 5 * MIB),
        (4, 4 * MIB),
        (5, 0),
    ]


def test_cpu_meter_simulates_the_cuda_allocators_rounding():
    # Each block counts rounded up to 512 B, as torch.cuda.memory_allocated
    # counts it: 100 B -> 512, 1000 B -> 1024, 512 B -> 512; two live
    # 100-byte blocks -> 1024.
    for nbytes, want in ((100, 512), (1000, 1024), (512, 512), (1 << 20, 1 << 20)):
        with measure_peak_memory("cpu", round_to=CUDA_ALLOCATION_ROUNDING) as mem:
            torch.empty(nbytes, dtype=torch.uint8)
        assert mem.peak_bytes == want, (nbytes, mem.peak_bytes)
    with measure_peak_memory("cpu", round_to=512) as mem:
        a = torch.empty(100, dtype=torch.uint8)
        b = torch.empty(100, dtype=torch.uint8)
        del a, b
    assert mem.peak_bytes == 1024
    # Control: without rounding the same blocks read their own sizes.
    with measure_peak_memory("cpu") as mem:
        torch.empty(100, dtype=torch.uint8)
    assert mem.peak_bytes == 100
    for bad in (0, -512, 1.5, True):
        with (
            pytest.raises(ValueError, match="round_to"),
            measure_peak_memory("cpu", round_to=bad),
        ):
            pass
