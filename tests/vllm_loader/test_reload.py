# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""vLLM 0.34.0's weight reload (``model_executor/model_loader/reload/``) on
models the series prepares for b12x, driven as the model runner's
``reload_weights`` drives it: ``reload.inplace.reload_weights(vllm_config,
model, None, weights_path, is_checkpoint_format=True)`` (``start_reload``,
the model's ``load_weights``, ``finish_reload``), in the mode
``VLLM_RELOAD_MODE`` names.

Checkpoints: ``nvfp4_checkpoint.py``'s tiny preset (E=8, H=256, I=256, two MoE
layers; random codes, scales of real range), ModelOpt and
compressed-tensors W4A4, ModelOpt MIXED_PRECISION with W4A16 experts (and
compressed-tensors NVFP4A16 for the second call below); seed 0 is the one
loaded, seed 1 the one reloaded. Comparisons are exact: every
tensor reachable from the model (``model_tensors.records``: parameters,
buffers, the experts' derived tensors, the kernel objects' views), its layout
and bytes, and in direct mode its address.

Also here: a second ``process_weights_after_loading(model, ...)`` on a
prepared model changes nothing (upstream's
``_already_called_process_weights_after_loading``, which the reload paths
clear before they prepare a reloaded layer).
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from cpu_loading import load_model
from model_tensors import differences, reachable_tensors, records
from w4a16_checkpoints import write_w4a16_checkpoint

from vllm.config import set_current_vllm_config

from nvfp4_checkpoint import PRESETS, write_checkpoint
from vllm_cpu_stand_ins import sm_count

pytestmark = pytest.mark.usefixtures("vllm_cpu", "flashinfer_sm_count")

TINY = PRESETS["tiny"]
LAYERS = 2
W4A4 = ("modelopt", "compressed-tensors")
W4A16 = "modelopt-mixed-w4a16"
CT_W4A16 = "compressed-tensors-w4a16"
FORMATS = (*W4A4, W4A16)
EXPERTS = "model.layers.{}.mlp.experts.routed_experts"
# Host copies of attention's KV scales, which upstream's Attention re-creates
# on every post-load processing when the quant config does not cover
# attention (set_default_quant_scales; MIXED_PRECISION here): CPU tensors by
# design, not device memory a CUDA graph captures.
_HOST_SCALES = ("._k_scale_cpu", "._v_scale_cpu")


@pytest.fixture(scope="module")
def flashinfer_sm_count():
    with sm_count():
        yield


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """``checkpoint(fmt, seed)``: that checkpoint's directory, written once."""
    root = tmp_path_factory.mktemp("checkpoints")
    written: dict[tuple[str, int], Path] = {}

    def get(fmt: str, seed: int = 0) -> Path:
        if (fmt, seed) not in written:
            out = root / f"{fmt}-{seed}"
            if fmt in (W4A16, CT_W4A16):
                scheme = "modelopt-mixed" if fmt == W4A16 else "compressed-tensors"
                write_w4a16_checkpoint(out, TINY, LAYERS, scheme, seed)
            else:
                write_checkpoint(out, TINY, LAYERS, fmt, seed=seed)
            written[fmt, seed] = out
        return written[fmt, seed]

    return get


def _reload(model, cfg, checkpoint: Path) -> None:
    from vllm.model_executor.model_loader.reload.inplace import reload_weights

    with set_current_vllm_config(cfg):
        reload_weights(cfg, model, None, str(checkpoint), is_checkpoint_format=True)


def _moe_parameters(layer: int) -> list[str]:
    names = ("w13_weight", "w13_weight_scale", "w2_weight", "w2_weight_scale")
    return [f"{EXPERTS.format(layer)}.{n}" for n in names]


@pytest.mark.parametrize("mode", ["direct", "layerwise"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_reload_leaves_the_bytes_of_a_cold_start(fmt, mode, checkpoint, monkeypatch):
    monkeypatch.setenv("VLLM_RELOAD_MODE", mode)
    model, cfg = load_model(checkpoint(fmt, 0))
    before = records(model)
    _reload(model, cfg, checkpoint(fmt, 1))
    after = records(model)
    assert differences(after, records(load_model(checkpoint(fmt, 1))[0])) == []
    # Not vacuous: the two checkpoints' prepared experts differ.
    changed = {d.split(":")[0] for d in differences(after, before)}
    for layer in range(LAYERS):
        assert set(_moe_parameters(layer)) <= changed


@pytest.mark.parametrize(
    "fmt",
    [
        *W4A4,
        pytest.param(W4A16),
    ],
)
def test_direct_reload_keeps_every_address(fmt, checkpoint, monkeypatch):
    monkeypatch.setenv("VLLM_RELOAD_MODE", "direct")
    model, cfg = load_model(checkpoint(fmt, 0))
    before = records(model)
    _reload(model, cfg, checkpoint(fmt, 1))
    moved = [
        d
        for d in differences(records(model), before, addresses=True)
        if d.endswith(": moved") and not d.split(":")[0].endswith(_HOST_SCALES)
    ]
    assert moved == []


def test_refused_direct_reload_leaves_the_model_untouched(checkpoint, monkeypatch):
    """A parameter object registered anew after loading (a post-load step
    outside ``replace_parameter``) has no checkpoint layout: ``start_reload``
    refuses before viewing anything back."""
    from vllm.model_executor.model_loader.reload.direct import direct_reload_active

    monkeypatch.setenv("VLLM_RELOAD_MODE", "direct")
    model, cfg = load_model(checkpoint("modelopt", 0))
    experts = model.get_submodule(EXPERTS.format(LAYERS - 1))
    experts.w2_weight_scale = torch.nn.Parameter(
        experts.w2_weight_scale.data, requires_grad=False
    )
    before = records(model)
    with pytest.raises(RuntimeError, match="replaced the parameter object"):
        _reload(model, cfg, checkpoint("modelopt", 1))
    assert differences(records(model), before, addresses=True) == []
    assert not direct_reload_active(model)


def _held_bytes(model: torch.nn.Module) -> int:
    """Bytes of the distinct storages every tensor reachable from ``model``
    holds (meta tensors hold none)."""
    storages = {
        t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
        for t in reachable_tensors(model).values()
        if not t.is_meta
    }
    return sum(storages.values())


def test_layerwise_reload_holds_the_w4a16_experts_once(checkpoint, monkeypatch):
    """The layerwise framework reprocesses a layer in tensors of its own and
    copies the results back: the W4A16 experts keep no reference to those
    (their apply views the parameters it is given). What stays held twice is
    what the release and the W4A4 experts keep too: the scales the quant config
    captured (the weights, 8 times as many bytes, would break the bound)."""
    monkeypatch.setenv("VLLM_RELOAD_MODE", "layerwise")
    model, cfg = load_model(checkpoint(W4A16, 0))
    before = _held_bytes(model)
    scales = sum(
        param.nbytes
        for layer in range(LAYERS)
        for name, param in model.get_submodule(EXPERTS.format(layer)).named_parameters()
        if name not in ("w13_weight", "w2_weight")
    )
    _reload(model, cfg, checkpoint(W4A16, 1))
    assert _held_bytes(model) - before <= scales


@pytest.mark.parametrize("fmt", [*FORMATS, CT_W4A16])
def test_second_process_weights_after_loading_changes_nothing(fmt, checkpoint):
    """PR 5: the NVFP4 MoE methods prepare a layer once (the release
    prepared compressed-tensors layers again: gate and up swapped back)."""
    from vllm.model_executor.model_loader.utils import process_weights_after_loading

    model, cfg = load_model(checkpoint(fmt, 0))
    before = records(model)
    process_weights_after_loading(model, cfg.model_config, torch.device("cpu"))
    # Attention's host scale copies are made anew (see _HOST_SCALES), same bytes.
    changed = [
        d
        for d in differences(records(model), before, addresses=True)
        if not (d.endswith(": moved") and d.split(":")[0].endswith(_HOST_SCALES))
    ]
    assert changed == []


_RELEASE_RELOAD = """
import json, sys
from cpu_loading import is_release, load_model, vllm_world
from model_tensors import differences, records
from vllm.model_executor.model_loader.reload.inplace import reload_weights
from vllm.config import set_current_vllm_config
a, b, init = sys.argv[1:4]
assert is_release()
with vllm_world(init):
    model, cfg = load_model(a)
    before = records(model)
    with set_current_vllm_config(cfg):
        reload_weights(cfg, model, None, b, is_checkpoint_format=True)
    print(json.dumps(differences(records(model), before, addresses=True)))
"""


@pytest.mark.slow
def test_direct_reload_moves_the_releases_folded_scales(checkpoint, tmp_path):
    """Negative control of the address check: vLLM 0.34.0 itself (its own
    tree, in a process of its own) folds each global scale into a new FP8
    block-scale tensor on every preparation, so a direct reload moves them."""
    release = Path(__file__).resolve().parents[2] / "build/release/vllm-0.34.0"
    if not (release / "vllm" / "__init__.py").is_file():
        pytest.skip(f"no vLLM 0.34.0 worktree at {release}")
    here = Path(__file__).resolve().parent
    benchmarks = here.parents[1] / "benchmarks"
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(map(str, (release, here, benchmarks))),
        "VLLM_TARGET_DEVICE": "cpu",
        "VLLM_RELOAD_MODE": "direct",
    }
    a, b = checkpoint("modelopt", 0), checkpoint("modelopt", 1)
    run = subprocess.run(
        [sys.executable, "-P", "-c", _RELEASE_RELOAD, a, b, tmp_path / "init"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    found = json.loads(run.stdout.splitlines()[-1])
    moved = {d.split(":")[0] for d in found if d.endswith(": moved")}
    for layer in range(LAYERS):
        for name in ("w13_weight_scale", "w2_weight_scale"):
            assert f"{EXPERTS.format(layer)}.{name}" in moved
