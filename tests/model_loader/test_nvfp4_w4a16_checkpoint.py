# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""W4A16 (weight-only NVFP4) checkpoints: what each format declares, per layer,
and how the reader loads it (no input scales), with the writer's test files."""

import json

import pytest
import torch

from tests.kernels.utils import bytes_of
from vllm.model_executor.layers.fused_moe.layer import FusedMoE
from vllm.model_executor.layers.quantization.modelopt import ModelOptNvFp4Config
from vllm.model_executor.model_loader import nvfp4_checkpoint_writer as writer
from vllm.model_executor.model_loader.nvfp4_checkpoint_writer import (
    random_bf16_experts,
    write_nvfp4_moe_checkpoint,
)
from vllm.model_executor.model_loader.nvfp4_moe_checkpoint import (
    COMPRESSED_TENSORS,
    MODELOPT,
    NVFP4MoECheckpoint,
)

E, H, I, TOPK = 8, 256, 128, 2  # noqa: E741 (the facts file's names)
LAYERS = (0, 1, 2)
BACKEND = "flashinfer_b12x_emulated"
W4A4, W4A16 = "w4a4", "w4a16"


def qwen_config(layers=3):
    return {
        "model_type": "qwen3_5_moe_text",
        "hidden_size": H,
        "num_hidden_layers": layers,
        "num_experts": E,
        "num_experts_per_tok": TOPK,
        "moe_intermediate_size": I,
    }


_BF16 = {idx: random_bf16_experts(E, H, I, True, seed=idx) for idx in LAYERS}


def write(path, fmt=MODELOPT, layers=LAYERS, **kwargs):
    chosen = {idx: _BF16[idx] for idx in layers}
    write_nvfp4_moe_checkpoint(path, chosen, qwen_config(), fmt=fmt, **kwargs)
    return path


def make_layer(mode=W4A4, quant_config=None):
    return FusedMoE(
        num_experts=E,
        top_k=TOPK,
        hidden_size=H,
        intermediate_size=I,
        quant_config=quant_config or ModelOptNvFp4Config.for_mode(mode),
        moe_backend=BACKEND,
        device="cpu",
        place_w3w1_at_load=False,
    )


def loaded(ckpt, idx):
    layer = make_layer(quant_config=ckpt.quant_config(idx))
    ckpt.load_layer(layer, idx)
    return layer


# (format, writer keywords) of every way a W4A16 checkpoint is declared
W4A16_WAYS = {
    "modelopt top-level": (MODELOPT, {}),
    "modelopt MIXED_PRECISION": (MODELOPT, {"per_layer": True}),
    "modelopt in config.json": (MODELOPT, {"quant_config_in_config_json": True}),
    "modelopt MIXED_PRECISION in config.json": (
        MODELOPT,
        {"per_layer": True, "quant_config_in_config_json": True},
    ),
    "compressed-tensors null input_activations": (COMPRESSED_TENSORS, {}),
}


def _quant_json(path):
    hf = path / "hf_quant_config.json"
    if hf.exists():
        return json.loads(hf.read_text())["quantization"]
    return json.loads((path / "config.json").read_text())["quantization_config"]


@pytest.mark.parametrize("way", sorted(W4A16_WAYS))
def test_w4a16_checkpoints_declare_and_load_weight_only(tmp_path, way):
    fmt, kwargs = W4A16_WAYS[way]
    w4a16 = write(tmp_path / "w4a16", fmt, quant_mode=W4A16, **kwargs)
    w4a4 = write(tmp_path / "w4a4", fmt, **kwargs)
    # What the writer declared, as the format spells it.
    q = _quant_json(w4a16)
    if fmt == COMPRESSED_TENSORS:
        assert q["config_groups"]["group_0"]["input_activations"] is None
        assert _quant_json(w4a4)["config_groups"]["group_0"]["input_activations"]
    elif kwargs.get("per_layer"):
        assert q["quant_algo"] == "MIXED_PRECISION"
        entry = q["quantized_layers"]["model.layers.1.mlp.experts"]
        assert entry["quant_algo"] == "W4A16_NVFP4"
        assert q["quantized_layers"]["model.layers.1.self_attn.q_proj"] == {
            "quant_algo": "FP8"
        }  # tolerated: another module's algorithm
    else:
        assert q["quant_algo"] == "W4A16_NVFP4"
    ckpt, control = NVFP4MoECheckpoint(w4a16), NVFP4MoECheckpoint(w4a4)
    for idx in LAYERS:
        assert ckpt.quant_mode(idx) == W4A16 and control.quant_mode(idx) == W4A4
        config = ckpt.quant_config(idx)
        assert isinstance(config, ModelOptNvFp4Config) and config.is_weight_only
        assert not control.quant_config(idx).is_weight_only
    # No input scale in a W4A16 file; the weights are the W4A4 file's, bytes.
    names = [n for n in ckpt.weight_map if "input" in n]
    assert names == [] and any("input" in n for n in control.weight_map)
    a, b = loaded(ckpt, 1), loaded(control, 1)
    for name, p in b.named_parameters():
        q = getattr(a, name)
        if "input_scale" in name:
            assert (q == 1).all() and not (p == 1).all(), name
        elif p.dtype == torch.float32:  # CT stores the inverse: 1/(1/x)
            torch.testing.assert_close(q, p, rtol=2e-7, atol=0)
        else:
            assert torch.equal(bytes_of(q), bytes_of(p)), name


@pytest.mark.parametrize("fmt", [MODELOPT, COMPRESSED_TENSORS])
def test_present_input_scale_is_ignored_in_w4a16(tmp_path, fmt):
    from safetensors.torch import load_file, save_file

    path = write(
        tmp_path,
        fmt,
        quant_mode=W4A16,
        w4a16_input_scales=True,
        max_shard_bytes=1 << 30,
    )
    suffix = "input_scale" if fmt == MODELOPT else "input_global_scale"
    shard = path / "model-00001-of-00001.safetensors"
    tensors = load_file(shard)
    names = [n for n in tensors if n.endswith(suffix)]
    assert len(names) == len(LAYERS) * E * 3
    # A value the W4A4 reader refuses (see the control below): never read.
    for n in names:
        tensors[n] = torch.full_like(tensors[n], float("nan"))
    save_file(tensors, shard)
    ckpt = NVFP4MoECheckpoint(path)
    yielded = {s for _, _, _, s, _ in ckpt.iter_layer_tensors(0)}
    assert yielded == {"weight", "weight_scale", "weight_scale_2"}
    layer = loaded(ckpt, 0)
    assert (layer.w13_input_scale == 1).all() and (layer.w2_input_scale == 1).all()
    # Control: the same file declared W4A4 reads the input scales and refuses.
    q = json.loads((path / "config.json").read_text())
    if fmt == MODELOPT:
        (path / "hf_quant_config.json").write_text(
            json.dumps({"quantization": {"quant_algo": "NVFP4"}})
        )
    else:
        group = q["quantization_config"]["config_groups"]["group_0"]
        group["input_activations"] = dict(group["weights"])
        (path / "config.json").write_text(json.dumps(q))
    control = NVFP4MoECheckpoint(path)
    with pytest.raises(ValueError, match="is nan"):
        control.load_layer(make_layer(W4A4), 0)


MIXED = {0: W4A16, 1: W4A4, 2: W4A16}


@pytest.mark.parametrize("fmt", [MODELOPT, COMPRESSED_TENSORS])
def test_mixed_checkpoint_gives_each_layer_its_own_mode(tmp_path, fmt):
    path = write(tmp_path, fmt, quant_mode=MIXED)
    q = _quant_json(path)
    if fmt == MODELOPT:
        assert q["quant_algo"] == "MIXED_PRECISION"
    else:
        modes = {
            g["input_activations"] is None
            for g in q["config_groups"].values()
            if g["format"] == "nvfp4-pack-quantized"
        }
        assert modes == {True, False}  # one W4A16 group, one W4A4 group
    ckpt = NVFP4MoECheckpoint(path)
    assert {i: ckpt.quant_mode(i) for i in LAYERS} == MIXED
    assert {i: ckpt.quant_config(i).quant_mode for i in LAYERS} == MIXED
    assert ckpt.quant_config(0) is not ckpt.quant_config(0)  # each layer its own
    w4a4_layer = loaded(ckpt, 1)
    assert not (w4a4_layer.w13_input_scale == 1).all()  # read in W4A4
    w4a16_layer = loaded(ckpt, 2)
    assert (w4a16_layer.w13_input_scale == 1).all()
    # A layer built with the other layer's config is refused, untouched.
    wrong = make_layer(W4A4)
    with pytest.raises(
        ValueError,
        match="layer 0's experts are w4a16, the layer "
        r"is built for w4a4.*quant_config\(0\)",
    ):
        ckpt.load_layer(wrong, 0)
    assert (wrong.w13_weight == 0).all()
    with pytest.raises(ValueError, match="layer 1's experts are w4a4"):
        ckpt.load_layer(make_layer(W4A16), 1)
    with pytest.raises(ValueError, match="layer 7 has no routed experts"):
        ckpt.quant_mode(7)


def test_w4a4_checkpoint_loads_as_before(tmp_path):
    # The default writer output and the W4A4 reader: input scales loaded, the
    # mode W4A4 for every layer, a layer built with the default config works.
    ckpt = NVFP4MoECheckpoint(write(tmp_path))
    assert [ckpt.quant_mode(i) for i in LAYERS] == [W4A4] * 3
    assert _quant_json(tmp_path)["quant_algo"] == "NVFP4"
    layer = make_layer(quant_config=ModelOptNvFp4Config.for_mode())
    ckpt.load_layer(layer, 0)
    expected = torch.full((E, 2), 8.0 / (448 * 6))  # act_amax / (448 * 6)
    torch.testing.assert_close(layer.w13_input_scale.data, expected)


# --- declarations: both formats, hand-written ---------------------------------

EXPERTS = "model.layers.{}.mlp.experts"


def _modelopt(path, quantization):
    (path / "hf_quant_config.json").write_text(
        json.dumps({"quantization": quantization})
    )


def _mixed(path, layers: dict):
    _modelopt(path, {"quant_algo": "MIXED_PRECISION", "quantized_layers": layers})


def _experts(algo="W4A16_NVFP4", **extra):
    return {EXPERTS.format(i): {"quant_algo": algo, **extra} for i in LAYERS}


def _per_linear(idx, algo, experts=range(E)):
    return {
        f"{EXPERTS.format(idx)}.{e}.{p}": {"quant_algo": algo}
        for e in experts
        for p in ("gate_proj", "up_proj", "down_proj")
    }


MODELOPT_OK = {
    "per-linear entries": (
        lambda p: _mixed(
            p,
            {
                **_per_linear(0, "W4A16_NVFP4"),
                **_per_linear(1, "NVFP4"),
                **_per_linear(2, "w4a16_nvfp4"),
            },
        ),
        [W4A16, W4A4, W4A16],
    ),
    "module and agreeing linears": (
        lambda p: _mixed(p, {**_experts("NVFP4"), **_per_linear(1, "NVFP4")}),
        [W4A4] * 3,
    ),
    "other modules with any algorithm": (
        lambda p: _mixed(
            p,
            {
                **_experts(),
                "model.layers.0.self_attn.o_proj": {"quant_algo": "FP8"},
                "model.layers.1.mlp.gate": "W8A8_SOMETHING_NEW",
                "model.layers.9.mlp.experts": {"quant_algo": "FP8"},
            },
        ),
        [W4A16] * 3,
    ),
    "plain string entries": (
        lambda p: _mixed(p, {EXPERTS.format(i): "W4A16_NVFP4" for i in LAYERS}),
        [W4A16] * 3,
    ),
}


@pytest.mark.parametrize("case", sorted(MODELOPT_OK))
def test_modelopt_declarations(tmp_path, case):
    mutate, modes = MODELOPT_OK[case]
    write(tmp_path)
    mutate(tmp_path)
    ckpt = NVFP4MoECheckpoint(tmp_path)
    assert [ckpt.quant_mode(i) for i in LAYERS] == modes


def _ct(path, groups, ignore=(), fmt="nvfp4-pack-quantized"):
    cfg = json.loads((path / "config.json").read_text())
    cfg["quantization_config"] = {
        "quant_method": "compressed-tensors",
        "format": fmt,
        "config_groups": groups,
        "ignore": list(ignore),
    }
    (path / "config.json").write_text(json.dumps(cfg))


NVFP4 = {"num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": 16}
FP8 = {"num_bits": 8, "type": "float", "strategy": "tensor"}


def _group(targets, acts=None, weights=NVFP4, fmt=None):
    g = {"targets": targets, "weights": weights, "input_activations": acts}
    return g if fmt is None else {**g, "format": fmt}


CT_OK = {
    "regex beats Linear": (
        {"a": _group(["Linear"], NVFP4), "b": _group([r"re:.*layers\.1\.mlp.*"])},
        [W4A4, W4A16, W4A4],
    ),
    "exact name beats regex": (
        {
            "a": _group([r"re:.*experts.*"], NVFP4),
            "b": _group(
                [
                    f"{EXPERTS.format(2)}.{e}.{p}"
                    for e in range(E)
                    for p in ("gate_proj", "up_proj", "down_proj")
                ]
            ),
        },
        [W4A4, W4A4, W4A16],
    ),
    "a group ranks by its most specific target": (
        {
            "a": _group([r"re:.*experts.*"], NVFP4),
            "b": _group(
                [
                    "Linear",
                    *(
                        f"{EXPERTS.format(2)}.{e}.{p}"
                        for e in range(E)
                        for p in ("gate_proj", "up_proj", "down_proj")
                    ),
                ]
            ),
        },
        [W4A4, W4A4, W4A16],
    ),
    "FP8 group for attention": (
        {
            "a": _group(["Linear"]),
            "f": _group([r"re:.*self_attn.*"], FP8, FP8, "float-quantized"),
        },
        [W4A16] * 3,
    ),
}


@pytest.mark.parametrize("case", sorted(CT_OK))
def test_compressed_tensors_declarations(tmp_path, case):
    groups, modes = CT_OK[case]
    write(tmp_path, COMPRESSED_TENSORS)
    _ct(tmp_path, groups)
    ckpt = NVFP4MoECheckpoint(tmp_path)
    assert [ckpt.quant_mode(i) for i in LAYERS] == modes


def _linears(layer, experts=12):
    return [
        f"model.layers.{layer}.mlp.experts.{e}.{p}"
        for e in range(experts)
        for p in ("gate_proj", "up_proj", "down_proj")
    ]


# target of the W4A16 group (the W4A4 one is "Linear") -> the layers it
# takes, of 1, 10 and 11. A ``re:`` pattern matches from the start of the
# name and may end anywhere (re.match, as compressed-tensors does): a
# pattern without ``.*`` in front takes nothing here. A plain name is one
# module's exact name, never a prefix: "model.layers.1" (a prefix of every
# linear of layers 1, 10 and 11) is no linear's name.
CT_TARGETS = {
    "re: unanchored tail": ([r"re:layers\.1\.mlp.*"], []),
    "re: from the start": ([r"re:model\.layers\.1\..*"], [1]),
    "re: .* in front": ([r"re:.*layers\.1\..*"], [1]),
    "re: prefix of 10 and 11": ([r"re:model\.layers\.1.*"], [1, 10, 11]),
    "re: open end": ([r"re:model\.layers\.1\.mlp"], [1]),
    "plain module name": (["model.layers.1"], []),
    "plain experts name": (["model.layers.1.mlp.experts"], []),
    "plain linear names": (_linears(1), [1]),
}


@pytest.mark.parametrize("case", sorted(CT_TARGETS))
def test_compressed_tensors_targets_match_as_compressed_tensors_does(case):
    from pathlib import Path

    from vllm.model_executor.model_loader.nvfp4_moe_quant_modes import (
        compressed_tensors_expert_modes,
    )

    targets, w4a16_layers = CT_TARGETS[case]
    qc = {
        "format": "nvfp4-pack-quantized",
        "config_groups": {"a": _group(["Linear"], NVFP4), "b": _group(targets)},
    }
    modes = compressed_tensors_expert_modes(qc, Path("config.json"), "qc")
    got = [
        layer
        for layer in (1, 10, 11)
        if modes.mode_of(f"model.layers.{layer}.mlp.experts", _linears(layer)) == W4A16
    ]
    assert got == w4a16_layers


HF, CFG = "hf_quant_config.json", "config.json"
# case -> (format, mutation, file named, message)
BAD_DECLARATIONS = {
    "unknown top-level algorithm": (
        MODELOPT,
        lambda p: _modelopt(p, {"quant_algo": "W4A8_NVFP4"}),
        HF,
        r"unsupported ModelOpt quant_algo 'W4A8_NVFP4' at quantization\.quant_algo",
    ),
    "algorithm not a string": (
        MODELOPT,
        lambda p: _modelopt(p, {"quant_algo": 4}),
        HF,
        r"quantization\.quant_algo must be an algorithm",
    ),
    "group size 32": (
        MODELOPT,
        lambda p: _modelopt(p, {"quant_algo": "W4A16_NVFP4", "group_size": 32}),
        HF,
        r"quantization\.group_size is 32",
    ),
    "quantized_layers without MIXED_PRECISION": (
        MODELOPT,
        lambda p: _modelopt(p, {"quant_algo": "NVFP4", "quantized_layers": _experts()}),
        HF,
        r"quantization\.quantized_layers is given but quantization\.quant_algo is "
        "'NVFP4'",
    ),
    "MIXED_PRECISION without quantized_layers": (
        MODELOPT,
        lambda p: _modelopt(p, {"quant_algo": "MIXED_PRECISION"}),
        HF,
        r"needs quantization\.quantized_layers",
    ),
    "quantized_layers a list": (
        MODELOPT,
        lambda p: _modelopt(
            p, {"quant_algo": "MIXED_PRECISION", "quantized_layers": ["x"]}
        ),
        HF,
        r"needs quantization\.quantized_layers.*got list",
    ),
    "layer not declared": (
        MODELOPT,
        lambda p: _mixed(
            p,
            {
                EXPERTS.format(0): {"quant_algo": "W4A16_NVFP4"},
                "model.layers.1.self_attn.q_proj": {"quant_algo": "FP8"},
                EXPERTS.format(2): {"quant_algo": "W4A16_NVFP4"},
            },
        ),
        HF,
        r"quantized_layers has no entry for model\.layers\.1\.mlp\.experts",
    ),
    "experts FP8": (
        MODELOPT,
        lambda p: _mixed(p, _experts("FP8")),
        HF,
        r"unsupported ModelOpt quant_algo 'FP8' at "
        r"quantization\.quantized_layers\['model\.layers\.0\.mlp\."
        r"experts'\]\.quant_algo for routed experts",
    ),
    "experts entry group size": (
        MODELOPT,
        lambda p: _mixed(p, _experts(group_size=128)),
        HF,
        r"quantized_layers\['model\.layers\.0\.mlp\.experts'\]\.group_size is 128",
    ),
    "module and linear contradict": (
        MODELOPT,
        lambda p: _mixed(p, {**_experts(), **_per_linear(1, "NVFP4", [3])}),
        HF,
        r"contradicts itself for model\.layers\.1\.mlp\.experts: "
        r"'model\.layers\.1\.mlp\.experts' is w4a16, "
        r"'model\.layers\.1\.mlp\.experts\.3\.down_proj' is w4a4",
    ),
    "linears contradict": (
        MODELOPT,
        lambda p: _mixed(
            p,
            {
                **_experts(),
                **{
                    k: v
                    for k, v in _per_linear(0, "NVFP4").items()
                    if "experts.0." not in k
                },
                **_per_linear(0, "W4A16_NVFP4", [0]),
            },
        ),
        HF,
        "contradicts itself",
    ),
    "some linears undeclared": (
        MODELOPT,
        lambda p: _mixed(
            p,
            {
                **{k: v for k, v in _experts().items() if "layers.2" not in k},
                **_per_linear(2, "W4A16_NVFP4", range(E - 1)),
            },
        ),
        HF,
        r"model\.layers\.2\.mlp\.experts\.7\.down_proj \(3 missing\)",
    ),
    "modelopt in config.json, unknown": (
        MODELOPT,
        lambda p: _ct_like_modelopt(p, {"quant_algo": "INT4_AWQ"}),
        CFG,
        r"'INT4_AWQ' at quantization_config\.quant_algo",
    ),
    "modelopt in config.json, nested mixed": (
        MODELOPT,
        lambda p: _ct_like_modelopt(
            p,
            {"quantization": {"quant_algo": "MIXED_PRECISION", "quantized_layers": {}}},
        ),
        CFG,
        r"needs quantization_config\.quantization\.quantized_layers",
    ),
    "ct activations 8-bit": (
        COMPRESSED_TENSORS,
        lambda p: _ct(p, {"g": _group(["Linear"], FP8)}),
        CFG,
        r"quantization_config\.config_groups\['g'\]\.input_activations is",
    ),
    "ct no input_activations key": (
        COMPRESSED_TENSORS,
        lambda p: _ct(p, {"g": {"targets": ["Linear"], "weights": NVFP4}}),
        CFG,
        r"config_groups\['g'\] has no input_activations",
    ),
    "ct weights not NVFP4": (
        COMPRESSED_TENSORS,
        lambda p: _ct(p, {"g": _group(["Linear"], None, {**NVFP4, "group_size": 32})}),
        CFG,
        r"config_groups\['g'\]\.weights is .*needs num_bits 4",
    ),
    "ct two groups, same rank": (
        COMPRESSED_TENSORS,
        lambda p: _ct(p, {"a": _group(["Linear"]), "b": _group(["Linear"], NVFP4)}),
        CFG,
        r"'a' and 'b' both target model\.layers\.0\.mlp\.experts\.0\.down_proj",
    ),
    "ct experts ignored": (
        COMPRESSED_TENSORS,
        lambda p: _ct(p, {"a": _group(["Linear"])}, ignore=[r"re:.*layers\.2\..*"]),
        CFG,
        r"quantization_config\.ignore entry '.*' excludes the expert linear "
        r"model\.layers\.2",
    ),
    "ct experts not targeted": (
        COMPRESSED_TENSORS,
        lambda p: _ct(p, {"a": _group([r"re:.*self_attn.*"])}),
        CFG,
        r"no target of quantization_config\.config_groups matches the expert "
        r"linear model\.layers\.0",
    ),
    "ct experts in an FP8 group": (
        COMPRESSED_TENSORS,
        lambda p: _ct(
            p,
            {
                "a": _group([r"re:.*self_attn.*"], fmt="nvfp4-pack-quantized"),
                "f": _group([r"re:.*experts.*"], FP8, FP8, "float-quantized"),
            },
            fmt="mixed-precision",
        ),
        CFG,
        r"config_groups\['f'\] targets the expert linear .* but is not "
        "'nvfp4-pack-quantized'",
    ),
    "ct no NVFP4 group": (
        COMPRESSED_TENSORS,
        lambda p: _ct(p, {"f": _group(["Linear"], FP8, FP8)}, fmt="float-quantized"),
        CFG,
        r"no group of quantization_config\.config_groups is 'nvfp4-pack-quantized'",
    ),
    "ct bad pattern": (
        COMPRESSED_TENSORS,
        lambda p: _ct(p, {"a": _group(["re:(("])}),
        CFG,
        r"targets: bad pattern 're:\(\('",
    ),
    "ct targets not a list": (
        COMPRESSED_TENSORS,
        lambda p: _ct(p, {"a": _group("Linear")}),
        CFG,
        r"config_groups\['a'\]\.targets must be a list of strings",
    ),
    "ct layer split across modes": (
        COMPRESSED_TENSORS,
        lambda p: _ct(
            p, {"a": _group(["Linear"]), "b": _group([r"re:.*down_proj"], NVFP4)}
        ),
        CFG,
        r"gives model\.layers\.0\.mlp\.experts's expert linears different modes",
    ),
}


def _ct_like_modelopt(path, qc):
    (path / "hf_quant_config.json").unlink()
    cfg = json.loads((path / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "modelopt", **qc}
    (path / "config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize("case", sorted(BAD_DECLARATIONS))
def test_bad_declarations_name_the_file_and_key(tmp_path, case):
    fmt, mutate, file, message = BAD_DECLARATIONS[case]
    write(tmp_path, fmt)
    mutate(tmp_path)
    with pytest.raises(ValueError, match=message) as err:
        NVFP4MoECheckpoint(tmp_path)
    assert str(err.value).startswith(str(tmp_path / file) + ":"), err.value


# --- the writer ---------------------------------------------------------------


def test_writer_refuses_bad_modes(tmp_path):
    for bad in ("w8a8", {0: W4A16}, {0: W4A16, 1: W4A4, 2: "nvfp4"}):
        with pytest.raises(ValueError, match="quant_mode must be 'w4a4' or"):
            write(tmp_path, quant_mode=bad)
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("fmt", [MODELOPT, COMPRESSED_TENSORS])
@pytest.mark.parametrize("quant", [W4A16, "mixed"])
def test_writer_cli(tmp_path, capsys, fmt, quant):
    args = [
        str(tmp_path),
        "--format",
        fmt,
        "--quant",
        quant,
        "--num-layers",
        "3",
        "--num-experts",
        "4",
        "--top-k",
        "2",
        "--hidden-size",
        "128",
        "--intermediate-size",
        "64",
    ]
    writer.main(args)
    assert f"({fmt}, {quant})" in capsys.readouterr().out
    ckpt = NVFP4MoECheckpoint(tmp_path)
    want = [W4A16] * 3 if quant == W4A16 else [W4A16, W4A4, W4A16]
    assert [ckpt.quant_mode(i) for i in range(3)] == want
    if fmt == MODELOPT:
        algo = _quant_json(tmp_path)["quant_algo"]
        assert algo == ("W4A16_NVFP4" if quant == W4A16 else "MIXED_PRECISION")


def test_writer_cli_per_layer_and_bad_quant(tmp_path, capsys):
    writer.main(
        [
            str(tmp_path),
            "--quant",
            W4A16,
            "--per-layer",
            "--num-layers",
            "1",
            "--num-experts",
            "4",
            "--top-k",
            "2",
            "--hidden-size",
            "128",
            "--intermediate-size",
            "64",
        ]
    )
    q = _quant_json(tmp_path)
    assert q["quant_algo"] == "MIXED_PRECISION"
    assert q["quantized_layers"][EXPERTS.format(0)]["quant_algo"] == "W4A16_NVFP4"
    assert NVFP4MoECheckpoint(tmp_path).quant_mode(0) == W4A16
    with pytest.raises(SystemExit) as exit_:
        writer.main([str(tmp_path / "x"), "--quant", "w4a8"])
    assert exit_.value.code == 2
    assert "invalid choice: 'w4a8'" in capsys.readouterr().err
