# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""What a W4A16, W4A4 or mixed NVFP4 checkpoint declares, hand-written in
both formats (ModelOpt, compressed-tensors): what the reader takes, the
targets it matches as compressed-tensors does, and the declarations it
refuses, naming the file and key."""

import json

import pytest

from tests.model_loader.nvfp4_ckpt_utils import (
    EXPERTS,
    W4A4,
    W4A16,
    E,
    write_layers,
)
from vllm.model_executor.model_loader.nvfp4_moe_checkpoint import (
    COMPRESSED_TENSORS,
    MODELOPT,
    NVFP4MoECheckpoint,
)

LAYERS = (0, 1, 2)


# --- declarations: both formats, hand-written ---------------------------------


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
    write_layers(tmp_path)
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
    write_layers(tmp_path, COMPRESSED_TENSORS)
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
    write_layers(tmp_path, fmt)
    mutate(tmp_path)
    with pytest.raises(ValueError, match=message) as err:
        NVFP4MoECheckpoint(tmp_path)
    assert str(err.value).startswith(str(tmp_path / file) + ":"), err.value
