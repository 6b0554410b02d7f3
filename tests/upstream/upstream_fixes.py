# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Probes of what a vLLM release does around the definitions the branch
replaces, run alike in the installed fork and in the unmodified release
(upstream_env.run_unmodified_json): each returns a JSON-able report that
the tests compare between the two.

* :func:`refill_probe`: ``make_nvfp4_moe_quant_config`` called twice for
  one layer with different activation scales (0.34.0 refills the layer's
  ``_a1_gscale`` / ``_a2_gscale`` in place; 0.33.0 allocates new ones);
* :func:`keep_constants_probe`: what the ModelOpt method's preparation
  hands to ``FusedMoEExperts.keep_constants`` (0.34.0) and keeps on the
  layer;
* :func:`compressed_tensors_alias_probe`: how the compressed-tensors method
  names the packed weights after preparation (0.34.0: ``move_parameter``);
* :func:`kernel_assembly_probe`: which of the oracle's functions build the
  kernel (0.34.0: ``NvFp4MoEKernelOracle``, ``make_moe_kernel``);
* :func:`cutedsl_probe`: the CuteDSL preparation's bytes, with 0.34.0's
  per-die shards (two locality domains stood in on CPU).

Call inside ``cpu_stand_ins.b12x_preparation_on_cpu`` where a layer is
prepared (the probes that need it enter it themselves).
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any
from unittest import mock

import torch

from cpu_stand_ins import b12x_preparation_on_cpu
from upstream_layers import SMALL, one_rank_vllm, prepare_layer

__all__ = [
    "MUTANTS",
    "compressed_tensors_alias_probe",
    "cutedsl_probe",
    "keep_constants_probe",
    "kernel_assembly_probe",
    "planted",
    "refill_probe",
]

_ORACLE = "vllm.model_executor.layers.fused_moe.oracle.nvfp4"
_FP4_MOE = "vllm.model_executor.layers.quantization.utils.flashinfer_fp4_moe"


def _digest(t: torch.Tensor) -> str:
    data = t.detach().contiguous().view(torch.uint8).numpy()
    return hashlib.sha256(data).hexdigest()[:16]


def _scales(e: int, seed: int) -> dict[str, torch.Tensor]:
    """Block and global scales of a tiny layer (E experts, I = 128, H = 256):
    what ``make_nvfp4_moe_quant_config`` reads; values of real magnitude."""
    gen = torch.Generator().manual_seed(seed)
    fp8 = torch.float8_e4m3fn
    return {
        "w13_scale": (torch.rand(e, 256, 16, generator=gen) * 400 + 40).to(fp8),
        "w2_scale": (torch.rand(e, 256, 8, generator=gen) * 400 + 40).to(fp8),
        "w13_scale_2": torch.rand(e, generator=gen) * 1e-2 + 1e-3,
        "w2_scale_2": torch.rand(e, generator=gen) * 1e-2 + 1e-3,
    }


def refill_probe() -> dict[str, Any]:
    """For FLASHINFER_B12X and FLASHINFER_CUTLASS: build the quant config for
    one layer twice, with activation scales ``a`` then ``b`` (same shape,
    other values), and report whether the second config's ``a1_gscale`` /
    ``a2_gscale`` share the first's storage, whether the first config then
    holds ``1 / b``, whether the layer holds them as ``_a1_gscale`` /
    ``_a2_gscale``, and the values (rounded to 6 digits)."""
    oracle = importlib.import_module(_ORACLE)
    e = 4
    scales = _scales(e, 0)
    a = (torch.full((e,), 0.25), torch.full((e,), 0.5))
    b = (torch.full((e,), 0.125), torch.full((e,), 2.0))
    out: dict[str, Any] = {}
    for backend in ("FLASHINFER_B12X", "FLASHINFER_CUTLASS"):
        layer = torch.nn.Module()

        def make(a13, a2, layer=layer, backend=backend):
            return oracle.make_nvfp4_moe_quant_config(
                backend=oracle.NvFp4MoeBackend[backend],
                a13_scale=a13,
                a2_scale=a2,
                layer=layer,
                **scales,
            )

        first = make(*a)
        ptrs = (first.a1_gscale.data_ptr(), first.a2_gscale.data_ptr())
        second = make(*b)
        report = {}
        for name, i in (("a1_gscale", 0), ("a2_gscale", 1)):
            held = getattr(layer, f"_{name}", None)
            report[name] = {
                "same_storage": getattr(second, name).data_ptr() == ptrs[i],
                "first_sees_new": torch.equal(getattr(first, name), 1.0 / b[i]),
                "held_by_layer": held is not None and held is getattr(second, name),
                "value": [round(v, 6) for v in getattr(second, name).tolist()],
            }
        out[backend] = report
    return out


def keep_constants_probe(checkpoint_format: str = "modelopt") -> dict[str, Any]:
    """Prepare the small layer (``moe_backend="flashinfer_b12x"``) with every
    call of ``FusedMoEExperts.keep_constants`` recorded: the calls (experts
    class, whether the argument was the layer), the experts' ``kept_constants``
    and the ``_experts_*`` attributes the layer holds afterwards. Releases
    without ``keep_constants`` report ``has_keep_constants: False``."""
    mk = importlib.import_module("vllm.model_executor.layers.fused_moe.modular_kernel")
    base = mk.FusedMoEExperts
    calls: list[dict[str, Any]] = []
    real = getattr(base, "keep_constants", None)
    layer_box: dict[str, Any] = {}

    def spy(self, layer, *args, **kwargs):
        calls.append(
            {
                "experts": type(self).__name__,
                "is_the_layer": layer is layer_box.get("layer"),
                "kept_constants": list(getattr(self, "kept_constants", ())),
            }
        )
        return real(self, layer, *args, **kwargs)

    patch = (
        mock.patch.object(base, "keep_constants", spy)
        if real is not None
        else contextlib.nullcontext()
    )
    with b12x_preparation_on_cpu(), one_rank_vllm("flashinfer_b12x"):
        make = importlib.import_module("upstream_layers").make_nvfp4_moe_layer
        with (
            mock.patch(
                "upstream_layers.make_nvfp4_moe_layer",
                side_effect=lambda *a, **k: layer_box.setdefault(
                    "layer", make(*a, **k)
                ),
            ),
            patch,
        ):
            layer, _, _ = prepare_layer(SMALL, checkpoint_format)
        kept = sorted(n for n in vars(layer) if n.startswith("_experts_"))
    return {
        "has_keep_constants": real is not None,
        "calls": calls,
        "kept_on_layer": kept,
        "experts": type(layer.quant_method.moe_kernel.fused_experts).__name__,
    }


def compressed_tensors_alias_probe() -> dict[str, Any]:
    """After the compressed-tensors method prepared the small layer: each
    registered parameter name, grouped by the Parameter object it names, the
    ``runtime_name`` each object carries, and whether the packed names still
    resolve on the layer."""
    with b12x_preparation_on_cpu(), one_rank_vllm("flashinfer_b12x"):
        layer, _, _ = prepare_layer(SMALL, "compressed-tensors")
        groups: dict[int, list[str]] = {}
        for name, param in layer._parameters.items():
            if param is not None:
                groups.setdefault(id(param), []).append(name)
        objects = {id(p): p for p in layer._parameters.values() if p is not None}
        return {
            "aliases": sorted(sorted(names) for names in groups.values()),
            "runtime_names": sorted(
                getattr(objects[k], "runtime_name", None) or "" for k in groups
            ),
            "packed_names_resolve": {
                n: hasattr(layer, n) for n in ("w13_weight_packed", "w2_weight_packed")
            },
        }


def kernel_assembly_probe() -> dict[str, Any]:
    """Prepare the small ModelOpt layer with the oracle's kernel builders
    recorded: which of ``NvFp4MoEKernelOracle.try_backend`` /
    ``return_or_raise`` and ``oracle.base.make_moe_kernel`` ran (releases
    without them report them absent), the kernel's experts and
    prepare/finalize classes."""
    oracle = importlib.import_module(_ORACLE)
    ran: dict[str, int] = {}
    patches: list[Any] = []
    cls = getattr(oracle, "NvFp4MoEKernelOracle", None)
    for owner, attr, key in (
        (cls, "try_backend", "NvFp4MoEKernelOracle.try_backend"),
        (cls, "return_or_raise", "NvFp4MoEKernelOracle.return_or_raise"),
        (oracle, "make_moe_kernel", "make_moe_kernel"),
    ):
        real = getattr(owner, attr, None) if owner is not None else None
        if real is None:
            ran[key] = -1  # absent in this release
            continue
        ran[key] = 0

        def counted(*args, _real=real, _key=key, **kwargs):
            ran[_key] += 1
            return _real(*args, **kwargs)

        patches.append(mock.patch.object(owner, attr, counted))
    with contextlib.ExitStack() as stack:
        for p in patches:
            stack.enter_context(p)
        stack.enter_context(b12x_preparation_on_cpu())
        stack.enter_context(one_rank_vllm("flashinfer_b12x"))
        layer, _, _ = prepare_layer(SMALL, "modelopt")
        kernel = layer.quant_method.moe_kernel
        impl = getattr(kernel, "impl", kernel)
        return {
            "ran": ran,
            "experts": type(kernel.fused_experts).__name__,
            "prepare_finalize": type(impl.prepare_finalize).__name__,
            "backend": layer.quant_method.nvfp4_backend.name,
        }


@contextlib.contextmanager
def _two_locality_domains(fp4_moe: Any) -> Iterator[bool]:
    """0.34.0's ``get_localized_resources`` answering two compute domains
    without pools, and the CUDA memory-pool and stream calls of the per-die
    sharding made no-ops on CPU; yields whether the release has them."""
    localization = None
    with contextlib.suppress(ImportError):
        localization = importlib.import_module("vllm.distributed.localization")
    if localization is None or not hasattr(fp4_moe, "_shard_nvfp4_moe_weights_per_die"):
        yield False
        return
    res = SimpleNamespace(num_split=2, pools=[None, None])
    stream = SimpleNamespace(synchronize=lambda: None)
    with (
        mock.patch.object(localization, "get_localized_resources", lambda *a: res),
        mock.patch.object(
            torch.cuda, "use_mem_pool", lambda pool: contextlib.nullcontext()
        ),
        mock.patch.object(torch.cuda, "current_stream", lambda *a: stream),
    ):
        yield True


def cutedsl_probe() -> dict[str, Any]:
    """``prepare_nvfp4_moe_layer_for_flashinfer_cutedsl`` on a small gated
    layer (E=4, I=128, H=256; synthetic bytes): digests of what it returns
    and, where the release has per-die shards, of each shard parameter it
    registers (two domains stood in)."""
    fp4_moe = importlib.import_module(_FP4_MOE)
    activation = importlib.import_module(
        "vllm.model_executor.layers.fused_moe.activation"
    ).MoEActivation.SILU
    e, i, h = 4, 128, 256
    gen = torch.Generator().manual_seed(3)
    fp8 = torch.float8_e4m3fn
    w13 = torch.randint(0, 256, (e, 2 * i, h // 2), generator=gen, dtype=torch.uint8)
    w2 = torch.randint(0, 256, (e, h, i // 2), generator=gen, dtype=torch.uint8)
    s13 = (torch.rand(e, 2 * i, h // 16, generator=gen) * 400 + 40).to(fp8)
    s2 = (torch.rand(e, h, i // 16, generator=gen) * 400 + 40).to(fp8)
    layer = torch.nn.Module()
    layer.activation = activation
    layer.moe_config = SimpleNamespace(
        moe_parallel_config=SimpleNamespace(enable_eplb=False),
        intermediate_size_per_partition=i,
        hidden_dim=h,
        hidden_dim_unpadded=None,
    )
    with b12x_preparation_on_cpu(), _two_locality_domains(fp4_moe) as localized:
        out = fp4_moe.prepare_nvfp4_moe_layer_for_flashinfer_cutedsl(
            layer,
            w13,
            s13,
            torch.full((e,), 2e-3),
            torch.full((e, 2), 0.02),
            w2,
            s2,
            torch.full((e,), 3e-3),
            torch.full((e,), 0.03),
        )
    shards = {
        name: _digest(p) for name, p in layer.named_parameters() if "localized" in name
    }
    return {
        "localized": localized,
        "outputs": [_digest(t) for t in out],
        "shapes": [list(t.shape) for t in out],
        "shards": shards,
        "num_shards": len(getattr(layer, "localized_shards", []) or []),
    }


#: Planted changes (:func:`planted`) and the probe each must change.
MUTANTS = {
    "values": "refill_probe",  # activation scales doubled
    "no_refill": "refill_probe",  # new gscales where the release refills
    "cutedsl_rows": "cutedsl_probe",  # block-scale rows reversed
}


@contextlib.contextmanager
def planted(mutant: str) -> Iterator[None]:
    """One of :data:`MUTANTS` planted in the running vllm: the negative
    controls of the comparisons."""
    if mutant == "cutedsl_rows":
        fp4 = importlib.import_module(_FP4_MOE)
        real_swizzle = fp4.swizzle_blockscale
        with mock.patch.object(
            fp4, "swizzle_blockscale", lambda s: real_swizzle(s.flip(1))
        ):
            yield
        return
    oracle = importlib.import_module(_ORACLE)
    real = oracle.make_nvfp4_moe_quant_config

    def make(*args, layer=None, a13_scale=None, a2_scale=None, **kwargs):
        if mutant == "values":
            a13_scale, a2_scale = a13_scale * 2, a2_scale * 2
        else:
            layer = None  # nothing refilled
        return real(
            *args, layer=layer, a13_scale=a13_scale, a2_scale=a2_scale, **kwargs
        )

    with mock.patch.object(oracle, "make_nvfp4_moe_quant_config", make):
        yield
