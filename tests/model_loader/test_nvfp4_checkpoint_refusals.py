# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""NVFP4 MoE checkpoints the reader refuses: missing, damaged, truncated or
mislabelled files, an untrusted directory (links, FIFOs, paths outside it),
and bad block or global scales, each named in a clear error."""

import json
import os
import re
import signal

import pytest
import torch

from tests.model_loader.nvfp4_ckpt_utils import (
    E,
    H,
    I,
    make_layer,
    qwen_config,
    write_ckpt,
)
from vllm.model_executor.model_loader.nvfp4_moe_checkpoint import (
    COMPRESSED_TENSORS,
    MODELOPT,
    NVFP4MoECheckpoint,
)
from vllm.utils.mem_utils import measure_peak_memory


def _write_then(tmp_path, mutate):
    write_ckpt(tmp_path)
    mutate(tmp_path)
    return tmp_path


def _drop_from_index(path, name):
    index = path / "model.safetensors.index.json"
    data = json.loads(index.read_text())
    del data["weight_map"][name]
    index.write_text(json.dumps(data))


def _set_algo(path, algo):
    (path / "hf_quant_config.json").write_text(
        json.dumps({"quantization": {"quant_algo": algo}})
    )


def _truncate(path):
    f = next(path.glob("*.safetensors"))
    data = f.read_bytes()
    f.write_bytes(data[: len(data) // 2])


def _corrupt(path):
    f = next(path.glob("*.safetensors"))
    f.write_bytes(b"\xff" * 64 + f.read_bytes()[64:])


def _more_experts_in_config(path):
    cfg = json.loads((path / "config.json").read_text())
    cfg["num_experts"] = E * 2
    (path / "config.json").write_text(json.dumps(cfg))


MISSING = "model.layers.0.mlp.experts.5.up_proj.weight_scale"
# case -> (mutation, expected message, experts of the layer loaded into)
BAD_CHECKPOINTS = {
    "missing expert tensor": (
        lambda p: _drop_from_index(p, MISSING),
        "missing tensor " + MISSING.replace(".", r"\."),
        E,
    ),
    "unknown algorithm": (
        lambda p: _set_algo(p, "FP8"),
        "unsupported ModelOpt quant_algo 'FP8'",
        E,
    ),
    "truncated file": (_truncate, r"model-00001-of-00001\.safetensors", E),
    "corrupt file": (_corrupt, r"model-00001-of-00001\.safetensors", E),
    "files vs config expert count": (
        _more_experts_in_config,
        "says 16 experts, but layer 0 of the checkpoint has tensors for 8",
        2 * E,
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_CHECKPOINTS))
def test_bad_checkpoints_raise_clear_errors(tmp_path, case):
    mutate, message, experts = BAD_CHECKPOINTS[case]
    _write_then(tmp_path, mutate)
    layer = make_layer(e=experts)
    with pytest.raises(ValueError, match=message):
        NVFP4MoECheckpoint(tmp_path).load_layer(layer, 0)


def _last_shard_damaged(path, how):
    last = sorted(path.glob("*.safetensors"))[-1]
    data = last.read_bytes()
    if how == "truncated":
        last.write_bytes(data[: len(data) // 2])
    else:  # the header's JSON overwritten, its length kept
        last.write_bytes(data[:8] + b"\xff" * 16 + data[24:])
    return last


@pytest.mark.parametrize("how", ["truncated", "corrupt header"])
def test_a_damaged_later_shard_is_refused_when_the_checkpoint_opens(tmp_path, how):
    # Layer 1 lives in the last shard only: the first layer's tensors and
    # the geometry check read the first shards alone. Every shard's header
    # is read up front, so the checkpoint is refused before any layer (a
    # corrupt second shard failed a run only after two layers, 12 s in).
    write_ckpt(tmp_path, max_shard_bytes=64 << 10)
    wm = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    shards = sorted(set(wm["weight_map"].values()))
    assert len(shards) > 2
    first_layer = {f for n, f in wm["weight_map"].items() if ".layers.0." in n}
    assert shards[-1] not in first_layer
    # Control: whole, the checkpoint opens and loads its first layer.
    NVFP4MoECheckpoint(tmp_path).load_layer(make_layer(), 0)
    last = _last_shard_damaged(tmp_path, how)
    with pytest.raises(ValueError, match=re.escape(f"{last}: not a readable")):
        NVFP4MoECheckpoint(tmp_path)


def test_an_index_naming_a_tensor_its_shard_lacks_is_refused(tmp_path):
    write_ckpt(tmp_path, max_shard_bytes=64 << 10)
    index = tmp_path / "model.safetensors.index.json"
    data = json.loads(index.read_text())
    shards = sorted(set(data["weight_map"].values()))
    name = "model.layers.1.mlp.experts.7.down_proj.weight"
    other = next(f for f in shards if f != data["weight_map"][name])
    data["weight_map"][name] = other
    index.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=re.escape(f"{name} should be in {other}")):
        NVFP4MoECheckpoint(tmp_path)


def test_wrong_shape_and_dtype_in_file(tmp_path):
    write_ckpt(tmp_path / "small", h=128)  # H = 128 in the file, 256 in the layer
    with pytest.raises(
        ValueError, match=r"experts\.\d+\.\w+_proj\.weight\w*: expected shape"
    ):
        NVFP4MoECheckpoint(tmp_path / "small").load_layer(make_layer(), 0)
    # A weight stored as int8 instead of uint8.
    from safetensors.torch import load_file, save_file

    write_ckpt(tmp_path / "dtype")
    f = next((tmp_path / "dtype").glob("*.safetensors"))
    tensors = load_file(f)
    name = "model.layers.0.mlp.experts.0.gate_proj.weight"
    tensors[name] = tensors[name].view(torch.int8)
    save_file(tensors, f)
    with pytest.raises(ValueError, match=f"{name}: expected dtype torch.uint8"):
        NVFP4MoECheckpoint(tmp_path / "dtype").load_layer(make_layer(), 0)


def test_not_an_nvfp4_checkpoint(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(qwen_config()))
    with pytest.raises(ValueError, match="no quantization_config"):
        NVFP4MoECheckpoint(tmp_path)
    cfg = qwen_config() | {"quantization_config": {"quant_method": "gptq"}}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="unsupported quantization method 'gptq'"):
        NVFP4MoECheckpoint(tmp_path)


# --- a checkpoint directory is untrusted input ----------------------------------


def _index(path):
    return json.loads((path / "model.safetensors.index.json").read_text())


def _set_index(path, data):
    (path / "model.safetensors.index.json").write_text(json.dumps(data))


def _point_shard(path, target):
    data = _index(path)
    first = next(iter(data["weight_map"]))
    data["weight_map"][first] = target
    _set_index(path, data)


def _symlink_shard_outside(path):
    shard = path / "model-00001-of-00001.safetensors"
    outside = path.parent / "outside.safetensors"
    shard.rename(outside)
    shard.symlink_to(outside)


def _fifo(path, name):
    target = path / name
    target.unlink()
    os.mkfifo(target)


def _set_config(path, **changes):
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(changes)
    (path / "config.json").write_text(json.dumps(cfg))


def _write_raw(path, name, text):
    (path / name).write_text(text)


def _duplicate_tensor_in_two_shards(path):
    from safetensors.torch import load_file, save_file

    (path / "model.safetensors.index.json").unlink()
    shard = path / "model-00001-of-00001.safetensors"
    name = "model.layers.0.mlp.experts.0.gate_proj.weight"
    save_file({name: load_file(shard)[name]}, path / "model-extra.safetensors")


def _no_index(path):
    (path / "model.safetensors.index.json").unlink()


UNTRUSTED = {
    "absolute shard path": (
        lambda p: _point_shard(p, "/etc/passwd"),
        "must be a path inside the checkpoint directory",
    ),
    "dotdot shard path": (
        lambda p: _point_shard(p, "../x.safetensors"),
        "must be a path inside the checkpoint directory",
    ),
    "symlinked shard leaving the directory": (
        _symlink_shard_outside,
        "outside the checkpoint directory",
    ),
    "symlinked shard, no index": (
        lambda p: (_symlink_shard_outside(p), _no_index(p)),
        "outside the checkpoint directory",
    ),
    "FIFO shard": (
        lambda p: _fifo(p, "model-00001-of-00001.safetensors"),
        "is not a regular file",
    ),
    "FIFO index": (
        lambda p: _fifo(p, "model.safetensors.index.json"),
        "is not a regular file",
    ),
    "FIFO config": (lambda p: _fifo(p, "config.json"), "is not a regular file"),
    "FIFO quant config": (
        lambda p: _fifo(p, "hf_quant_config.json"),
        "is not a regular file",
    ),
    "huge num_experts": (
        lambda p: _set_config(p, num_experts=16384),
        "says 16384 experts, but layer 0 of the checkpoint has tensors for 8",
    ),
    "num_experts 2**20": (
        lambda p: _set_config(p, num_experts=2**20),
        "says 1048576 experts",
    ),
    "wrong hidden_size": (
        lambda p: _set_config(p, hidden_size=4096),
        r"hidden_size 4096 and intermediate size 128 mean "
        r"\S+ has shape",
    ),
    "num_experts a string": (
        lambda p: _set_config(p, num_experts="8"),
        "num_experts must be a positive integer, got '8'",
    ),
    "num_experts negative": (
        lambda p: _set_config(p, num_experts=-8),
        "num_experts must be a positive integer",
    ),
    "text_config a string": (
        lambda p: _set_config(p, text_config="qwen"),
        "config.json: 'text_config' must be a JSON object, got str",
    ),
    "config a list": (
        lambda p: _write_raw(p, "config.json", "[1, 2]"),
        "config.json: expected a JSON object, got list",
    ),
    "weight_map a list": (
        lambda p: _set_index(p, {"weight_map": ["a"]}),
        "'weight_map' must be a JSON object, got list",
    ),
    "weight_map value a number": (
        lambda p: _set_index(p, {"weight_map": {"a": 3}}),
        r"weight_map\['a'\] must be a file name, got 3",
    ),
    "quantization a list": (
        lambda p: _write_raw(p, "hf_quant_config.json", '{"quantization": [1]}'),
        "hf_quant_config.json: 'quantization' must be a JSON object",
    ),
    "duplicate key in index": (
        lambda p: _write_raw(
            p, "model.safetensors.index.json", '{"weight_map": {"a": "x", "a": "y"}}'
        ),
        "model.safetensors.index.json: duplicate key 'a'",
    ),
    "tensor in two shards": (
        _duplicate_tensor_in_two_shards,
        r"experts\.0\.gate_proj\.weight is in two shards",
    ),
}


@pytest.mark.parametrize("case", sorted(UNTRUSTED))
def test_untrusted_checkpoint_directory_is_refused(tmp_path, case):
    mutate, message = UNTRUSTED[case]
    ckpt = tmp_path / "ckpt"
    write_ckpt(ckpt, max_shard_bytes=1 << 30)  # one shard
    mutate(ckpt)
    # A FIFO must be refused at once, never opened (which would block): the
    # alarm turns a hang into a failure (generous: the layer is built inside
    # it, seconds on a loaded machine).
    old = signal.signal(signal.SIGALRM, lambda *a: pytest.fail("reader hung"))
    signal.alarm(120)
    try:
        with (
            measure_peak_memory("cpu") as mem,
            pytest.raises(ValueError, match=message),
        ):
            NVFP4MoECheckpoint(ckpt).load_layer(make_layer(), 0)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
    # Nothing the config claims was allocated before it was checked.
    assert mem.peak_bytes < 1 << 20


def test_layer_and_checkpoint_expert_counts_must_agree(tmp_path):
    write_ckpt(tmp_path)
    with pytest.raises(ValueError, match="config.json has 8 experts, the layer 16"):
        NVFP4MoECheckpoint(tmp_path).load_layer(make_layer(e=2 * E), 0)


def _save_with(path, name, value):
    from safetensors.torch import load_file, save_file

    shard = path / "model-00001-of-00001.safetensors"
    tensors = load_file(shard)
    tensors[name] = value
    save_file(tensors, shard)


EXPERT = "model.layers.0.mlp.experts.3"
BAD_SCALES = {
    "NaN weight_scale_2": (
        MODELOPT,
        f"{EXPERT}.up_proj.weight_scale_2",
        torch.tensor(float("nan")),
        "expert 3 is nan",
    ),
    "zero weight_scale_2": (
        MODELOPT,
        f"{EXPERT}.down_proj.weight_scale_2",
        torch.tensor(0.0),
        "expert 3 is 0.0",
    ),
    "negative input_scale": (
        MODELOPT,
        f"{EXPERT}.gate_proj.input_scale",
        torch.tensor(-0.5),
        "expert 3 is -0.5",
    ),
    "inf weight_scale_2": (
        MODELOPT,
        f"{EXPERT}.gate_proj.weight_scale_2",
        torch.tensor(float("inf")),
        "expert 3 is inf",
    ),
    "zero weight_global_scale": (
        COMPRESSED_TENSORS,
        f"{EXPERT}.gate_proj.weight_global_scale",
        torch.zeros(1),
        "expert 3 is inf",
    ),
    "NaN block scale": (
        MODELOPT,
        f"{EXPERT}.up_proj.weight_scale",
        torch.full((I, H // 16), 0x7F, dtype=torch.uint8).view(torch.float8_e4m3fn),
        "expert 3 is NaN",
    ),
    "negative block scale": (
        MODELOPT,
        f"{EXPERT}.down_proj.weight_scale",
        torch.full((H, I // 16), 0xB8, dtype=torch.uint8).view(torch.float8_e4m3fn),
        "expert 3 is negative",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_SCALES))
def test_bad_scales_in_a_file_name_the_file_tensor_and_expert(tmp_path, case):
    fmt, name, value, message = BAD_SCALES[case]
    write_ckpt(tmp_path, fmt, max_shard_bytes=1 << 30)
    _save_with(tmp_path, name, value)
    layer = make_layer()
    with pytest.raises(ValueError) as err:
        NVFP4MoECheckpoint(tmp_path).load_layer(layer, 0)
    text = str(err.value)
    assert "model-00001-of-00001.safetensors" in text
    assert name in text and message in text, text
