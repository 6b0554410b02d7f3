# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The NVFP4 checkpoint writer's output directory: a non-empty one is refused
unless overwritten on purpose, the checkpoint appears whole or not at all
(written beside it, renamed into place), files get the umask's modes, and
sizes too big for the memory are a one-line error before anything is
allocated."""

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from vllm.model_executor.model_loader import nvfp4_checkpoint_writer as writer
from vllm.model_executor.model_loader.nvfp4_checkpoint_writer import (
    main,
    random_bf16_experts,
    write_nvfp4_moe_checkpoint,
)
from vllm.model_executor.model_loader.nvfp4_moe_checkpoint import (
    COMPRESSED_TENSORS,
    MODELOPT,
    NVFP4MoECheckpoint,
)
from vllm.utils.mem_utils import measure_peak_memory

E, H, I = 4, 64, 32  # noqa: E741 (the facts file's names)
PROG = "python -m vllm.model_executor.model_loader.nvfp4_checkpoint_writer"
CONFIG = {
    "hidden_size": H,
    "num_experts": E,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": I,
    "num_hidden_layers": 2,
}


def _write(path, fmt=MODELOPT, seed=0, **kwargs):
    layers = {i: random_bf16_experts(E, H, I, True, seed=seed + i) for i in (0, 1)}
    return write_nvfp4_moe_checkpoint(
        path, layers, CONFIG, fmt=fmt, max_shard_bytes=8 << 10, **kwargs
    )


def _snapshot(path):
    return {p.name: p.read_bytes() for p in sorted(path.iterdir())}


def test_a_non_empty_directory_is_refused_unless_overwritten(tmp_path):
    out = tmp_path / "ckpt"
    _write(out, MODELOPT)
    before = _snapshot(out)
    # A compressed-tensors checkpoint over a ModelOpt one: its stale
    # hf_quant_config.json would make the reader take it for ModelOpt.
    with pytest.raises(
        ValueError,
        match=r"ckpt: directory is not empty "
        r"\(overwrite=True replaces it\)",
    ):
        _write(out, COMPRESSED_TENSORS)
    assert _snapshot(out) == before
    (out / "stale.safetensors").write_bytes(b"x")
    _write(out, COMPRESSED_TENSORS, overwrite=True)
    assert not (out / "hf_quant_config.json").exists()
    assert not (out / "stale.safetensors").exists()
    assert NVFP4MoECheckpoint(out).format == COMPRESSED_TENSORS
    assert os.listdir(tmp_path) == ["ckpt"]  # nothing left beside it


def test_an_empty_or_missing_directory_is_written(tmp_path):
    (tmp_path / "empty").mkdir()
    _write(tmp_path / "empty")
    _write(tmp_path / "a" / "b" / "new")
    for path in (tmp_path / "empty", tmp_path / "a" / "b" / "new"):
        assert NVFP4MoECheckpoint(path).moe_layers == [0, 1]
    with pytest.raises(ValueError, match="exists and is not a directory"):
        _write(tmp_path / "empty" / "config.json")


class _Interrupted(BaseException):
    pass


@pytest.mark.parametrize("existing", [False, True], ids=["new", "overwrite"])
@pytest.mark.parametrize("at_call", [1, 2])
def test_an_interrupted_write_leaves_nothing_half_written(
    tmp_path, monkeypatch, existing, at_call
):
    out = tmp_path / "ckpt"
    if existing:
        _write(out, seed=7)
    before = _snapshot(out) if existing else None
    real_save = writer.save_file
    calls = []

    def save_then_interrupt(*args, **kwargs):
        calls.append(1)
        if len(calls) == at_call:
            raise _Interrupted  # like Ctrl-C in the middle of the shards
        return real_save(*args, **kwargs)

    monkeypatch.setattr(writer, "save_file", save_then_interrupt)
    with pytest.raises(_Interrupted):
        _write(out, overwrite=True)
    if existing:
        assert _snapshot(out) == before  # the old checkpoint, whole
    else:
        assert not out.exists()
    assert os.listdir(tmp_path) == (["ckpt"] if existing else [])


@pytest.mark.parametrize("umask", [0o022, 0o027])
def test_files_get_the_umask_modes(tmp_path, umask):
    old = os.umask(umask)
    try:
        out = _write(tmp_path / "ckpt")
    finally:
        os.umask(old)
    assert out.stat().st_mode & 0o777 == 0o777 & ~umask
    files = list(out.iterdir())
    assert len(files) > 3
    for f in files:
        assert f.stat().st_mode & 0o777 == 0o666 & ~umask, f.name


# --- the command line ----------------------------------------------------------------


def _last_error_line(capsys):
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and err[0].startswith(f"{PROG}: error:"), err
    assert err[1] == f"Try '{PROG} --help' for more information.", err
    return err[0]


def test_cli_refuses_a_non_empty_directory_unless_overwrite(tmp_path, capsys):
    out = tmp_path / "ckpt"
    args = [
        str(out),
        "--num-layers",
        "1",
        "--num-experts",
        "4",
        "--top-k",
        "2",
        "--hidden-size",
        "64",
        "--intermediate-size",
        "32",
    ]
    main(args)
    with pytest.raises(SystemExit) as exit_info:
        main([*args, "--format", "compressed-tensors"])
    assert exit_info.value.code == 2
    assert "directory is not empty (--overwrite replaces it)" in _last_error_line(
        capsys
    )
    assert NVFP4MoECheckpoint(out).format == MODELOPT
    main([*args, "--format", "compressed-tensors", "--overwrite"])
    assert NVFP4MoECheckpoint(out).format == COMPRESSED_TENSORS


def test_cli_takes_no_abbreviations(tmp_path, capsys):
    # "--num-layer 1" was taken for --num-layers (argparse's abbreviations).
    with pytest.raises(SystemExit) as exit_info:
        main([str(tmp_path / "ckpt"), "--num-layer", "1"])
    assert exit_info.value.code == 2
    assert "unrecognized arguments: --num-layer 1" in _last_error_line(capsys)
    assert not (tmp_path / "ckpt").exists()


def test_cli_sizes_beyond_the_memory_are_refused_before_allocating(tmp_path, capsys):
    with measure_peak_memory("cpu") as mem, pytest.raises(SystemExit) as exit_info:
        main([str(tmp_path / "ckpt"), "--num-experts", "100000"])
    assert exit_info.value.code == 2
    line = _last_error_line(capsys)
    assert "--num-experts 100000" in line and "GiB of memory to write" in line
    assert mem.peak_bytes < 1 << 20
    assert os.listdir(tmp_path) == []


def test_cli_under_an_address_space_limit_is_a_one_line_error(tmp_path):
    # 2000 experts of 1024 x 256: about 16 GiB to write, which the machine
    # may have; under `ulimit -v` of 2 GiB more than the process uses it must
    # be refused in one line (before: the allocator's traceback).
    script = textwrap.dedent(f"""
        import resource
        from vllm.model_executor.model_loader.nvfp4_checkpoint_writer import main
        with open("/proc/self/status") as f:
            vm = next(int(x.split()[1]) << 10 for x in f if x.startswith("VmSize"))
        resource.setrlimit(resource.RLIMIT_AS, (vm + (2 << 30), -1))
        main([{str(tmp_path / "ckpt")!r}, "--num-experts", "2000"])
    """)
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 2, lines  # the error and the --help hint
    assert lines[0].startswith(f"{PROG}: error: --num-layers 4, --num-experts 2000")
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "ckpt").exists()


def test_available_memory_is_bounded_by_the_address_space_limit():
    script = textwrap.dedent("""
        import json, resource
        from vllm.utils.mem_utils import available_memory_bytes
        free = available_memory_bytes()
        with open("/proc/self/status") as f:
            vm = next(int(x.split()[1]) << 10 for x in f if x.startswith("VmSize"))
        resource.setrlimit(resource.RLIMIT_AS, (vm + (1 << 30), -1))
        print(json.dumps([free, available_memory_bytes()]))
    """)
    out = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    ).stdout
    free, limited = json.loads(out)
    assert free > 0
    assert limited <= 1 << 30 and limited > (1 << 30) - (64 << 20)


# --- speed: experts quantized a few at a time, on one thread -----------------------


def _bytes(t):
    return t.reshape(-1).view(torch.uint8)


def _tensors(path):
    from safetensors.torch import load_file

    out = {}
    for f in sorted(path.glob("*.safetensors")):
        out.update(load_file(f))
    return out


@pytest.mark.parametrize("shared", [False, True], ids=["own", "shared_w13"])
@pytest.mark.parametrize("fmt", [MODELOPT, COMPRESSED_TENSORS])
def test_experts_quantized_together_are_each_expert_quantized_alone(
    tmp_path, monkeypatch, fmt, shared
):
    # The writer quantizes several experts per call (one global scale each);
    # the checkpoint must hold the bytes of quantizing every expert alone,
    # whatever the number per call: 1, 3 of 4 (a short last call), all.
    from vllm.model_executor.layers.quantization.utils.nvfp4_format import (
        nvfp4_global_scale,
        quantize_nvfp4,
    )

    written = {}
    for per_call in (1, 3, 4):
        monkeypatch.setattr(writer, "_WEIGHTS_PER_CALL", per_call * 2 * I * H)
        path = _write(tmp_path / f"c{per_call}", fmt, shared_w13_global_scale=shared)
        written[per_call] = _tensors(path)
    assert written[1].keys() == written[3].keys() == written[4].keys()
    for name in written[1]:
        for per_call in (3, 4):
            a, b = written[1][name], written[per_call][name]
            assert torch.equal(_bytes(a), _bytes(b)), name
    w13, w2 = random_bf16_experts(E, H, I, True, seed=1)  # layer 1
    weight = "weight" if fmt == MODELOPT else "weight_packed"
    for ex in (0, E - 1):
        projs = {"gate_proj": w13[ex, :I], "up_proj": w13[ex, I:], "down_proj": w2[ex]}
        for proj, w in projs.items():
            amax = w13[ex] if shared and proj != "down_proj" else w
            packed, scale = quantize_nvfp4(
                w, nvfp4_global_scale(amax.float().abs().amax())
            )
            base = f"model.layers.1.mlp.experts.{ex}.{proj}"
            assert torch.equal(written[3][f"{base}.{weight}"], packed)
            got = written[3][f"{base}.weight_scale"].view(torch.uint8)
            assert torch.equal(got, scale.view(torch.uint8))


def _threads_seen_by_quantize(monkeypatch, run) -> list[int]:
    seen = []
    real = writer.quantize_nvfp4

    def recording(*args, **kwargs):
        seen.append(torch.get_num_threads())
        return real(*args, **kwargs)

    monkeypatch.setattr(writer, "quantize_nvfp4", recording)
    previous = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        run()
        assert torch.get_num_threads() == 2  # restored
    finally:
        torch.set_num_threads(previous)
    return seen


def test_the_command_quantizes_on_one_thread_and_restores_the_setting(
    tmp_path, monkeypatch
):
    # Element-wise work on small tensors: with the other core of a 2-core
    # machine busy, one expert took 559 ms on two threads and 9.5 ms on one.
    # The thread count is the command's policy (it owns the process).
    argv = [str(tmp_path / "ckpt"), "--num-layers", "1", "--num-experts", "2"]
    argv += ["--hidden-size", "64", "--intermediate-size", "32", "--top-k", "1"]
    seen = _threads_seen_by_quantize(monkeypatch, lambda: writer.main(argv))
    assert seen and set(seen) == {1}


def test_the_library_writer_leaves_the_thread_setting_alone(tmp_path, monkeypatch):
    # Control: called as a library, the writer runs on the caller's setting.
    seen = _threads_seen_by_quantize(monkeypatch, lambda: _write(tmp_path / "ckpt"))
    assert seen and set(seen) == {2}
