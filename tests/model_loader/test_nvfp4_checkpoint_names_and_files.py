# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The NVFP4 MoE reader's tensor names and file access: expert tensors are
keyed on their full module (decoder layers vs others such as MTP blocks),
non-canonical indices and second tensors are refused, files are opened
first and checked through the descriptor (no check-then-open race), and
hostile JSON gives one-line errors."""

import json
import os
import re

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.kernels.utils import bytes_of
from tests.model_loader.nvfp4_ckpt_utils import make_layer
from vllm.model_executor.model_loader import checkpoint_files
from vllm.model_executor.model_loader.nvfp4_checkpoint_writer import (
    random_bf16_experts,
    write_nvfp4_moe_checkpoint,
)
from vllm.model_executor.model_loader.nvfp4_moe_checkpoint import NVFP4MoECheckpoint

E, H, I, TOPK = 4, 64, 32, 2  # noqa: E741 (the facts file's names)
SHARD = "model-00001-of-00001.safetensors"


def _config(**changes):
    return {
        "model_type": "qwen3_5_moe_text",
        "hidden_size": H,
        "num_hidden_layers": 2,
        "num_experts": E,
        "num_experts_per_tok": TOPK,
        "moe_intermediate_size": I,
    } | changes


def _write(path, layers=(0, 1), seed=0, **kwargs):
    experts = {i: random_bf16_experts(E, H, I, True, seed=seed + i) for i in layers}
    write_nvfp4_moe_checkpoint(path, experts, _config(), **kwargs)
    return path


def _layer():
    return make_layer(e=E, h=H, i=I)


def _loaded(ckpt, key):
    layer = _layer()
    ckpt.load_layer(layer, key)
    return {
        n: bytes_of(p.detach().contiguous()).clone()
        for n, p in layer.named_parameters()
    }


def _add_shard(ckpt_dir, tensors, file):
    """Add ``tensors`` (name -> tensor) as shard ``file``, listed after the
    checkpoint's own tensors in the index (so a reader where the later tensor
    wins would take these)."""
    save_file(tensors, ckpt_dir / file)
    index = ckpt_dir / "model.safetensors.index.json"
    data = json.loads(index.read_text())
    data["weight_map"].update({name: file for name in tensors})
    index.write_text(json.dumps(data))


def _renamed(source_dir, old, new):
    """All tensors of ``source_dir``'s shard, their names' ``old`` -> ``new``."""
    tensors = load_file(source_dir / SHARD)
    return {name.replace(old, new): t for name, t in tensors.items()}


def _refused(ckpt_dir, match):
    """Opening ``ckpt_dir`` raises a ValueError matching ``match``."""
    with pytest.raises(ValueError, match=match):
        NVFP4MoECheckpoint(ckpt_dir)


# --- item 1: names keyed on the full module ---------------------------------------


def test_mtp_experts_are_listed_separately_not_merged_into_layer_0(tmp_path):
    plain = _write(tmp_path / "plain")
    with_mtp = _write(tmp_path / "with_mtp")
    # MTP experts (other weights) under mtp.layers.0.mlp, listed last.
    _write(tmp_path / "mtp", layers=(0,), seed=100, prefix="mtp.layers")
    _add_shard(with_mtp, load_file(tmp_path / "mtp" / SHARD), "mtp.safetensors")

    ckpt = NVFP4MoECheckpoint(with_mtp)
    assert ckpt.moe_layers == [0, 1]
    assert ckpt.other_moe_modules == ["mtp.layers.0.mlp"]
    decoder_0 = _loaded(NVFP4MoECheckpoint(plain), 0)
    got = _loaded(ckpt, 0)
    for name, value in decoder_0.items():
        assert torch.equal(got[name], value), f"decoder layer 0 {name}"
    # The MTP block loads by its module name: its own weights, not layer 0's.
    mtp = _loaded(ckpt, "mtp.layers.0.mlp")
    assert not torch.equal(mtp["w13_weight"], decoder_0["w13_weight"])
    with pytest.raises(ValueError, match=r"layer 'mtp\.layers\.1\.mlp' has no"):
        ckpt.load_layer(_layer(), "mtp.layers.1.mlp")


def test_mtp_module_holds_the_mtp_weights(tmp_path):
    with_mtp = _write(tmp_path / "with_mtp")
    # The same MTP weights once as a decoder layer 0 of their own checkpoint.
    _write(tmp_path / "mtp_as_decoder", layers=(0,), seed=100)
    _add_shard(
        with_mtp,
        _renamed(tmp_path / "mtp_as_decoder", "model.layers.", "mtp.layers."),
        "mtp.safetensors",
    )
    want = _loaded(NVFP4MoECheckpoint(tmp_path / "mtp_as_decoder"), 0)
    got = _loaded(NVFP4MoECheckpoint(with_mtp), "mtp.layers.0.mlp")
    for name, value in want.items():
        assert torch.equal(got[name], value), name


def test_non_canonical_expert_index_is_refused(tmp_path):
    ckpt_dir = _write(tmp_path / "ckpt")
    name = "model.layers.0.mlp.experts.1.gate_proj.weight"
    bad = name.replace("experts.1.", "experts.01.")
    _add_shard(ckpt_dir, {bad: torch.zeros(I, H // 2, dtype=torch.uint8)}, "x.st")
    _refused(
        ckpt_dir,
        rf"{bad} \(in x\.st\) has the "
        r"non-canonical index '01' \(write 1\)",
    )


def test_non_canonical_layer_index_is_refused(tmp_path):
    ckpt_dir = _write(tmp_path / "ckpt")
    _add_shard(
        ckpt_dir, _renamed(ckpt_dir, "model.layers.1.", "model.layers.001."), "x.st"
    )
    _refused(ckpt_dir, "non-canonical index '001'")


def test_a_second_tensor_for_the_same_expert_names_both(tmp_path):
    # Layer 0's experts once more under model.layers.0.mixer (other weights).
    ckpt_dir = _write(tmp_path / "ckpt")
    _write(tmp_path / "other", layers=(0,), seed=50, block="mixer")
    _add_shard(ckpt_dir, load_file(tmp_path / "other" / SHARD), "other.st")
    with pytest.raises(ValueError) as err:
        NVFP4MoECheckpoint(ckpt_dir)
    text = str(err.value)
    m = re.search(r"is a second tensor for layer 0, expert (\d), (\w+)\.(\w+),", text)
    assert m, text
    tail = f"experts.{m[1]}.{m[2]}.{m[3]}"
    assert f"model.layers.0.mlp.{tail} (in {SHARD})" in text
    assert f"model.layers.0.mixer.{tail} (in other.st)" in text


def test_one_layer_with_experts_under_two_modules_is_refused(tmp_path):
    # Experts 0-1 under model.layers.0.mlp, 2-3 under backbone.layers.0.mixer:
    # no tensor twice, but one layer from two modules.
    ckpt_dir = _write(tmp_path / "ckpt", layers=(0,))
    tensors = load_file(ckpt_dir / SHARD)
    moved = {
        n.replace("model.layers.0.mlp", "backbone.layers.0.mixer"): t
        for n, t in tensors.items()
        if ".experts.2." in n or ".experts.3." in n
    }
    save_file(
        {
            n: t
            for n, t in tensors.items()
            if n.replace("model.layers.0.mlp", "backbone.layers.0.mixer") not in moved
        },
        ckpt_dir / SHARD,
    )
    data = json.loads((ckpt_dir / "model.safetensors.index.json").read_text())
    data["weight_map"] = {
        n: f
        for n, f in data["weight_map"].items()
        if ".experts.2." not in n and ".experts.3." not in n
    }
    (ckpt_dir / "model.safetensors.index.json").write_text(json.dumps(data))
    _add_shard(ckpt_dir, moved, "moved.st")
    _refused(
        ckpt_dir,
        r"decoder layer 0 has routed experts "
        r"under 2 modules \(model\.layers\.0\.mlp, "
        r"backbone\.layers\.0\.mixer\)",
    )


def test_experts_only_outside_the_decoder_layers(tmp_path):
    ckpt_dir = _write(tmp_path / "ckpt", layers=(0,), prefix="mtp.layers")
    _refused(
        ckpt_dir,
        r"no routed-expert tensors in decoder "
        r"layers \(only in \['mtp\.layers\.0\.mlp'\]\)",
    )


# --- config values ------------------------------------------------------------------


def test_num_experts_per_tok_zero_is_refused(tmp_path):
    ckpt_dir = _write(tmp_path / "ckpt")
    (ckpt_dir / "config.json").write_text(json.dumps(_config(num_experts_per_tok=0)))
    ckpt = NVFP4MoECheckpoint(ckpt_dir)
    with pytest.raises(
        ValueError,
        match=r"config\.json: num_experts_per_tok must "
        "be a positive integer, got 0",
    ):
        _ = ckpt.top_k


# --- item 15: hostile JSON ---------------------------------------------------------


@pytest.mark.parametrize(
    "file", ["config.json", "hf_quant_config.json", "model.safetensors.index.json"]
)
@pytest.mark.parametrize("opener", ["[", '{"a":'])
def test_deeply_nested_json_is_a_one_line_error(tmp_path, file, opener):
    ckpt_dir = _write(tmp_path / "ckpt")
    closer = "]" if opener == "[" else "}"
    (ckpt_dir / file).write_text(opener * 200_000 + "1" + closer * 200_000)
    with pytest.raises(ValueError) as err:
        NVFP4MoECheckpoint(ckpt_dir)
    assert str(err.value) == (
        f"{ckpt_dir / file}: not valid JSON (nested too deeply for the parser)"
    )


# --- item 16 and paths: open first, check the descriptor ---------------------------


def test_shard_next_to_the_directory_with_its_name_as_prefix_is_outside(tmp_path):
    # <dir>_outside.safetensors: a string-prefix check would take it as inside.
    ckpt_dir = _write(tmp_path / "ckpt")
    outside = tmp_path / "ckpt_outside.safetensors"
    (ckpt_dir / SHARD).rename(outside)
    (ckpt_dir / SHARD).symlink_to(outside)
    _refused(ckpt_dir, "outside the checkpoint directory")


def test_symlink_inside_the_directory_is_followed(tmp_path):
    ckpt_dir = _write(tmp_path / "ckpt")
    (ckpt_dir / "blobs").mkdir()
    (ckpt_dir / SHARD).rename(ckpt_dir / "blobs" / "abc")
    (ckpt_dir / SHARD).symlink_to("blobs/abc")
    assert NVFP4MoECheckpoint(ckpt_dir).moe_layers == [0, 1]


def _outside_checkpoint(tmp_path):
    """A checkpoint, and outside it a shard with the same tensor names but
    other values (what a swapped symlink would make the reader load)."""
    ckpt_dir = _write(tmp_path / "ckpt")
    _write(tmp_path / "evil", seed=99)
    return ckpt_dir, tmp_path / "evil" / SHARD


def test_a_shard_swapped_for_a_symlink_right_before_the_read(tmp_path, monkeypatch):
    """The check-then-open race made deterministic: the shard is swapped for
    a symlink to an outside file between the reader's check and its
    safetensors open. The reader must read what it checked (or refuse),
    never the outside file."""
    ckpt_dir, evil = _outside_checkpoint(tmp_path)
    want = _loaded(NVFP4MoECheckpoint(ckpt_dir), 0)
    real_safe_open = checkpoint_files.safe_open
    shard = ckpt_dir / SHARD

    def swap_then_open(path, *args, **kwargs):
        if not shard.is_symlink():  # the attacker's move
            shard.rename(ckpt_dir / "hidden")
            shard.symlink_to(evil)
        return real_safe_open(path, *args, **kwargs)

    ckpt = NVFP4MoECheckpoint(ckpt_dir)
    monkeypatch.setattr(checkpoint_files, "safe_open", swap_then_open)
    try:
        got = _loaded(ckpt, 0)
    except ValueError as e:
        assert "outside the checkpoint directory" in str(e) or "changed" in str(e)
    else:
        for name, value in want.items():
            assert torch.equal(got[name], value), name


def test_a_shard_swapped_before_the_open_is_refused(tmp_path, monkeypatch):
    """Swapped after the path was resolved but before it is opened: the
    no-follow open refuses the symlink."""
    ckpt_dir, evil = _outside_checkpoint(tmp_path)
    ckpt = NVFP4MoECheckpoint(ckpt_dir)
    shard = ckpt_dir / SHARD
    real_realpath = os.path.realpath

    def realpath_then_swap(path, *args, **kwargs):
        result = real_realpath(path, *args, **kwargs)
        if str(path) == str(shard) and not shard.is_symlink():
            shard.rename(ckpt_dir / "hidden")
            shard.symlink_to(evil)
        return result

    monkeypatch.setattr(checkpoint_files.os.path, "realpath", realpath_then_swap)
    with pytest.raises(ValueError, match=f"{SHARD} changed while it was opened"):
        ckpt.load_layer(_layer(), 0)


def test_shards_are_read_through_a_map_not_into_memory(tmp_path):
    """Reading through the descriptor keeps memory at one tensor: streaming a
    layer from a shard that also holds 40 MiB of other tensors grows the
    process's anonymous memory by far less than the shard."""
    ckpt_dir = _write(tmp_path / "ckpt")
    tensors = load_file(ckpt_dir / SHARD)
    filler = {
        f"filler.{k}": torch.full((1 << 20,), k, dtype=torch.uint8) for k in range(40)
    }
    save_file(tensors | filler, ckpt_dir / SHARD)
    del tensors, filler
    assert (ckpt_dir / SHARD).stat().st_size > 40 << 20

    def rss_anon():
        with open("/proc/self/status") as f:
            line = next(x for x in f if x.startswith("RssAnon:"))
        return int(line.split()[1]) << 10

    ckpt = NVFP4MoECheckpoint(ckpt_dir)
    before = peak = rss_anon()
    count = 0
    for *_, tensor in ckpt.iter_layer_tensors(0):
        peak = max(peak, rss_anon())
        count += 1
        del tensor
    assert count == E * 3 * 4
    assert peak - before < 16 << 20, f"{(peak - before) >> 20} MiB"
