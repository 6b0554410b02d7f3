# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Repository tools that are not part of the vllm package."""

__all__: list[str] = []
