# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Build vLLM's release wheels with the branch applied (tools/fork_manifest.toml).

    python tools/build_fork_wheel.py [--release V] [--wheel PATH] [--out dist]

Writes dist/vllm-<V>+<local_label>-<tags>.whl and keeps build/fork/<V>/upstream
and build/fork/<V>/fork; built in build/fork/<V>/.partial, moved into place last.
"""

from __future__ import annotations

import os
import re
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path

from packaging.requirements import InvalidRequirement, Requirement
from packaging.utils import canonicalize_name, parse_wheel_filename
from packaging.version import Version

from fork_branch import apply_branch
from fork_manifest import Manifest, Release, load_manifest
from tool_cli import ROOT, ToolError, command, parser, run

__all__ = ["build_release", "main", "rewrite_metadata"]

# Zip timestamps of the built wheel (wheel pack honours it): same bytes twice.
_EPOCH = {"SOURCE_DATE_EPOCH": "315532800"}  # 1980-01-01, a zip's earliest


def rewrite_metadata(text: str, version: str, requirements: dict[str, str]) -> str:
    """METADATA with ``Version`` set and each ``Requires-Dist`` on a project
    of ``requirements`` replaced (keeping its marker when the new has none);
    everything else byte for byte. ToolError when one is not there."""
    head, sep, body = text.partition("\n\n")
    wanted = {canonicalize_name(Requirement(r).name): r for r in requirements.values()}
    lines, found = head.split("\n"), set()
    for i, line in enumerate(lines):
        key, _, value = line.partition(": ")
        if key == "Version":
            lines[i] = f"Version: {version}"
        elif key == "Requires-Dist":
            try:
                old = Requirement(value)
            except InvalidRequirement:
                raise ToolError(f"METADATA: bad requirement {value!r}") from None
            if (name := canonicalize_name(old.name)) in wanted:
                new = Requirement(wanted[name])
                new.marker = new.marker or old.marker
                lines[i], found = f"Requires-Dist: {new}", found | {name}
    if missing := sorted(set(wanted) - found):
        raise ToolError(f"the release's METADATA has no Requires-Dist on {missing[0]}")
    return "\n".join(lines) + sep + body


def _rewrite(path: Path, text: str) -> None:
    path.unlink()  # hard-linked to the upstream copy: write a new file
    path.write_text(text, encoding="utf-8")


def _set_version(fork: Path, release: Release, version: str) -> None:
    """Rename the .dist-info, rewrite METADATA and vllm/_version.py."""
    info = fork / f"vllm-{release.version}.dist-info"
    text = (info / "METADATA").read_text(encoding="utf-8")
    _rewrite(info / "METADATA", rewrite_metadata(text, version, release.requirements))
    (info / "RECORD").unlink()  # wheel pack writes it anew
    info.rename(fork / f"vllm-{version}.dist-info")
    if (path := fork / "vllm" / "_version.py").is_file():
        pattern = rf"(version\s*=\s*)(['\"]){re.escape(release.version)}\2"
        text = path.read_text(encoding="utf-8")
        _rewrite(path, re.sub(pattern, rf"\g<1>\g<2>{version}\g<2>", text))


def build_release(
    manifest: Manifest,
    version: str,
    out: Path,
    work: Path,
    wheel: Path | None = None,
    repo: Path = ROOT,
) -> Path:
    """Build the fork wheel of ``version`` (the branch in ``repo``) into
    ``out``; returns its path. Raises ToolError."""
    release = manifest.release(version)
    new_version = f"{version}+{manifest.local_label}"
    Version(new_version)  # a valid PEP 440 version, or InvalidVersion
    tags = ".".join(sorted(map(str, parse_wheel_filename(release.wheel)[3])))
    name = f"vllm-{new_version}-{tags}.whl"
    source = release.fetch("wheel", work / "download", [wheel] if wheel else [])
    final, python = work / version, [sys.executable, "-m", "wheel"]
    partial, fork = final / ".partial", final / ".partial" / "fork"
    shutil.rmtree(partial, ignore_errors=True)  # what an interrupted build left
    partial.mkdir(parents=True)
    try:
        print(f"unpacking {source.name}")
        run([*python, "unpack", str(source), "-d", str(partial)], "wheel unpack")
        (partial / f"vllm-{version}").rename(partial / "upstream")
        shutil.copytree(partial / "upstream", fork, copy_function=os.link)
        report = apply_branch(fork, version, repo=repo, manifest=manifest)
        print("\n".join(f"  {line}" for line in report.lines))
        _set_version(fork, release, new_version)
        print(f"packing {name}")
        run([*python, "pack", str(fork), "-d", str(partial)], "wheel pack", _EPOCH)
        (packed,) = partial.glob("*.whl")
        for part in ("upstream", "fork"):  # the finished trees, then the wheel
            shutil.rmtree(final / part, ignore_errors=True)
            (partial / part).rename(final / part)
        out.mkdir(parents=True, exist_ok=True)
        shutil.move(packed, out / f".{name}.partial")
        os.replace(out / f".{name}.partial", out / name)
    finally:
        shutil.rmtree(partial, ignore_errors=True)
        (out / f".{name}.partial").unlink(missing_ok=True)
    return out / name


def main(argv: Sequence[str] | None = None) -> int:
    p = parser(__doc__)
    p.add_argument("--wheel", type=Path, action="append", default=[], help="a copy")
    p.add_argument("--out", type=Path, default=ROOT / "dist")
    p.add_argument("--work", type=Path, default=ROOT / "build" / "fork")
    args = p.parse_args(argv)

    def body() -> None:
        manifest = load_manifest()
        versions = args.release or list(manifest.releases)
        for v in versions:
            manifest.release(v)
        wheels = {str(parse_wheel_filename(w.name)[1]): w for w in args.wheel}
        if extra := set(wheels) - set(versions):
            raise ToolError(f"--wheel: vllm {min(extra)} is not a release being built")
        for v in versions:
            built = build_release(manifest, v, args.out, args.work, wheels.get(v))
            print(f"wrote {built} ({built.stat().st_size / 1e6:.1f} MB)")

    return command("build_fork_wheel", body)


if __name__ == "__main__":
    sys.exit(main())
