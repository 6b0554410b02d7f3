# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Tensor and expert parallelism across real processes (gloo on CPU).

Each worker is a spawned process in a 2-rank tensor-parallel group; it
loads its own shard of one checkpoint written in ``tmp_path``, prepares it
and runs ``forward`` with ``reduce_results=True``. Every rank's output must
equal the single-process layer's output on the same checkpoint.

Tolerance: every rank's partial output is rounded to BF16 and the
all-reduced sum once more, where the single process rounds its sum once.
One BF16 rounding leaves a uniform error of at most half an ulp, the ulp
being 2^-7 of the value's binade: an RMS of 2^-7 / sqrt(12) ~ 0.0023 of the
binade's base, ~0.0016 of values spread over it. With two partials of about
1 / sqrt(2) of the total each, three roundings: sqrt(1/2 + 1/2 + 1) *
0.0016 ~ 0.0023 relative RMS (measured 0.0024-0.0030: partials that cancel
are larger). Everything else (codes, block scales, the FP4 quantization of
activations: TP slices of I start at multiples of 16) is identical.
Tolerance 0.006. Negative control: both ranks load rank 0's shard, so the
sum double-counts it and misses the other: measured 1.00-1.03.
"""

import pytest
import torch

from tests.kernels.moe.utils import rel_rms_error
from vllm.distributed import (
    destroy_model_parallel,
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_world_size,
    init_distributed_environment,
    initialize_model_parallel,
    tensor_model_parallel_all_reduce,
)
from vllm.distributed.launcher import WorkerError, spawn_workers
from vllm.model_executor.layers.fused_moe.layer import FusedMoE
from vllm.model_executor.layers.quantization.modelopt import ModelOptNvFp4Config
from vllm.model_executor.model_loader.nvfp4_checkpoint_writer import (
    main as write_example,
)
from vllm.model_executor.model_loader.nvfp4_moe_checkpoint import NVFP4MoECheckpoint

TOL = 0.006
E, H, I_SIZE = 8, 256, 256


def _layer(ckpt, top_k, **parallel):
    return FusedMoE(
        num_experts=ckpt.num_experts,
        top_k=top_k,
        hidden_size=ckpt.hidden_size,
        intermediate_size=ckpt.intermediate_size,
        activation=ckpt.activation,
        quant_config=ModelOptNvFp4Config.for_mode(),
        moe_backend="flashinfer_b12x_emulated",
        **parallel,
    )


def _run(ckpt, x, logits, top_k, **parallel):
    layer = _layer(ckpt, top_k, **parallel)
    ckpt.load_layer(layer, ckpt.moe_layers[0])
    layer.quant_method.process_weights_after_loading(layer)
    return layer, layer(x, logits)


# (name, top_k, FusedMoE parallel arguments, is a negative control)
SCENARIOS = [
    ("tp2", 2, {"reduce_results": True}, False),
    ("ep2", 2, {"enable_expert_parallel": True, "reduce_results": True}, False),
    # top-4 of 8 experts: every token's experts span both ranks.
    ("ep2_top4", 4, {"enable_expert_parallel": True, "reduce_results": True}, False),
    # Negative controls: both ranks hold rank 0's shard. The layer refuses to
    # reduce that (test_ranks_that_disagree_are_refused_on_every_rank), so
    # the worker sums the partials itself.
    ("tp2_both_load_rank0", 2, {"tp_rank": 0, "tp_size": 2}, True),
    (
        "ep2_both_load_rank0",
        2,
        {"tp_rank": 0, "tp_size": 1, "ep_rank": 0, "ep_size": 2},
        True,
    ),
]


def _worker(rank, ckpt_dir, x, logits):
    assert get_tensor_model_parallel_rank() == rank
    assert get_tensor_model_parallel_world_size() == 2
    ckpt = NVFP4MoECheckpoint(ckpt_dir)
    out = {}
    for name, top_k, parallel, negative in SCENARIOS:
        layer, y = _run(ckpt, x, logits, top_k, **parallel)
        if negative:
            y = tensor_model_parallel_all_reduce(y)
        out[name] = {
            "y": y,
            "w13_rows": layer.w13_weight.shape[1],
            "local_experts": layer.local_num_experts,
            "owned": [layer.map_global_expert(e) for e in range(E)],
        }
    # The collective itself: every rank gets the sum.
    out["all_reduce"] = tensor_model_parallel_all_reduce(torch.tensor([rank + 1.0]))
    return out


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("ckpt") / "moe"
    write_example(
        [
            str(path),
            "--num-layers",
            "1",
            "--num-experts",
            str(E),
            "--top-k",
            "2",
            "--hidden-size",
            str(H),
            "--intermediate-size",
            str(I_SIZE),
        ]
    )
    return path


@pytest.fixture(scope="module")
def two_ranks(checkpoint):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(16, H, generator=gen).bfloat16()
    logits = torch.randn(16, E, generator=gen)
    ckpt = NVFP4MoECheckpoint(checkpoint)
    reference = {k: _run(ckpt, x, logits, k)[1] for k in (2, 4)}
    results = spawn_workers(
        _worker, 2, args=(str(checkpoint), x, logits), timeout_s=600, deadline_s=600
    )
    return results, reference


@pytest.mark.slow  # two spawned ranks
@pytest.mark.parametrize("scenario", SCENARIOS, ids=[s[0] for s in SCENARIOS])
def test_every_rank_returns_the_single_process_output(two_ranks, scenario):
    results, reference = two_ranks
    name, top_k, _, negative = scenario
    for rank, result in enumerate(results):
        err = rel_rms_error(result[name]["y"], reference[top_k])
        if negative:
            assert err > 50 * TOL, f"rank {rank}: {name} {err:.4f}"
        else:
            assert err < TOL, f"rank {rank}: {name} {err:.4f}"
    if not negative:  # the all-reduce gives both ranks the same bytes
        assert torch.equal(results[0][name]["y"], results[1][name]["y"])


@pytest.mark.slow  # two spawned ranks
def test_each_rank_holds_its_shard_and_the_collective_sums(two_ranks):
    results, _ = two_ranks
    for rank, result in enumerate(results):
        assert result["all_reduce"].item() == 3.0  # 1 + 2
        # TP: half of I per rank (w13 rows 2 * I / 2), all experts.
        assert result["tp2"]["w13_rows"] == I_SIZE
        assert result["tp2"]["local_experts"] == E
        # EP: whole I, half of the experts: rank r owns [4r, 4r + 4).
        assert result["ep2"]["w13_rows"] == 2 * I_SIZE
        owned = result["ep2"]["owned"]
        assert owned == [e - 4 * rank if e // 4 == rank else None for e in range(E)]


def _broken_shard(rank):
    """The error rank 1 raises; it carries the moment it was raised (the
    wall clock every process shares), so a test can time the job's end
    from the failure itself, not from the spawn (seconds of starting
    processes and importing torch on a loaded machine)."""
    import time

    return ValueError(f"checkpoint shard of rank {rank} is broken at {time.time()}")


def _seconds_since_the_failure(error: WorkerError) -> float:
    import time

    return time.time() - float(error.message.rsplit(" at ", 1)[1])


def _fail_on_rank_1(rank):
    if rank == 1:
        raise _broken_shard(rank)
    # Rank 0 waits in a collective for a rank that will never come.
    tensor_model_parallel_all_reduce(torch.ones(1))
    return "unreachable"


@pytest.mark.slow  # two spawned ranks
def test_a_failing_rank_ends_the_job_with_its_error():
    import multiprocessing

    with pytest.raises(WorkerError, match="rank 1: ValueError: checkpoint shard") as e:
        spawn_workers(_fail_on_rank_1, 2, timeout_s=120, deadline_s=120)
    # Ended from the failure on, well before the collective's 120 s timeout
    # that rank 0 is waiting in.
    assert _seconds_since_the_failure(e.value) < 60
    assert multiprocessing.active_children() == []


def _finish_on_rank_0(rank):
    if rank == 1:
        raise _broken_shard(rank)
    return "done"  # then waits in the launcher's barrier for rank 1


@pytest.mark.slow  # two spawned ranks
def test_a_rank_that_finished_does_not_hide_a_failing_one():
    import multiprocessing

    with pytest.raises(WorkerError, match="rank 1: ValueError: checkpoint shard") as e:
        spawn_workers(_finish_on_rank_0, 2, timeout_s=120, deadline_s=120)
    assert _seconds_since_the_failure(e.value) < 60  # not the barrier's timeout
    assert multiprocessing.active_children() == []


def _wait_for(path, what: str) -> None:
    """Poll until ``path`` exists (another rank's signal), bounded far above
    any machine's load: an event, not a guess at how long the other takes."""
    import os
    import time

    deadline = time.monotonic() + 300
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} never happened")
        time.sleep(0.01)


def _record_teardown(rank, out_dir):
    import time
    from pathlib import Path

    from vllm.distributed import parallel_state as ps

    real = ps.destroy_distributed_environment

    def recorded():
        Path(out_dir, f"teardown{rank}").write_text(repr(time.time()))
        real()

    ps.destroy_distributed_environment = recorded
    returned = time.time()
    if rank == 0:
        Path(out_dir, "returned0").touch()
    else:
        # Rank 1 finishes after rank 0 has: it waits for rank 0's return,
        # then a little more (rank 0 is then waiting to tear down).
        _wait_for(Path(out_dir, "returned0"), "rank 0's return")
        time.sleep(0.5)
        returned = time.time()
    return returned


@pytest.mark.slow  # two spawned ranks
@pytest.mark.parametrize("tp_size", [None, 1], ids=["tp2", "tp1_of_world2"])
def test_a_rank_tears_down_only_after_every_rank_finished(tmp_path, tp_size):
    # A rank tearing its groups down while a peer still finishes the last
    # collective made that peer fail ("Connection closed by peer", twice in
    # about 30 runs of test_ranks_that_disagree_are_refused_on_every_rank).
    returned = spawn_workers(
        _record_teardown,
        2,
        args=(str(tmp_path),),
        tp_size=tp_size,
        timeout_s=120,
        deadline_s=120,
    )
    fast_teardown = float((tmp_path / "teardown0").read_text())
    assert fast_teardown >= returned[1] > returned[0]


def _fail_late_on_rank_1(rank, out_dir):
    import time
    from pathlib import Path

    if rank == 1:
        # Fails after rank 0 has finished (then rank 0 is waiting for it).
        _wait_for(Path(out_dir, "done0"), "rank 0's return")
        time.sleep(0.3)
        raise ValueError("checkpoint shard of rank 1 is broken")
    Path(out_dir, "done0").touch()
    return "done"  # rank 0 then waits for rank 1 before its teardown


@pytest.mark.slow  # two spawned ranks
def test_the_failing_rank_is_blamed_when_the_parent_reads_late(monkeypatch, tmp_path):
    # The parent reads both pipes at once (it was busy): rank 0, which
    # finished, must not be blamed for the error its wait for rank 1 met.
    import multiprocessing.connection
    import time

    real_wait = multiprocessing.connection.wait

    def late_wait(*args, **kwargs):
        time.sleep(1.0)
        return real_wait(*args, **kwargs)

    monkeypatch.setattr(multiprocessing.connection, "wait", late_wait)
    with pytest.raises(WorkerError, match="rank 1: ValueError: checkpoint shard"):
        spawn_workers(
            _fail_late_on_rank_1,
            2,
            args=(str(tmp_path),),
            timeout_s=120,
            deadline_s=600,
        )


def _stuck_on_rank_1(rank):
    import time

    if rank == 1:
        time.sleep(60)
    return "done"


@pytest.mark.slow  # two spawned ranks
def test_a_deadline_blames_the_rank_that_did_not_finish():
    # The deadline counts from each rank's joining the group: spawning the
    # ranks and importing torch (3.1 s at load 3.5 on 2 cores, when it was
    # counted) are not part of it, so 4 s holds on a loaded machine too.
    with pytest.raises(
        WorkerError, match="rank 1: no result 4 s after joining the group"
    ):
        spawn_workers(_stuck_on_rank_1, 2, timeout_s=120, deadline_s=4)


class _Started:
    """What ``_collect`` asks of a worker process."""

    exitcode = None

    def join(self, timeout=None):
        pass


def test_the_deadline_counts_from_the_ranks_ready_message():
    # No processes: two pipes stand for two ranks. Both say "ready" only
    # after 3 deadlines have passed (a slow start: spawning, importing
    # torch), rank 0 then answers at once and rank 1 never: rank 1 alone is
    # blamed, and only a deadline after its "ready". Each wait here is a
    # lower bound, so a loaded machine cannot make it fail.
    import multiprocessing
    import pickle
    import threading
    import time

    from vllm.distributed.launcher import _collect

    deadline_s = 0.3
    pipes = [multiprocessing.Pipe(duplex=False) for _ in range(2)]
    sent: dict[str, float] = {}

    def ranks():
        time.sleep(3 * deadline_s)
        sent["ready"] = time.monotonic()  # before: the parent reads it after
        for _, send in pipes:
            send.send_bytes(pickle.dumps(("ready", None)))
        pipes[0][1].send_bytes(pickle.dumps(("ok", "done")))

    thread = threading.Thread(target=ranks, daemon=True)
    start = time.monotonic()
    thread.start()
    with pytest.raises(WorkerError, match="rank 1: no result 0.3 s after joining"):
        _collect([_Started(), _Started()], [recv for recv, _ in pipes], deadline_s)
    thread.join()
    assert time.monotonic() - sent["ready"] >= deadline_s
    assert sent["ready"] - start >= 3 * deadline_s  # longer than the deadline
    for recv, send in pipes:
        recv.close()
        send.close()


# --- without processes: ownership on every rank, the reader with EP ---------


@pytest.mark.parametrize("ep_size", [2, 4, 8])
def test_expert_ownership_on_every_rank(checkpoint, ep_size):
    ckpt = NVFP4MoECheckpoint(checkpoint)
    per = E // ep_size
    owners = {e: [] for e in range(E)}
    for rank in range(ep_size):
        layer = _layer(ckpt, 2, ep_rank=rank, ep_size=ep_size)
        assert layer.local_num_experts == per
        for e in range(E):
            local = layer.map_global_expert(e)
            if local is not None:
                owners[e].append((rank, local))
        with pytest.raises(ValueError, match="out of range"):
            layer.map_global_expert(E)
        with pytest.raises(ValueError, match="out of range"):
            layer.map_global_expert(-1)
    # Every expert has exactly one owner: rank e // per, at index e % per
    # (rank 0 owns expert 0, the last rank the last expert).
    assert owners == {e: [(e // per, e % per)] for e in range(E)}


def test_reader_loads_each_ranks_experts_with_expert_parallelism(checkpoint):
    ckpt = NVFP4MoECheckpoint(checkpoint)
    full = _layer(ckpt, 2)
    ckpt.load_layer(full, ckpt.moe_layers[0])
    names = [n for n, _ in full.named_parameters()]
    for ep_size in (2, 4):
        per = E // ep_size
        for rank in range(ep_size):
            layer = _layer(ckpt, 2, ep_rank=rank, ep_size=ep_size)
            ckpt.load_layer(layer, ckpt.moe_layers[0])
            for name in names:
                got = getattr(layer, name).data
                want = getattr(full, name).data[rank * per : (rank + 1) * per]
                assert torch.equal(
                    got.view(torch.uint8) if got.dtype.itemsize == 1 else got,
                    want.view(torch.uint8) if want.dtype.itemsize == 1 else want,
                ), f"ep {ep_size} rank {rank}: {name}"
            # An expert of another rank is not loaded (weight_loader says so).
            other = ((rank + 1) % ep_size) * per
            assert not layer.weight_loader(
                layer.w2_input_scale, torch.ones(()), "x", "w2", other
            )


def test_parallel_arguments_are_checked():
    ckpt_args = dict(
        num_experts=E,
        top_k=2,
        hidden_size=H,
        intermediate_size=I_SIZE,
        quant_config=ModelOptNvFp4Config.for_mode(),
        moe_backend="flashinfer_b12x_emulated",
    )
    with pytest.raises(ValueError, match="tp_rank and tp_size together"):
        FusedMoE(**ckpt_args, tp_size=2)
    with pytest.raises(ValueError, match="do not also give ep_rank"):
        FusedMoE(**ckpt_args, enable_expert_parallel=True, ep_rank=0, ep_size=2)
    # reduce_results on a split layer needs the group (none in this process).
    with pytest.raises(ValueError, match="initialize_model_parallel"):
        FusedMoE(**ckpt_args, tp_rank=0, tp_size=2, reduce_results=True)
    # Without a group: a single process, nothing to reduce.
    layer = FusedMoE(**ckpt_args, reduce_results=True, enable_expert_parallel=True)
    assert (layer.moe_config.tp_size, layer.ep_size) == (1, 1)


# --- ranks that disagree, groups smaller than the world -------------------------


def _disagreeing_worker(rank, ckpt_dir, x, logits):
    ckpt = NVFP4MoECheckpoint(ckpt_dir)
    out = {}

    def error_of(fn):
        try:
            fn()
        except ValueError as e:
            return str(e)
        return "no error"

    # Expert parallelism on rank 0 only: both layers are split two ways.
    out["ep_on_rank0"] = error_of(
        lambda: _run(
            ckpt, x, logits, 2, enable_expert_parallel=rank == 0, reduce_results=True
        )
    )
    # Both ranks take tensor-parallel rank 0's shard.
    out["same_shard"] = error_of(
        lambda: _run(ckpt, x, logits, 2, tp_rank=0, tp_size=2, reduce_results=True)
    )
    # The agreeing layer still runs after the refusals (collectives in step).
    out["agree"] = _run(ckpt, x, logits, 2, reduce_results=True)[1]
    # A tensor-parallel group of one in a world of two: no reduction.
    destroy_model_parallel()
    initialize_model_parallel(1)
    out["tp1_group"] = (
        get_tensor_model_parallel_rank(),
        get_tensor_model_parallel_world_size(),
    )
    layer, out["tp1"] = _run(ckpt, x, logits, 2, reduce_results=True)
    out["tp1_split"] = (layer.moe_config.tp_size, layer.ep_size)
    destroy_model_parallel()
    out["init"] = error_of(lambda: initialize_model_parallel(2 if rank == 0 else 1))
    initialize_model_parallel(2)  # the launcher's group back, for its teardown
    return out


def test_ranks_that_disagree_are_refused_on_every_rank(checkpoint):
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(8, H, generator=gen).bfloat16()
    logits = torch.randn(8, E, generator=gen)
    reference = _run(NVFP4MoECheckpoint(checkpoint), x, logits, 2)[1]
    results = spawn_workers(
        _disagreeing_worker,
        2,
        args=(str(checkpoint), x, logits),
        timeout_s=600,
        deadline_s=600,
    )
    for rank, out in enumerate(results):
        assert (
            "enable_expert_parallel: rank 0 has 1, rank 1 has 0" in out["ep_on_rank0"]
        ), (rank, out["ep_on_rank0"])
        assert (
            "two ranks hold the same shard (ep_rank/tp_rank: rank 0 has (0, 0), "
            "rank 1 has (0, 0))"
        ) in out["same_shard"], (rank, out["same_shard"])
        assert rel_rms_error(out["agree"], reference) < TOL
        assert out["tp1_group"] == (0, 1)
        assert out["tp1_split"] == (1, 1)
        assert torch.equal(out["tp1"], reference)  # whole layer on each rank
        assert (
            "ranks disagree on tensor_model_parallel_size: rank 0 has 2, rank 1 "
            "has 1" in out["init"]
        ), (rank, out["init"])


@pytest.mark.parametrize("world_size, rank", [(2, 2), (2, -2), (2, 5), (-3, 0), (0, 0)])
def test_out_of_range_rank_at_init_is_refused(world_size, rank):
    with pytest.raises(ValueError, match="rank|world_size"):
        init_distributed_environment(
            world_size=world_size, rank=rank, distributed_init_method="tcp://x:1"
        )
    import torch.distributed as dist

    assert not dist.is_initialized()
