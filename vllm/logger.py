# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""``init_logger``: a standard logger with vLLM's ``*_once`` methods."""

from __future__ import annotations

import logging
from collections.abc import Hashable
from types import MethodType

__all__ = ["init_logger"]

_SEEN: set[tuple[str, int, str, tuple]] = set()


def _once(level: int):
    def log_once(self: logging.Logger, msg: str, *args: Hashable, **_: object):
        key = (self.name, level, msg, args)
        if key not in _SEEN:
            _SEEN.add(key)
            self.log(level, msg, *args, stacklevel=2)

    return log_once


_ONCE_METHODS = {
    "debug_once": _once(logging.DEBUG),
    "info_once": _once(logging.INFO),
    "warning_once": _once(logging.WARNING),
}


def init_logger(name: str) -> logging.Logger:
    """``logging.getLogger(name)`` with ``debug_once``, ``info_once`` and
    ``warning_once`` (a message with the same arguments is logged once per
    process), as vLLM's ``init_logger`` provides them."""
    logger = logging.getLogger(name)
    for method_name, method in _ONCE_METHODS.items():
        setattr(logger, method_name, MethodType(method, logger))
    return logger
