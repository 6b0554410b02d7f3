# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""vLLM's environment variables, read when accessed
(``import vllm.envs as envs; envs.VLLM_MOE_PREP_VERIFY``)."""

import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    VLLM_MOE_PREP_VERIFY: bool = False
    VLLM_FLASHINFER_B12X_GLOBAL_SCALE_MODE: str = "alpha"


def env_with_choices(
    env_name: str,
    default: str | None,
    choices: list[str] | Callable[[], list[str]],
    case_sensitive: bool = True,
) -> Callable[[], str | None]:
    """A reader of ``env_name`` that accepts only ``choices`` (ValueError
    naming the variable and the options otherwise)."""

    def read() -> str | None:
        value = os.getenv(env_name)
        if value is None:
            return default
        options = choices() if callable(choices) else choices
        if case_sensitive:
            ok = value in options
        else:
            ok = value.lower() in [c.lower() for c in options]
        if not ok:
            raise ValueError(
                f"Invalid value '{value}' for {env_name}. Valid options: {options}."
            )
        return value

    return read


environment_variables: dict[str, Callable[[], Any]] = {
    # 1: a prepared MoE layer also checksums its parameters' bytes, and its
    # checks compare them (catches param.data.copy_, which the version
    # counter misses). A debug mode: each check reads every weight.
    "VLLM_MOE_PREP_VERIFY": lambda: bool(int(os.getenv("VLLM_MOE_PREP_VERIFY", "0"))),
    # How FlashInfer's b12x W4A4 MoE gets the weights' global scales:
    # "alpha" (the kernel's per-expert alphas; block scales as loaded) or
    # "fold" (multiplied into the FP8 block scales).
    "VLLM_FLASHINFER_B12X_GLOBAL_SCALE_MODE": env_with_choices(
        "VLLM_FLASHINFER_B12X_GLOBAL_SCALE_MODE", "alpha", ["alpha", "fold"]
    ),
}


def __getattr__(name: str) -> Any:
    if name in environment_variables:
        return environment_variables[name]()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return list(environment_variables)
