# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The newest vLLM release on PyPI against tools/fork_manifest.toml.

    python tools/follow_pypi.py [--json FILE] [--wheel PATH]

Exit 1 if a supported release is no longer PyPI's bytes; a newer release is
reported (its drifted definitions), never a failure.
"""

from __future__ import annotations

import json
import sys
import tempfile
import urllib.request
import zipfile
from collections.abc import Sequence
from pathlib import Path

import libcst as cst
from packaging.version import Version

from fork_cst import source_hash
from fork_manifest import Manifest, Release, load_manifest
from tool_cli import ToolError, command, parser

__all__ = ["drift_report", "main", "supported_problems"]

PYPI = "https://pypi.org/pypi/vllm/json"


def _files(pypi: dict, version: str) -> dict[str, str]:
    return {
        f["filename"]: f["digests"]["sha256"] for f in pypi["releases"].get(version, [])
    }


def supported_problems(manifest: Manifest, pypi: dict) -> list[str]:
    """Each supported release file whose sha256 PyPI no longer has."""
    out = []
    for v, r in manifest.releases.items():
        files = _files(pypi, v)
        for name, sha in ((r.wheel, r.wheel_sha256), (r.sdist, r.sdist_sha256)):
            if name not in files:
                out.append(f"{v}: {name}: no longer on PyPI")
            elif files[name] != sha:
                out.append(f"{v}: {name}: PyPI has sha256 {files[name]}, not {sha}")
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
                module = None
            for name, want in hashes.items():
                try:
                    got = source_hash(module, name) if module else None
                except ToolError:  # not found, or defined twice
                    got = None
                same = {None: "gone", want: "unchanged"}.get(got, "drifted")
                out.append((path, name, same))
    return out


def main(argv: Sequence[str] | None = None) -> int:
    p = parser(__doc__, releases=False)
    p.add_argument("--json", type=Path, help="PyPI's JSON of vllm (default: fetch it)")
    p.add_argument("--wheel", type=Path, help="the newest release's wheel (a copy)")
    args = p.parse_args(argv)

    def body() -> int:
        manifest = load_manifest()
        if args.json:
            pypi = json.loads(args.json.read_text(encoding="utf-8"))
        else:
            with urllib.request.urlopen(PYPI, timeout=60) as response:
                pypi = json.load(response)
        try:
            latest = pypi["info"]["version"]
            problems = supported_problems(manifest, pypi)
        except (KeyError, TypeError) as exc:
            raise ToolError(f"PyPI's JSON lacks {exc}") from None
        if latest in manifest.releases:
            print(f"{latest}: supported (the newest on PyPI)")
        else:
            ours = manifest.releases[max(manifest.releases, key=Version)]
            name = ours.wheel.replace(ours.version, latest, 1)
            if name not in (files := _files(pypi, latest)):
                raise ToolError(f"PyPI has no {name} for vllm {latest}")
            with tempfile.TemporaryDirectory() as tmp:
                local = [args.wheel] if args.wheel else []
                release = Release(latest, name, files[name])
                rows = drift_report(manifest, release.fetch("wheel", Path(tmp), local))
            drifted = [f"{n} ({p})" for p, n, s in rows if s != "unchanged"]
            kept = [n for p, n, s in rows if s == "unchanged"]
            print(f"{latest}: not supported yet (the newest supported: {ours.version})")
            print(f"  drifted or gone: {', '.join(drifted) or 'none'}")
            print(f"  unchanged: {', '.join(kept) or 'none'}")
        for problem in problems:
            print(
                f"follow_pypi: a supported release changed on PyPI: {problem}",
                file=sys.stderr,
            )
        return 1 if problems else 0

    return command("follow_pypi", body)


if __name__ == "__main__":
    sys.exit(main())
