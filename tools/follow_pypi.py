# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The newest vLLM release on PyPI against tools/fork_manifest.toml.

    python tools/follow_pypi.py [--json FILE] [--wheel PATH]

Every release the manifest supports must still be PyPI's bytes (the wheel
and sdist sha256 in PyPI's JSON API): otherwise exit 1. The newest release,
if the manifest lacks it, is downloaded (its wheel, or --wheel) and each
definition the branch replaces, edits or relies on is compared with the
newest supported release's: drifted or not. A newer release never fails it.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import urllib.request
import zipfile
from collections.abc import Sequence
from pathlib import Path

import libcst as cst
from packaging.version import Version

try:
    from tools.build_fork_wheel import _fetch
    from tools.fork_branch import (
        BranchError,
        Manifest,
        Release,
        load_manifest,
        source_hash,
    )
except ImportError:  # run as `python tools/follow_pypi.py`
    from build_fork_wheel import _fetch
    from fork_branch import BranchError, Manifest, Release, load_manifest, source_hash

__all__ = ["drift_report", "main", "supported_problems"]

PYPI = "https://pypi.org/pypi/vllm/json"


def supported_problems(manifest: Manifest, pypi: dict) -> list[str]:
    """Each supported release file whose sha256 PyPI no longer has."""
    out = []
    for v, r in manifest.releases.items():
        files = {
            f["filename"]: f["digests"]["sha256"] for f in pypi["releases"].get(v, [])
        }
        for name, sha in ((r.wheel, r.wheel_sha256), (r.sdist, r.sdist_sha256)):
            if files.get(name) != sha:
                out.append(f"{v}: {name}: PyPI has sha256 {files.get(name)}, not {sha}")
    return out


def drift_report(manifest: Manifest, wheel: Path) -> list[tuple[str, str, str]]:
    """(path, definition, "unchanged" / "drifted" / "gone") for each hashed
    definition, against the newest supported release's sha256."""
    newest = max(manifest.releases, key=Version)
    recorded: dict[str, dict[str, str]] = {}
    for e in manifest.files:
        recorded.setdefault(e.path, {}).update(e.sha256.get(newest, {}))
    out = []
    with zipfile.ZipFile(wheel) as z:
        for path, hashes in recorded.items():
            try:
                module = cst.parse_module(z.read(path).decode("utf-8"))
            except KeyError:
                out += [(path, name, "gone") for name in hashes]
                continue
            for name, want in hashes.items():
                try:
                    got = source_hash(module, name)
                except BranchError:
                    got = None
                state = (
                    "gone" if got is None else "unchanged" if got == want else "drifted"
                )
                out.append((path, name, state))
    return out


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="follow_pypi", description=__doc__.split("\n")[0])
    p.add_argument("--json", type=Path, help="PyPI's JSON of vllm (default: fetch it)")
    p.add_argument(
        "--wheel", type=Path, help="the newest release's wheel (a local copy)"
    )
    args = p.parse_args(argv)
    try:
        manifest = load_manifest()
        if args.json:
            pypi = json.loads(args.json.read_text(encoding="utf-8"))
        else:
            with urllib.request.urlopen(PYPI, timeout=60) as response:
                pypi = json.load(response)
        problems = supported_problems(manifest, pypi)
        latest = pypi["info"]["version"]
        if latest in manifest.releases:
            print(f"{latest}: supported (the newest on PyPI)")
        else:
            ours = manifest.releases[max(manifest.releases, key=Version)]
            name = ours.wheel.replace(ours.version, latest, 1)
            files = {f["filename"]: f for f in pypi["releases"].get(latest, [])}
            if name not in files:
                raise BranchError(f"PyPI has no {name} for vllm {latest}")
            sha = files[name]["digests"]["sha256"]
            release = Release(latest, name, sha, "", "", {})
            with tempfile.TemporaryDirectory() as tmp:
                rows = drift_report(manifest, _fetch(release, args.wheel, Path(tmp)))
            drifted = [f"{n} ({p})" for p, n, s in rows if s != "unchanged"]
            kept = [n for p, n, s in rows if s == "unchanged"]
            print(f"{latest}: not supported yet (the newest supported: {ours.version})")
            print(f"  drifted or gone: {', '.join(drifted) or 'none'}")
            print(f"  unchanged: {', '.join(kept) or 'none'}")
    except (BranchError, OSError, ValueError, KeyError) as exc:
        print(f"follow_pypi: error: {exc}", file=sys.stderr)
        return 2
    for problem in problems:
        print(
            f"follow_pypi: a supported release changed on PyPI: {problem}",
            file=sys.stderr,
        )
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
