# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""argparse types shared by the command lines."""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable

__all__ = [
    "RunError",
    "available_cores",
    "core_count",
    "int_at_least",
    "non_negative_int",
    "positive_int",
]


class RunError(RuntimeError):
    """A command failed after its arguments were accepted (its run, or
    writing its results): the command line reports it in one line and exits
    with status 1, without the usage that argument errors (status 2) get."""


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


def available_cores() -> int:
    """The CPU cores this process may run on (its affinity mask where the
    platform has one, else ``os.cpu_count()``)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def core_count(text: str) -> int:
    """An argparse type for a number of cores to keep busy: an integer from 0
    to :func:`available_cores` (read when the argument is parsed), else a
    one-line error. More would start processes the machine cannot run."""
    value = non_negative_int(text)
    cores = available_cores()
    if value > cores:
        raise argparse.ArgumentTypeError(
            f"must be at most {cores} (the cores this process may run on), got {value}"
        )
    return value
