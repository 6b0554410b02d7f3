# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""``weight_prep_steps.refill_binding``: the tensors derived from the
weights are copied into the previous binding's (their addresses stay, for a
captured CUDA graph); a view of a parameter is the parameter's own, never a
copy into an earlier tensor."""

import dataclasses

import torch

from vllm.model_executor.layers.fused_moe.weight_prep_steps import refill_binding


@dataclasses.dataclass
class _Binding:
    view: torch.Tensor
    alpha: torch.Tensor
    other_shape: torch.Tensor
    other_dtype: torch.Tensor


def _layer(values):
    layer = torch.nn.Module()
    layer.w = torch.nn.Parameter(torch.tensor(values), requires_grad=False)
    return layer


def test_derived_tensors_refilled_views_of_parameters_kept():
    before = _layer([1.0, 2.0, 3.0])  # the parameter of the earlier binding
    old = _Binding(
        view=before.w.view(3),
        alpha=torch.tensor([5.0, 6.0]),
        other_shape=torch.tensor([7.0]),
        other_dtype=torch.tensor([8.0]),
    )
    old_view_bytes = old.view.clone()
    layer = _layer([10.0, 20.0, 30.0])  # the parameter now (new storage)
    new = _Binding(
        view=layer.w.view(3),
        alpha=torch.tensor([0.5, 0.25]),
        other_shape=torch.tensor([1.0, 2.0]),
        other_dtype=torch.tensor([9], dtype=torch.int32),
    )
    out = refill_binding(old, new, layer)
    # The view: the parameter's own storage, the earlier tensor untouched.
    assert out.view.data_ptr() == layer.w.data_ptr()
    assert torch.equal(before.w.detach(), old_view_bytes)
    # A derived tensor of the same shape, dtype and device: the old one,
    # holding the new values.
    assert out.alpha is old.alpha
    assert torch.equal(old.alpha, torch.tensor([0.5, 0.25]))
    # Another shape or dtype: the new tensor, the old one untouched.
    assert out.other_shape is new.other_shape
    assert torch.equal(old.other_shape, torch.tensor([7.0]))
    assert out.other_dtype is new.other_dtype
    assert torch.equal(old.other_dtype, torch.tensor([8.0]))


def test_no_previous_binding_returns_the_new_one():
    layer = _layer([1.0])
    new = _Binding(layer.w.view(1), torch.ones(1), torch.ones(1), torch.ones(1))
    assert refill_binding(None, new, layer) is new
