# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""argparse types and the parser class shared by the command lines."""

from __future__ import annotations

import argparse
import os
import re
from collections.abc import Callable

__all__ = [
    "CommandLineParser",
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


# A negative number or size given as a value ("-5MiB", "-.5G", "-1").
_NEGATIVE_VALUE = re.compile(r"^-\.?[0-9]")


class CommandLineParser(argparse.ArgumentParser):
    """``argparse.ArgumentParser`` for the command lines here, and for their
    ``add_subparsers`` sub-commands, with three differences:

    * No abbreviations: ``--num-layer 1`` is an unknown option, not
      ``--num-layers``.
    * A value that starts with ``-`` and a digit is a value, never an
      option: ``--memory-limit -5MiB`` reaches the option's type and its
      message.
    * An argument error is two lines on stderr, status 2: the error, then a
      hint to ``--help``.
    """

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def _parse_optional(self, arg_string):
        # argparse's hook that decides "option or value" for one string
        # (None: a value); only negative numbers without units pass it.
        if _NEGATIVE_VALUE.match(arg_string):
            return None
        return super()._parse_optional(arg_string)

    def error(self, message: str):
        """Print ``<prog>: error: <message>`` and the ``--help`` hint to
        stderr and exit with status 2 (argparse's status for bad arguments)."""
        self.exit(
            2,
            f"{self.prog}: error: {message}\n"
            f"Try '{self.prog} --help' for more information.\n",
        )


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
