# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The router a MoE checkpoint's config declares, as ``FusedMoE`` computes it.

``FusedMoE`` routes as the softmax-routed Hugging Face MoE models do: softmax
over all experts' logits, the ``top_k`` largest, renormalized to sum to 1 when
``renormalize``. ``norm_topk_prob`` is ``renormalize`` where the architecture
reads it (defaults below); some architectures always renormalize; any other
routing (sigmoid scores, grouped top-k, a scaling factor) is refused.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["MoERouting", "moe_routing_from_config"]

#: Architectures whose router reads ``norm_topk_prob``, with the value their
#: config class defaults to when the file omits it.
_NORM_TOPK_PROB_DEFAULTS = {
    "qwen2_moe": False,
    "qwen3_moe": False,
    "olmoe": False,
    "qwen3_next": True,
}
#: Architectures whose router always renormalizes the top-k weights.
_ALWAYS_RENORMALIZE = frozenset(
    {"mixtral", "qwen3_5_moe", "qwen3_5_moe_text", "qwen3_vl_moe", "qwen3_vl_moe_text"}
)
#: Architectures that route with sigmoid scores, a score-correction bias and
#: grouped top-k.
_SIGMOID_ROUTED = frozenset(
    {"deepseek_v3", "deepseek_v32", "glm4_moe", "glm4_moe_lite", "nemotron_h"}
)
#: Keys that change the routing away from softmax top-k, with the values
#: that leave it unchanged.
_NEUTRAL = {
    "scoring_func": (None, "softmax"),
    "topk_method": (None, "greedy"),
    "n_group": (None, 1),
    "topk_group": (None, 1),
    "routed_scaling_factor": (None, 1, 1.0),
}


@dataclass(frozen=True)
class MoERouting:
    """Softmax top-k routing: ``FusedMoE(top_k=top_k, renormalize=...)``.

    Attributes:
        top_k: experts per token.
        renormalize: the top-k weights are rescaled to sum to 1.
        source: where ``renormalize`` came from (the key, or the
            architecture's rule), for messages and reports.
    """

    top_k: int
    renormalize: bool
    source: str

    def layer_kwargs(self) -> dict[str, Any]:
        """``FusedMoE`` keyword arguments for this routing."""
        return {"top_k": self.top_k, "renormalize": self.renormalize}


def moe_routing_from_config(config: dict, top_k: int, where: str) -> MoERouting:
    """The routing ``config`` (a model's text config: ``model_type``,
    ``norm_topk_prob``, ...) declares, for experts picking ``top_k``.

    Raises:
        ValueError: naming ``where`` (the config file) and the key: a
            routing other than softmax top-k (see the module doc), a
            ``norm_topk_prob`` that is not a bool or that contradicts an
            architecture that always renormalizes, or no ``norm_topk_prob``
            for an architecture whose default is not known.
    """
    model_type = config.get("model_type")
    if model_type in _SIGMOID_ROUTED:
        raise ValueError(
            f"{where}: model_type {model_type!r} routes with sigmoid scores, a "
            "score-correction bias and grouped top-k, not the softmax top-k "
            "FusedMoE computes here"
        )
    for key, neutral in _NEUTRAL.items():
        value = config.get(key)
        if value not in neutral or isinstance(value, bool):
            raise ValueError(
                f"{where}: {key} = {value!r} is a routing FusedMoE does not "
                f"compute here (softmax top-k: {key} absent or one of "
                f"{[v for v in neutral if v is not None]})"
            )
    norm = config.get("norm_topk_prob")
    if norm is not None and not isinstance(norm, bool):
        raise ValueError(f"{where}: norm_topk_prob must be true or false, got {norm!r}")
    if model_type in _ALWAYS_RENORMALIZE:
        if norm is False:
            raise ValueError(
                f"{where}: norm_topk_prob is false, but model_type "
                f"{model_type!r} always renormalizes its top-k weights"
            )
        return MoERouting(top_k, True, f"model_type {model_type}")
    if norm is not None:
        return MoERouting(top_k, norm, "norm_topk_prob")
    if model_type in _NORM_TOPK_PROB_DEFAULTS:
        default = _NORM_TOPK_PROB_DEFAULTS[model_type]
        return MoERouting(top_k, default, f"norm_topk_prob default of {model_type}")
    raise ValueError(
        f"{where}: no norm_topk_prob, and model_type {model_type!r} has no "
        "known default: whether the top-k weights are renormalized is not "
        "declared (set norm_topk_prob)"
    )
