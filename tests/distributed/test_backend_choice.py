# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The distributed backend follows the device the ranks compute on, not the
host's hardware: ``--device cpu --tp N`` on a GPU host runs on gloo."""

import pytest
import torch
import torch.distributed as dist

from vllm.distributed import parallel_state as ps


@pytest.mark.parametrize(
    "device,backend",
    [
        ("cpu", "gloo"),
        ("cuda", "nccl"),
        ("cuda:1", "nccl"),
        (torch.device("cpu"), "gloo"),
        ("meta", "gloo"),
    ],
    ids=str,
)
def test_backend_for_device(device, backend, monkeypatch):
    # Whatever CUDA's presence: the answer depends on the device only.
    for present in (True, False):
        monkeypatch.setattr(torch.cuda, "is_available", lambda p=present: p)
        assert ps.backend_for_device(device) == backend


@pytest.mark.parametrize("device", ["cpu", None], ids=["cpu", "default"])
def test_cpu_job_on_a_cuda_host_uses_gloo(tmp_path, monkeypatch, device):
    # A GPU host as far as torch can tell; the ranks compute on the CPU.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    assert not dist.is_initialized()
    try:
        ps.init_distributed_environment(
            world_size=1,
            rank=0,
            device=device,
            distributed_init_method=f"file://{tmp_path / 'store'}",
        )
        assert dist.get_backend() == "gloo"
        assert ps.get_world_group().backend == "gloo"
        ps.initialize_model_parallel(1)
        assert ps.get_tp_group().backend == "gloo"
        x = torch.ones(3)
        assert torch.equal(ps.get_tp_group().all_reduce(x), torch.ones(3))
    finally:
        ps.destroy_distributed_environment()
    assert not dist.is_initialized()
