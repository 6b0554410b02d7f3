# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The fork's in-place preparation inside upstream's own code paths: never a
silently wrong layer.

* ``process_weights_after_loading`` twice on upstream's method: ModelOpt
  prepares nothing again (bytes unchanged, function right); compressed-
  tensors' own method renames ``w13_weight_packed`` and cannot run twice:
  it raises AttributeError before touching anything.
* Interrupted inside the experts' preparation (a TorchFunctionMode raising
  at the k-th torch call, at several k): apply refuses in between; calling
  upstream's ``process_weights_after_loading`` again gives the bytes of an
  uninterrupted preparation (ModelOpt), or its AttributeError
  (compressed-tensors: then the experts' own call resumes).
* Reloaded through upstream's ``RoutedExperts.weight_loader`` (the
  parameters' ``weight_loader``, upstream's shard ids) after the
  preparation: without a restore, apply and a re-preparation refuse; with
  ``experts.restore_load_layout(layer)`` first, the new weights prepare to
  the bytes of a fresh layer loaded with them.
* Upstream's layerwise reload (model_loader/reload) driven for the one
  layer: recorded, see the test.
"""

import pytest
from torch.overrides import TorchFunctionMode
from upstream_reload import load_through_weight_loader
from upstream_reports import (
    emulated_apply,
    experts_apply,
    function_errors,
    moe_inputs,
    prepared_b12x_report,
)

from upstream_env import UPSTREAM_VERSION
from upstream_layers import (
    REL_RMS_TOLERANCE,
    SMALL,
    load_synthetic_experts,
    make_nvfp4_moe_layer,
    prepare_layer,
    synthetic_nvfp4_experts,
)


class Interrupt(BaseException):
    """Stands in for KeyboardInterrupt (a BaseException)."""


class RaiseAtCall(TorchFunctionMode):
    """Raise :class:`Interrupt` instead of the ``k``-th torch call (1-based);
    ``k=None`` only counts."""

    def __init__(self, k: int | None = None):
        super().__init__()
        self.k, self.calls = k, 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.calls += 1
        if self.calls == self.k:
            raise Interrupt(f"call {self.k}: {getattr(func, '__name__', func)}")
        return func(*args, **(kwargs or {}))


def _experts(layer):
    return layer.quant_method.moe_kernel.fused_experts


def _apply_real(layer):
    """The real experts' apply on the layer (refuses before FlashInfer is
    reached when the layer is not prepared or was changed)."""
    x, weights, ids = moe_inputs(SMALL, 8, 0)
    return experts_apply(_experts(layer), layer, x, weights, ids)


def test_modelopt_prepared_twice_changes_nothing(one_rank_b12x_vllm):
    layer, experts, _ = prepare_layer(SMALL, "modelopt")
    before = prepared_b12x_report(layer, experts)
    layer.quant_method.process_weights_after_loading(layer)
    after = prepared_b12x_report(layer, experts)
    assert after["digests"] == before["digests"]
    for key in ("w1_alpha", "w2_alpha", "g1_alphas", "g2_alphas", "parameters"):
        assert after[key] == before[key], key
    errors = function_errors(layer, experts, SMALL)
    assert errors["rel_rms"] <= REL_RMS_TOLERANCE
    assert errors["rel_rms_gate_up_swapped"] > 10 * REL_RMS_TOLERANCE


def test_compressed_tensors_method_run_twice(one_rank_b12x_vllm):
    # 0.33.0's method renames w13_weight_packed -> w13_weight (and deletes the
    # former): a second call fails at once, before any write. 0.34.0's
    # registers the one parameter under both names (move_parameter): a second
    # call runs, and must change nothing.
    layer, experts, _ = prepare_layer(SMALL, "compressed-tensors")
    before = prepared_b12x_report(layer, experts, "compressed-tensors")
    if UPSTREAM_VERSION == "0.33.0":
        with pytest.raises(AttributeError, match="w13_weight_packed"):
            layer.quant_method.process_weights_after_loading(layer)
    else:
        assert layer.w13_weight_packed is layer.w13_weight
        layer.quant_method.process_weights_after_loading(layer)
    after = prepared_b12x_report(layer, experts, "compressed-tensors")
    assert after["digests"] == before["digests"]
    for key in ("w1_alpha", "w2_alpha", "g1_alphas", "g2_alphas", "parameters"):
        assert after[key] == before[key], key
    assert function_errors(layer, experts, SMALL)["rel_rms"] <= REL_RMS_TOLERANCE


@pytest.mark.parametrize("checkpoint_format", ["modelopt", "compressed-tensors"])
def test_interrupted_preparation_resumes_to_the_same_bytes(
    one_rank_b12x_vllm, monkeypatch, checkpoint_format
):
    from vllm.model_executor.layers.fused_moe.experts.flashinfer_b12x_moe import (
        FlashInferB12xExperts,
    )

    reference, _, _ = prepare_layer(
        SMALL, checkpoint_format, prefix="model.layers.8.mlp.experts"
    )
    want = prepared_b12x_report(
        reference, synthetic_nvfp4_experts(SMALL), checkpoint_format
    )
    # Count the torch calls inside the experts' own preparation.
    real = FlashInferB12xExperts.process_weights_after_loading
    mode: dict = {}

    def counted(self, layer):
        with RaiseAtCall(mode.get("k")) as counter:
            try:
                real(self, layer)
            finally:
                mode["calls"] = counter.calls

    monkeypatch.setattr(FlashInferB12xExperts, "process_weights_after_loading", counted)
    counting, _, _ = prepare_layer(
        SMALL, checkpoint_format, prefix="model.layers.7.mlp.experts"
    )
    total = mode["calls"]
    assert total > 20
    points = sorted({1, 2, total // 4, total // 2, (3 * total) // 4, total - 1})
    for n, k in enumerate(points):
        mode.pop("calls")
        mode["k"] = k
        prefix = f"model.layers.{10 + n}.mlp.experts"
        layer = make_nvfp4_moe_layer(SMALL, checkpoint_format, prefix=prefix)
        load_synthetic_experts(layer, synthetic_nvfp4_experts(SMALL), checkpoint_format)
        with pytest.raises(Interrupt):
            layer.quant_method.process_weights_after_loading(layer)
        mode["k"] = None
        # In between: refused, never computed on a half-prepared layer.
        with pytest.raises(RuntimeError, match="not prepared|before process_weights"):
            _apply_real(layer)
        with pytest.raises(RuntimeError, match="not prepared|before process_weights"):
            emulated_apply(layer, *moe_inputs(SMALL, 8, 0), bind=False)
        if checkpoint_format == "modelopt" or UPSTREAM_VERSION != "0.33.0":
            layer.quant_method.process_weights_after_loading(layer)
        else:
            # 0.33.0's method renamed w13_weight_packed before the experts
            # ran: its second call fails at once; the experts' resumes.
            with pytest.raises(AttributeError, match="w13_weight_packed"):
                layer.quant_method.process_weights_after_loading(layer)
            _experts(layer).process_weights_after_loading(layer)
        got = prepared_b12x_report(
            layer, synthetic_nvfp4_experts(SMALL), checkpoint_format
        )
        assert got["digests"] == want["digests"], k
        for key in ("w1_alpha", "w2_alpha", "g1_alphas", "g2_alphas"):
            assert got[key] == want[key], (k, key)
    del counting


def test_weight_loader_into_a_prepared_layer_is_refused(one_rank_b12x_vllm):
    layer, experts, _ = prepare_layer(SMALL, "modelopt")
    _experts(layer)._check_prepared()  # prepared: accepted
    new = synthetic_nvfp4_experts(SMALL, seed=1)
    versions = {n: p._version for n, p in layer.named_parameters()}
    # Refused at the first write (the guard runs at the events, not per call).
    with pytest.raises(RuntimeError, match="written through its weight_loader"):
        load_through_weight_loader(layer, new, "modelopt")
    # Upstream's loader writes param.data[...]: no version counter moved.
    assert {n: p._version for n, p in layer.named_parameters()} == versions
    with pytest.raises(RuntimeError, match="written through its weight_loader"):
        _apply_real(layer)
    with pytest.raises(RuntimeError, match="written through its weight_loader"):
        emulated_apply(layer, *moe_inputs(SMALL, 8, 0))
    with pytest.raises(RuntimeError, match="written through its weight_loader"):
        layer.quant_method.process_weights_after_loading(layer)


def test_restore_then_weight_loader_equals_a_fresh_layer(one_rank_b12x_vllm):
    layer, old, _ = prepare_layer(SMALL, "modelopt")
    new = synthetic_nvfp4_experts(SMALL, seed=1)
    _experts(layer).restore_load_layout(layer)
    load_through_weight_loader(layer, new, "modelopt")
    layer.quant_method.process_weights_after_loading(layer)
    reloaded = prepared_b12x_report(layer, new)

    fresh = make_nvfp4_moe_layer(SMALL, "modelopt", prefix="model.layers.1.mlp.experts")
    load_through_weight_loader(fresh, new, "modelopt")
    fresh.quant_method.process_weights_after_loading(fresh)
    want = prepared_b12x_report(fresh, new)
    assert reloaded["digests"] == want["digests"]
    for key in ("w1_alpha", "w2_alpha", "g1_alphas", "g2_alphas", "parameters"):
        assert reloaded[key] == want[key], key
    assert reloaded["w13_scale_bytes"] == "checkpoint"
    assert function_errors(layer, new, SMALL)["rel_rms"] <= REL_RMS_TOLERANCE
    # Control: the old weights' bytes are not the new ones'.
    assert prepared_b12x_report(layer, old)["w13_codes"] == "other"


def test_upstreams_layerwise_reload_of_one_layer(
    one_rank_b12x_vllm, upstream_measurements
):
    """Upstream's layerwise reload (record_metadata_for_reloading before the
    first preparation; initialize_layerwise_reload; every weight through
    the wrapped loaders, which process the layer once all are in;
    finalize_layerwise_reload) on one RoutedExperts layer. It re-creates the
    parameters in the load layout on the meta device, materializes them,
    loads, runs upstream's process_weights_after_loading on them and copies
    the results into the old (prepared) storages."""
    from vllm.model_executor.model_loader.reload import layerwise

    layer = make_nvfp4_moe_layer(SMALL, "modelopt")
    old = synthetic_nvfp4_experts(SMALL)
    new = synthetic_nvfp4_experts(SMALL, seed=1)
    layerwise.record_metadata_for_reloading(layer)
    load_through_weight_loader(layer, old, "modelopt")
    layer.quant_method.process_weights_after_loading(layer)
    layerwise.initialize_layerwise_reload(layer)
    try:
        load_through_weight_loader(layer, new, "modelopt")
        layerwise.finalize_layerwise_reload(layer, None)
    except RuntimeError as err:
        outcome = f"refused: {type(err).__name__}: {str(err)[:160]}"
        # The fork's experts see a layer whose parameters were all replaced
        # while its state says prepared: a clear error, nothing computed.
        assert "prepared MoE layer" in str(err) or "torn" in str(err), err
        with pytest.raises(RuntimeError):
            _apply_real(layer)
    else:
        fresh = make_nvfp4_moe_layer(
            SMALL, "modelopt", prefix="model.layers.1.mlp.experts"
        )
        load_through_weight_loader(fresh, new, "modelopt")
        fresh.quant_method.process_weights_after_loading(fresh)
        same = (
            prepared_b12x_report(layer, new)["digests"]
            == prepared_b12x_report(fresh, new)["digests"]
        )
        outcome = "ran; the bytes of a fresh layer: " + str(same)
        assert same
        assert function_errors(layer, new, SMALL)["rel_rms"] <= REL_RMS_TOLERANCE
    upstream_measurements("upstream layerwise reload of a fork-prepared layer", outcome)
