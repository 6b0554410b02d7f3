# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""SIGINT as a terminal delivers it, for tests that send one.

A process started with SIGINT ignored (``nohup pytest tests > log &``; any
``&`` job of a shell without job control) passes that disposition to every
process it starts, and Python, started with SIGINT ignored, installs no
KeyboardInterrupt handler: a test's Ctrl-C would then do nothing, and a
test waiting for its effect would wait out its timeout. A test that sends
SIGINT sets up the disposition it needs: in this process with
:func:`sigint_raises_keyboard_interrupt`, in the processes it starts with
``preexec_fn=reset_sigint_in_child``.
"""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Iterator

__all__ = ["reset_sigint_in_child", "sigint_raises_keyboard_interrupt"]


@contextlib.contextmanager
def sigint_raises_keyboard_interrupt() -> Iterator[None]:
    """Python's own SIGINT handler (``signal.default_int_handler``: Ctrl-C
    raises KeyboardInterrupt) while the block runs, whatever this process
    inherited; the previous handler afterwards. Main thread only (where
    handlers can be set: pytest runs tests there)."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def reset_sigint_in_child() -> None:
    """``preexec_fn`` for ``subprocess``: the child starts with SIGINT's
    default disposition, not an inherited SIG_IGN, so a Python child installs
    its KeyboardInterrupt handler as it would in a terminal."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
