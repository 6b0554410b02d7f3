# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Where the tests of tests/upstream run: which vLLM release is installed and
expected, running a snippet against the unmodified release in a subprocess,
and loading this repository's own pure-torch helpers by file path.

Nothing here imports vllm or flashinfer at module level: the normal slice
suite imports this file while collecting tests/upstream, to skip it.

Three interpreters' views of ``vllm`` are involved:

* the *installed* vllm: the one in site-packages of the running interpreter
  (in ``.venv-upstream``: a fork wheel, "vLLM <release> + this branch",
  ``<release>+nvfp4moe``);
* the *unmodified* release: the untouched unpacked release wheel that
  ``tools/build_fork_wheel.py`` keeps (``$VLLM_FORK_UPSTREAM_TREE``, default
  ``build/fork/<release>/upstream``), imported ahead of site-packages
  through ``PYTHONPATH`` in a subprocess;
* this repository's slice (``<repo>/vllm``): never imported by these tests;
  single pure-torch files of it are loaded by path under private names.

The release the tests expect is ``$VLLM_UPSTREAM_RELEASE`` (the README's
command sets it for each run), else the installed fork's. The upstream
environment is *active* when that variable is set, when the interpreter is
this repository's ``.venv-upstream``, or when ``import vllm`` would load a
pip-installed vllm rather than the slice: then a missing piece (not the
fork, another release, no unmodified tree) fails every test instead of
skipping it.
"""

from __future__ import annotations

import ast
import importlib.metadata
import importlib.util
import json
import os
import re
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path
from types import ModuleType
from typing import Any

__all__ = [
    "FLASHINFER_VERSION",
    "FORK_LABEL",
    "RELEASE_ENV",
    "REPO_ROOT",
    "SLICE_VLLM",
    "SUPPORTED_RELEASES",
    "UPSTREAM_COMMAND",
    "UPSTREAM_TREE_ENV",
    "UPSTREAM_VERSION",
    "SnippetError",
    "environment_active",
    "expected_release",
    "installed_vllm_problem",
    "installed_vllm_version",
    "load_slice_module",
    "run_installed_json",
    "run_python_json",
    "run_unmodified_json",
    "unmodified_tree",
    "unmodified_tree_problem",
]

REPO_ROOT = Path(__file__).resolve().parents[2]
#: This repository's own vllm package (the slice). Only it counts as "the
#: slice": a venv inside the repository (.venv-upstream) is not.
SLICE_VLLM = REPO_ROOT / "vllm"
HERE = Path(__file__).resolve().parent

#: The releases the fork is built into (tools/fork_manifest.toml).
SUPPORTED_RELEASES = ("0.34.0", "0.33.0")
#: Names the release the tests expect; the README's command sets it.
RELEASE_ENV = "VLLM_UPSTREAM_RELEASE"
#: The fork wheel's local version label: ``<release>+nvfp4moe[.g<sha>[.dirty]]``.
FORK_LABEL = "nvfp4moe"
#: FlashInfer's release whose host code the tests run (requirements/
#: upstream-cpu.txt pins it; vLLM 0.33.0 pins 0.7.2.post1, 0.34.0 0.7.3).
FLASHINFER_VERSION = "0.7.4"
UPSTREAM_TREE_ENV = "VLLM_FORK_UPSTREAM_TREE"
#: How to run these tests for real; every skip reason names it.
UPSTREAM_COMMAND = (
    "the command in README.md, '## Tests inside vLLM 0.34.0 and 0.33.0 (CPU)' "
    "(builds .venv-upstream, then runs `(cd tests/upstream && python -m "
    "pytest)` once per release)"
)

_FORK_VERSION_RE = re.compile(
    r"(?P<release>\d+\.\d+\.\d+)\+" + FORK_LABEL + r"(\.[0-9A-Za-z]+)*"
)
# Default timeout of a snippet: an import of vLLM alone takes ~20 s on 2
# cores, the import walk about as long again.
_SNIPPET_TIMEOUT_S = 900


def _site_dirs() -> list[Path]:
    paths = sysconfig.get_paths()
    return [Path(paths[k]).resolve() for k in ("purelib", "platlib")]


def _is_within(path: Path, parent: Path) -> bool:
    try:
        path.relative_to(parent)
    except ValueError:
        return False
    return True


def installed_vllm_version() -> str | None:
    """The version of the installed vllm distribution (metadata only), or
    None when there is none."""
    try:
        return importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        return None


def _loads_slice() -> bool:
    try:
        spec = importlib.util.find_spec("vllm")
    except (ImportError, ValueError):
        return False
    return bool(
        spec and spec.origin and _is_within(Path(spec.origin).resolve(), SLICE_VLLM)
    )


def environment_active() -> bool:
    """Whether the upstream environment is active (see the module doc):
    ``$VLLM_UPSTREAM_RELEASE`` set, this repository's ``.venv-upstream``
    running, or a pip-installed vllm that is not the slice."""
    if os.environ.get(RELEASE_ENV):
        return True
    if Path(sys.prefix).resolve() == (REPO_ROOT / ".venv-upstream").resolve():
        return True
    return installed_vllm_version() is not None and not _loads_slice()


def expected_release() -> str:
    """The release the tests expect: ``$VLLM_UPSTREAM_RELEASE``, else the
    installed fork's release, else the newest supported one. Metadata only."""
    wanted = os.environ.get(RELEASE_ENV)
    if wanted:
        return wanted
    version = installed_vllm_version() or ""
    match = _FORK_VERSION_RE.fullmatch(version)
    if match and match.group("release") in SUPPORTED_RELEASES:
        return match.group("release")
    return SUPPORTED_RELEASES[0]


#: The release these tests run inside (:func:`expected_release`).
UPSTREAM_VERSION = expected_release()


def installed_vllm_problem() -> str | None:
    """Why this interpreter cannot run tests/upstream, or None if it can.

    It can when ``import vllm`` would load the fork of the expected release
    (``<release>+nvfp4moe[...]``, :func:`expected_release`, one of
    :data:`SUPPORTED_RELEASES`) installed by pip, not this repository's
    slice, and flashinfer-python 0.7.4 is installed. Installed by pip: in
    this interpreter's site-packages, or in a directory of ``PYTHONPATH``
    that ``pip install --target`` wrote (its dist-info there has pip's
    ``INSTALLER`` file; an unpacked wheel such as
    ``build/fork/<release>/upstream`` has none). Looks only at import specs
    and package metadata: imports neither package."""
    if UPSTREAM_VERSION not in SUPPORTED_RELEASES:
        return (
            f"{RELEASE_ENV}={UPSTREAM_VERSION} is not a supported release "
            f"(supported: {', '.join(SUPPORTED_RELEASES)})"
        )
    try:
        spec = importlib.util.find_spec("vllm")
    except (ImportError, ValueError) as e:
        return f"vllm cannot be located ({type(e).__name__}: {e})"
    if spec is None or spec.origin is None:
        return "vllm is not installed"
    location = Path(spec.origin).resolve().parent
    if _is_within(location, SLICE_VLLM):
        return (
            f"`import vllm` loads this repository's slice ({location}), not an "
            f"installed vLLM {UPSTREAM_VERSION} fork"
        )
    try:
        dist = importlib.metadata.distribution("vllm")
    except importlib.metadata.PackageNotFoundError:
        return f"vllm at {location} has no installed distribution metadata"
    in_site = any(_is_within(location, site) for site in _site_dirs())
    if not in_site and not dist.read_text("INSTALLER"):
        return (
            f"`import vllm` loads {location}, which is neither in site-packages "
            "nor installed there by `pip install --target`"
        )
    if Path(dist.locate_file("vllm")).resolve() != location:
        return (
            f"the installed vllm distribution ({dist.version}) is not the one "
            f"`import vllm` loads ({location})"
        )
    match = _FORK_VERSION_RE.fullmatch(dist.version)
    if match is None:
        return (
            f"installed vllm is {dist.version}, not the fork "
            f"({UPSTREAM_VERSION}+{FORK_LABEL}, tools/build_fork_wheel.py)"
        )
    if match.group("release") != UPSTREAM_VERSION:
        return (
            f"installed vllm is {dist.version}, the fork of "
            f"{match.group('release')}, but the tests expect {UPSTREAM_VERSION} "
            f"({RELEASE_ENV})"
        )
    try:
        fi_version = importlib.metadata.version("flashinfer-python")
    except importlib.metadata.PackageNotFoundError:
        return "flashinfer-python is not installed"
    if fi_version != FLASHINFER_VERSION:
        return f"flashinfer-python is {fi_version}, not {FLASHINFER_VERSION}"
    return None


def unmodified_tree() -> Path:
    """The unpacked, untouched release: ``$VLLM_FORK_UPSTREAM_TREE``
    (relative paths from the repository root), default
    ``build/fork/<release>/upstream`` as ``tools/build_fork_wheel.py`` leaves
    it. The directory that holds ``vllm/``, i.e. what goes on
    ``PYTHONPATH``."""
    default = f"build/fork/{UPSTREAM_VERSION}/upstream"
    tree = Path(os.environ.get(UPSTREAM_TREE_ENV) or default)
    return tree if tree.is_absolute() else REPO_ROOT / tree


def unmodified_tree_problem() -> str | None:
    """Why the unmodified release cannot be run, or None if it can: the tree
    is missing or is not the expected release (read from its
    ``vllm/_version.py``)."""
    tree = unmodified_tree()
    version_file = tree / "vllm" / "_version.py"
    if not version_file.is_file():
        return (
            f"no unmodified vLLM {UPSTREAM_VERSION} tree at {tree} (run "
            f"`python tools/build_fork_wheel.py`, or set {UPSTREAM_TREE_ENV} "
            f"to an unpacked vllm-{UPSTREAM_VERSION} wheel)"
        )
    match = re.search(
        r"__version__\s*=.*?['\"]([^'\"]+)['\"]", version_file.read_text()
    )
    if match is None or match.group(1) != UPSTREAM_VERSION:
        found = match.group(1) if match else "no __version__"
        return f"{version_file} says {found}, not {UPSTREAM_VERSION}"
    return None


class SnippetError(RuntimeError):
    """A snippet run by :func:`run_python_json` failed; the message carries
    its exit status and the end of its stderr."""


# Runs the snippet as __main__, then writes its global ``result`` and the
# file of the vllm it imported (if any) as JSON to argv[2].
_WRAPPER = """\
import json, runpy, sys
g = runpy.run_path(sys.argv[1], run_name="__main__")
vllm = sys.modules.get("vllm")
out = {"result": g.get("result"), "vllm_file": getattr(vllm, "__file__", None)}
with open(sys.argv[2], "w") as f:
    json.dump(out, f)
"""


def run_python_json(
    snippet: str,
    *,
    pythonpath: list[Path] | tuple[Path, ...] = (),
    timeout: float = _SNIPPET_TIMEOUT_S,
    env: dict[str, str] | None = None,
) -> tuple[Any, str | None]:
    """Run ``snippet`` in a fresh interpreter (this one's executable) and
    return (its global ``result``, JSON round-tripped; the ``__file__`` of the
    vllm it imported, or None).

    ``sys.path`` of the child: ``pythonpath`` first, then this directory
    (tests/upstream, so the snippet can import the helpers here), then this
    process's own ``PYTHONPATH`` (a ``pip install --target`` directory
    holding the installed vllm), then the interpreter's own; never the
    repository root, whose ``vllm/`` would shadow the installed one. The
    child runs in a temporary directory.
    Raises :class:`SnippetError` if it exits non-zero or writes no result.
    """
    with tempfile.TemporaryDirectory(prefix="upstream-snippet-") as tmp:
        script, wrapper, out = (Path(tmp) / n for n in ("s.py", "w.py", "o.json"))
        script.write_text(snippet)
        wrapper.write_text(_WRAPPER)
        child_env = {**os.environ, **(env or {})}
        inherited = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
        child_env["PYTHONPATH"] = os.pathsep.join(
            str(p) for p in (*pythonpath, HERE, *inherited)
        )
        proc = subprocess.run(
            [sys.executable, str(wrapper), str(script), str(out)],
            cwd=tmp,
            env=child_env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        if proc.returncode != 0 or not out.is_file():
            raise SnippetError(
                f"snippet exited with status {proc.returncode}; stderr ends:\n"
                f"{proc.stderr[-4000:]}"
            )
        data = json.loads(out.read_text())
    return data["result"], data["vllm_file"]


def run_installed_json(snippet: str, **kwargs: Any) -> Any:
    """:func:`run_python_json` against the installed vllm; checks that the
    child imported it from site-packages (not the repository's slice)."""
    result, vllm_file = run_python_json(snippet, **kwargs)
    if vllm_file is not None and _is_within(Path(vllm_file).resolve(), SLICE_VLLM):
        raise SnippetError(f"the child imported this repository's vllm: {vllm_file}")
    return result


def run_unmodified_json(snippet: str, **kwargs: Any) -> Any:
    """:func:`run_python_json` against the unmodified release
    (:func:`unmodified_tree` first on ``PYTHONPATH``); checks that the child
    imported vllm from that tree. Call :func:`unmodified_tree_problem` first
    (the fixture ``unmodified_upstream`` skips on it)."""
    tree = unmodified_tree().resolve()
    result, vllm_file = run_python_json(snippet, pythonpath=[tree], **kwargs)
    if vllm_file is not None and not _is_within(Path(vllm_file).resolve(), tree):
        raise SnippetError(f"the child imported vllm from {vllm_file}, not {tree}")
    return result


def _vllm_imports(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append(node.module)
    return [m for m in found if m == "vllm" or m.startswith("vllm.")]


def load_slice_module(relpath: str) -> ModuleType:
    """Load one file of this repository's slice, e.g.
    ``"vllm/utils/mem_utils.py"``, or of its test helpers outside this
    directory (``"tests/kernels/moe/moe_reference.py"``: the reference
    MoE), as a module named ``_slice_<path>``
    (``_slice_vllm_utils_mem_utils``), without putting the repository on
    ``sys.path``: the installed vllm stays what ``import vllm`` loads.

    Only for files that import nothing from vllm (pure torch and the
    standard library): a ``vllm`` import would bind the installed package's
    module, mixing the two, so such a file is refused with ValueError.
    Loaded once per process; later calls return the same module."""
    path = (REPO_ROOT / relpath).resolve()
    in_tree = _is_within(path, SLICE_VLLM) or (
        _is_within(path, REPO_ROOT / "tests") and not _is_within(path, HERE)
    )
    if not in_tree or path.suffix != ".py":
        raise ValueError(
            f"{relpath!r} is not a .py file of this repository's vllm/ or tests/ "
            "(outside tests/upstream)"
        )
    name = "_slice_" + re.sub(r"\W", "_", str(path.relative_to(REPO_ROOT))[:-3])
    if name in sys.modules:
        return sys.modules[name]
    if imports := _vllm_imports(path):
        raise ValueError(
            f"{relpath} imports {', '.join(imports)}; loaded by path it would "
            "bind the installed vllm's modules"
        )
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    # dataclasses and pickling look the module up by name while it executes.
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module
