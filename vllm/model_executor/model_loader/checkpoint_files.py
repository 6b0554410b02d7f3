# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Checkpoint directories on disk: reading their files safely, writing them whole.

Reading: every file is opened before it is checked (:func:`open_inside`:
no-follow, component by component below the checkpoint directory, then
``fstat`` on the descriptor), and read through that descriptor
(:func:`read_json`, :func:`safe_open_inside`), so a path swapped for a
symlink between a check and an open cannot lead outside the directory.

Writing: :func:`whole_directory` gives a fresh directory beside the target
and renames it into place at the end, so an interrupted write leaves no
half-written checkpoint; a non-empty target is refused unless overwritten.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import secrets
import shutil
import stat
from collections.abc import Iterator
from pathlib import Path

from safetensors import safe_open

__all__ = [
    "check_target",
    "get_dict",
    "open_inside",
    "read_json",
    "safe_open_inside",
    "whole_directory",
]


# -- reading ----------------------------------------------------------------------
def open_inside(path: Path, root: Path, what: str) -> int:
    """A read-only descriptor of the regular file ``path``, which must lie
    inside ``root`` (symlinks inside ``root`` are followed, ``..`` and
    symlinks leaving it are refused). ValueError naming ``what`` otherwise.

    Opened first, checked second: the path is resolved, then every
    component below ``root`` is opened relative to the descriptor of the one
    above it with ``O_NOFOLLOW``, so a component swapped for a symlink after
    the check fails to open instead of leading outside; the file is opened
    with ``O_NONBLOCK`` (a FIFO would block) and ``os.fstat`` on the
    descriptor decides whether it is a regular file. Callers read through
    the descriptor, never the path again. The caller closes it.
    """
    root_real = Path(os.path.realpath(root))
    resolved = Path(os.path.realpath(path))
    if not resolved.is_relative_to(root_real):
        raise ValueError(
            f"{what}: {path} resolves to {resolved}, outside the checkpoint "
            f"directory {root}"
        )
    parts = resolved.relative_to(root_real).parts
    flags = os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW
    fd = -1
    try:
        fd = os.open(root_real, os.O_RDONLY | os.O_CLOEXEC | os.O_DIRECTORY)
        for i, part in enumerate(parts):
            last = i == len(parts) - 1
            extra = os.O_NONBLOCK if last else os.O_DIRECTORY
            child = os.open(part, flags | extra, dir_fd=fd)
            os.close(fd)
            fd = child
        mode = os.fstat(fd).st_mode
    except OSError as e:
        if fd >= 0:
            os.close(fd)
        if e.errno in (errno.ELOOP, errno.ENOTDIR):
            raise ValueError(
                f"{what}: {path} changed while it was opened (a symlink or "
                "not a directory where the checked path had none)"
            ) from None
        raise ValueError(f"{what}: cannot read {path} ({e.strerror})") from None
    if not parts or not stat.S_ISREG(mode):
        os.close(fd)
        raise ValueError(f"{what}: {path} is not a regular file")
    return fd


@contextlib.contextmanager
def safe_open_inside(path: Path, root: Path, what: str):
    """``safe_open`` of the regular file ``path`` inside ``root``, read
    through the descriptor :func:`open_inside` checked (its
    ``/proc/self/fd`` entry: safetensors maps the file, so memory stays one
    tensor at a time; it takes no descriptor or file object). ValueError
    naming ``path`` when it is not a readable safetensors file."""
    fd = open_inside(path, root, what)
    try:
        fd_dir = "/proc/self/fd" if os.path.isdir("/proc/self/fd") else "/dev/fd"
        try:
            handle = safe_open(f"{fd_dir}/{fd}", framework="pt", device="cpu")
        except Exception as e:  # safetensors raises its own error types
            raise ValueError(f"{path}: not a readable safetensors file ({e})") from None
        with handle as f:
            yield f
    finally:
        os.close(fd)


def _no_duplicate_keys(pairs: list[tuple[str, object]]) -> dict:
    out: dict = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"duplicate key {key!r}")
        out[key] = value
    return out


def read_json(path: Path, root: Path | None = None) -> dict:
    """A JSON object from a regular file inside ``root`` (default: its folder),
    read through the descriptor :func:`open_inside` checked."""
    fd = open_inside(path, root or path.parent, str(path))
    try:
        with os.fdopen(fd, "rb") as f:
            data = json.loads(f.read(), object_pairs_hook=_no_duplicate_keys)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None
    except RecursionError:
        raise ValueError(
            f"{path}: not valid JSON (nested too deeply for the parser)"
        ) from None
    except ValueError as e:  # a duplicate key
        raise ValueError(f"{path}: {e}") from None
    except OSError as e:
        raise ValueError(f"{path}: cannot read ({e.strerror})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def get_dict(d: dict, key: str, path: Path, default: dict | None = None) -> dict:
    """``d[key]`` when it is a JSON object; ``default`` when absent (if given)."""
    if key not in d and default is not None:
        return default
    value = d.get(key)
    if not isinstance(value, dict):
        raise ValueError(
            f"{path}: {key!r} must be a JSON object, got {type(value).__name__}"
        )
    return value


# -- writing ----------------------------------------------------------------------
def check_target(out: Path, overwrite: bool, flag: str = "overwrite=True") -> None:
    """ValueError unless ``out`` is absent, an empty directory, or (with
    ``overwrite``) a directory; ``flag`` names the way to overwrite."""
    if out.is_symlink():
        raise ValueError(f"{out}: is a symlink; give the directory itself")
    if not out.exists():
        return
    if not out.is_dir():
        raise ValueError(f"{out}: exists and is not a directory")
    if not overwrite and any(out.iterdir()):
        raise ValueError(f"{out}: directory is not empty ({flag} replaces it)")


def _sibling(out: Path, what: str, create: bool) -> Path:
    """A fresh hidden name beside ``out`` (created as a directory, mode
    0o777 less the umask, when ``create``)."""
    while True:
        path = out.parent / f".{out.name}.{what}-{os.getpid()}-{secrets.token_hex(4)}"
        if not create:
            if not (path.exists() or path.is_symlink()):
                return path
            continue
        try:
            os.mkdir(path)
            return path
        except FileExistsError:
            continue


def _move_into_place(tmp: Path, out: Path) -> None:
    """Rename the finished directory ``tmp`` to ``out``; an existing ``out``
    (checked by :func:`check_target`) is renamed aside first and removed
    after, or put back when the second rename fails."""
    if not out.exists():
        os.rename(tmp, out)
        return
    if not any(out.iterdir()):
        os.rename(tmp, out)  # replaces an empty directory in one step
        return
    old = _sibling(out, "old", create=False)
    os.rename(out, old)
    try:
        os.rename(tmp, out)
    except BaseException:
        os.rename(old, out)
        raise
    shutil.rmtree(old, ignore_errors=True)


@contextlib.contextmanager
def whole_directory(out: str | os.PathLike, overwrite: bool = False) -> Iterator[Path]:
    """Write a directory whole or not at all: yields a new empty directory
    beside ``out`` (mode 0o777 less the umask) to write into; when the block
    ends it is renamed to ``out``, and on any error (Ctrl-C included) it is
    removed, so ``out`` is never half-written (a SIGKILL leaves the hidden
    ``.<name>.partial-*`` beside it, never a partial ``out``). ValueError from
    :func:`check_target` first (and again before the rename)."""
    out = Path(out)
    check_target(out, overwrite)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = _sibling(out, "partial", create=True)
    try:
        yield tmp
        check_target(out, overwrite)  # it may have changed meanwhile
        _move_into_place(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
