# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""argparse types shared by the command lines."""

from __future__ import annotations

import argparse
from collections.abc import Callable

__all__ = ["int_at_least", "non_negative_int", "positive_int"]


def int_at_least(minimum: int) -> Callable[[str], int]:
    """An argparse type: an integer >= ``minimum``, else a one-line error
    ("expected an integer, got 'x'" / "must be at least 1, got 0")."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected an integer, got {text!r}"
            ) from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}, got {value}")
        return value

    parse.__name__ = f"int_at_least_{minimum}"
    return parse


positive_int = int_at_least(1)
non_negative_int = int_at_least(0)
