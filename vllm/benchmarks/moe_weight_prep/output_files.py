# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Output files of the benchmarks: checked before the run
(:func:`check_output_path`), written whole (:func:`write_atomically`)."""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Callable, Iterator

__all__ = ["check_output_path", "plot_formats", "write_atomically"]

#: matplotlib formats refused: they need a program this tool does not
#: require (pgf: a LaTeX installation, for text metrics).
_UNWRITABLE_FORMATS = {"pgf"}


def plot_formats() -> dict[str, str]:
    """File extensions matplotlib writes here -> its description of them."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.backend_bases import FigureCanvasBase

    formats = FigureCanvasBase.get_supported_filetypes()
    return {k: v for k, v in formats.items() if k not in _UNWRITABLE_FORMATS}


def check_output_path(path: str, flag: str, plot: bool = False) -> str:
    """The file that ``flag path`` will write, or ValueError (one line) now,
    not after the run.

    With ``plot``, the format comes from the extension; a path without one
    gets ".png" (what matplotlib itself would write): the returned path is
    the file written. Checked: not a directory, the directory exists, a file
    can be created in it (tried: permission bits do not tell, e.g. for root
    or in /proc), the format is one matplotlib writes.
    """
    target = path
    if os.path.isdir(path):
        raise ValueError(f"{flag} {path}: is a directory")
    if plot:
        ext = os.path.splitext(path)[1].lower().lstrip(".")
        if not ext:
            target, ext = path + ".png", "png"
        formats = plot_formats()
        if ext not in formats:
            raise ValueError(
                f"{flag} {path}: unknown plot format {ext!r}; use one of "
                + ", ".join(sorted(formats))
            )
    full = os.path.abspath(target)
    parent = os.path.dirname(full)
    if os.path.isdir(full):
        raise ValueError(f"{flag} {path}: is a directory")
    if not os.path.isdir(parent):
        raise ValueError(f"{flag} {path}: directory {parent} does not exist")
    if os.path.exists(full) and not os.access(full, os.W_OK):
        raise ValueError(f"{flag} {path}: not writable")
    try:
        with tempfile.NamedTemporaryFile(dir=parent, prefix=".vllm-check-"):
            pass
    except OSError as e:
        raise ValueError(
            f"{flag} {path}: cannot write in {parent}: {e.strerror or e}"
        ) from None
    return target


@contextlib.contextmanager
def _temporary_beside(path: str) -> Iterator[str]:
    parent = os.path.dirname(os.path.abspath(path))
    base = os.path.basename(path)
    # Same extension: writers that pick the format by it see the real one.
    fd, tmp = tempfile.mkstemp(
        dir=parent, prefix=f".{base}.", suffix=os.path.splitext(base)[1]
    )
    os.close(fd)
    try:
        yield tmp
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def write_atomically(path: str, write: Callable[[str], None]) -> None:
    """``write(tmp)`` to a temporary file beside ``path``, then rename it to
    ``path`` (readable like any new file: mode 0666 less the umask). On any
    exception, Ctrl-C included, the temporary file is removed and ``path``
    is left as it was."""
    with _temporary_beside(path) as tmp:
        write(tmp)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)
        os.replace(tmp, path)
