# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Build vLLM's release wheels with the branch applied (tools/fork_manifest.toml).

    python tools/build_fork_wheel.py [--release V] [--wheel PATH] [--out dist]

For each release (default: every one the manifest names): the release wheel
(``--wheel``, a verified download under build/fork/download/, or pip) checked
against its sha256, unpacked with ``wheel``, the branch applied
(tools/fork_branch.py), version ``<V>+<local_label>`` and METADATA's
requirements rewritten (``packaging``), packed again with the release's tags:
dist/vllm-<V>+nvfp4moe-<tags>.whl. The untouched release and the fork stay
unpacked in build/fork/<V>/upstream and build/fork/<V>/fork. Everything is
built under build/fork/<V>/.partial and moved into place last. On an error:
one line, exit 2.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

from packaging.requirements import InvalidRequirement, Requirement
from packaging.utils import canonicalize_name, parse_wheel_filename
from packaging.version import Version

try:
    from tools.fork_branch import (
        ROOT,
        BranchError,
        Manifest,
        Release,
        apply_branch,
        load_manifest,
    )
except ImportError:  # run as `python tools/build_fork_wheel.py`
    from fork_branch import (
        ROOT,
        BranchError,
        Manifest,
        Release,
        apply_branch,
        load_manifest,
    )

__all__ = ["build_release", "main", "rewrite_metadata"]

# Zip timestamps of the built wheel (wheel pack honours it): same bytes twice.
_EPOCH = "315532800"  # 1980-01-01, the earliest a zip can hold


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(1 << 20):
            digest.update(block)
    return digest.hexdigest()


def _run(cmd: Sequence[str], what: str) -> None:
    env = {**os.environ, "SOURCE_DATE_EPOCH": _EPOCH}
    done = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if done.returncode:
        last = (done.stderr + done.stdout).strip().splitlines() or ["no output"]
        raise BranchError(f"{what} failed (exit {done.returncode}): {last[-1]}")


def rewrite_metadata(text: str, version: str, requirements: dict[str, str]) -> str:
    """METADATA with ``Version`` set and each ``Requires-Dist`` on a project
    of ``requirements`` replaced (keeping its marker when the new has none);
    everything else byte for byte. BranchError when one is not there."""
    head, sep, body = text.partition("\n\n")
    wanted = {canonicalize_name(Requirement(r).name): r for r in requirements.values()}
    lines, found = [], set()
    for line in head.split("\n"):
        key, _, value = line.partition(": ")
        if key == "Version":
            line = f"Version: {version}"
        elif key == "Requires-Dist":
            try:
                old = Requirement(value)
            except InvalidRequirement:
                raise BranchError(f"METADATA: bad requirement {value!r}") from None
            name = canonicalize_name(old.name)
            if name in wanted:
                new = Requirement(wanted[name])
                new.marker = new.marker or old.marker
                line, found = f"Requires-Dist: {new}", found | {name}
        lines.append(line)
    if missing := sorted(set(wanted) - found):
        raise BranchError(
            f"the release's METADATA has no Requires-Dist on {missing[0]}"
        )
    return "\n".join(lines) + sep + body


def _fetch(release: Release, wheel: Path | None, download: Path) -> Path:
    """The release wheel, checked against its sha256."""
    if wheel is None and (download / release.wheel).is_file():
        wheel = download / release.wheel
        if _sha256(wheel) != release.wheel_sha256:
            wheel.unlink()  # a broken download: fetch it again
            wheel = None
    if wheel is None:
        _, _, _, tags = parse_wheel_filename(release.wheel)
        tag = sorted(tags, key=str)[0]
        download.mkdir(parents=True, exist_ok=True)
        print(f"downloading {release.wheel} with pip")
        cmd = [sys.executable, "-m", "pip", "download", f"vllm=={release.version}"]
        cmd += ["--no-deps", "--only-binary=:all:", "--ignore-requires-python"]
        cmd += ["--implementation", "cp"]
        cmd += ["--python-version", tag.interpreter[2:], "--abi", tag.abi]
        cmd += ["--platform", tag.platform, "-d", str(download)]
        _run(cmd, f"pip download vllm=={release.version}")
        wheel = download / release.wheel
    if not wheel.is_file():
        raise BranchError(f"{wheel}: no such file")
    if (got := _sha256(wheel)) != release.wheel_sha256:
        raise BranchError(
            f"{wheel}: sha256 {got}, not vllm {release.version}'s "
            f"{release.wheel_sha256}"
        )
    return wheel


def _set_version(fork: Path, release: Release, version: str) -> None:
    """Rename the .dist-info, rewrite METADATA and vllm/_version.py."""
    info = fork / f"vllm-{release.version}.dist-info"
    metadata = info / "METADATA"
    text = metadata.read_text(encoding="utf-8")
    metadata.unlink()  # hard-linked to the upstream copy: write a new file
    metadata.write_text(rewrite_metadata(text, version, release.requirements))
    (info / "RECORD").unlink()  # wheel pack writes it anew
    info.rename(fork / f"vllm-{version}.dist-info")
    path = fork / "vllm" / "_version.py"
    if path.is_file():
        text = re.sub(
            rf"(version\s*=\s*)(['\"]){re.escape(release.version)}\2",
            rf"\g<1>\g<2>{version}\g<2>",
            path.read_text(encoding="utf-8"),
        )
        path.unlink()
        path.write_text(text, encoding="utf-8")


def build_release(
    manifest: Manifest,
    version: str,
    out: Path,
    work: Path,
    wheel: Path | None = None,
    repo: Path = ROOT,
) -> Path:
    """Build the fork wheel of ``version`` (the branch in ``repo``) into
    ``out``; returns its path. Raises BranchError."""
    release = manifest.release(version)
    new_version = f"{version}+{manifest.local_label}"
    Version(new_version)  # a valid PEP 440 version, or InvalidVersion
    _, _, _, tags = parse_wheel_filename(release.wheel)
    tag = ".".join(sorted({str(t) for t in tags}))
    name = f"vllm-{new_version}-{tag}.whl"
    source = _fetch(release, wheel, work / "download")
    final = work / version
    partial = final / ".partial"
    shutil.rmtree(partial, ignore_errors=True)  # what an interrupted build left
    partial.mkdir(parents=True)
    try:
        print(f"unpacking {source.name}")
        _run(
            [sys.executable, "-m", "wheel", "unpack", str(source), "-d", str(partial)],
            "wheel unpack",
        )
        (partial / f"vllm-{version}").rename(partial / "upstream")
        shutil.copytree(partial / "upstream", partial / "fork", copy_function=os.link)
        report = apply_branch(partial / "fork", version, repo=repo, manifest=manifest)
        print("\n".join(f"  {line}" for line in report.lines))
        _set_version(partial / "fork", release, new_version)
        print(f"packing {name}")
        _run(
            [
                sys.executable,
                "-m",
                "wheel",
                "pack",
                str(partial / "fork"),
                "-d",
                str(partial),
            ],
            "wheel pack",
        )
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
    p = argparse.ArgumentParser(
        prog="build_fork_wheel", description=__doc__.split("\n")[0]
    )
    p.add_argument("--release", action="append", help="only this release (repeatable)")
    p.add_argument(
        "--wheel",
        type=Path,
        action="append",
        default=[],
        help="a local copy of a release wheel",
    )
    p.add_argument("--out", type=Path, default=ROOT / "dist")
    p.add_argument("--work", type=Path, default=ROOT / "build" / "fork")
    args = p.parse_args(argv)
    try:
        manifest = load_manifest()
        versions = args.release or list(manifest.releases)
        for v in versions:
            manifest.release(v)
        wheels = {}
        for w in args.wheel:
            _, v, _, _ = parse_wheel_filename(w.name)
            if str(v) not in versions:
                raise BranchError(f"--wheel {w}: vllm {v} is not a release being built")
            wheels[str(v)] = w
        for v in versions:
            built = build_release(manifest, v, args.out, args.work, wheels.get(v))
            print(f"wrote {built} ({built.stat().st_size / 1e6:.1f} MB)")
    except (BranchError, OSError, ValueError) as exc:
        message = str(exc)
    except KeyboardInterrupt:
        message = "interrupted (nothing finished was left half-written)"
    else:
        return 0
    print(f"build_fork_wheel: error: {' '.join(message.split())}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
