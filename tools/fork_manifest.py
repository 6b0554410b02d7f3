# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""tools/fork_manifest.toml read and checked: releases (their PyPI files
fetched and sha256-checked), the PR series, and what each PR does to each of
vLLM's files (the format: the comment at the manifest's top)."""

from __future__ import annotations

import hashlib
import os
import shutil
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path

import tomllib
from packaging.utils import parse_wheel_filename

from tool_cli import ROOT, ToolError, run

__all__ = ["DEFAULT_MANIFEST", "Edit", "FileEntry", "Manifest", "Release"]
__all__ += ["load_manifest", "sha256"]

DEFAULT_MANIFEST = ROOT / "tools" / "fork_manifest.toml"
_EDITS = ("insert_before", "insert_after", "replace", "remove", "decorate")


def sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


@dataclass(frozen=True)
class Release:
    version: str
    wheel: str
    wheel_sha256: str
    sdist: str = ""
    sdist_sha256: str = ""
    requirements: dict[str, str] = field(default_factory=dict)

    def fetch(self, kind: str, out: Path, local: Sequence[Path] = ()) -> Path:
        """``out/<its wheel or sdist>`` with the manifest's sha256: kept from
        an earlier run, else copied from the first of ``local`` (files or
        folders) that has it, else downloaded with pip. Our copy of a file
        with another sha256 is deleted; the source is left as it is."""
        name, want = getattr(self, kind), getattr(self, f"{kind}_sha256")
        target, source = out / name, "pip download"
        if target.is_file() and sha256(target) != want:
            target.unlink()  # an interrupted or broken download
        hits = [p / name if p.is_dir() else p for p in map(Path, local)]
        if hit := next((p for p in hits if p.name == name and p.is_file()), None):
            source, part = str(hit), target.with_suffix(".part")
            out.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(hit, part)
            os.replace(part, target)
        if not target.is_file():
            print(f"downloading {name} with pip", flush=True)
            cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps"]
            cmd += ["-d", str(out), f"vllm=={self.version}"]
            if kind == "sdist":  # pip runs setup.py (torch) for the metadata
                cmd += ["--no-binary", ":all:", "--no-build-isolation"]
            else:
                tag = next(iter(parse_wheel_filename(name)[3]))
                cmd += ["--only-binary", ":all:", "--implementation", "cp"]
                cmd += ["--python-version", tag.interpreter[2:], "--abi", tag.abi]
                cmd += ["--platform", tag.platform, "--ignore-requires-python"]
            env = {"VLLM_TARGET_DEVICE": "empty", "VLLM_VERSION_OVERRIDE": self.version}
            run(cmd, f"pip download vllm=={self.version}", env=env)
        if not target.is_file():
            raise ToolError(f"pip download vllm=={self.version} wrote no {target}")
        if (got := sha256(target)) != want:
            target.unlink()
            raise ToolError(
                f"{name} ({source}): sha256 {got}, expected {want} (the "
                f"manifest's for vllm {self.version}); not used"
            )
        return target


@dataclass(frozen=True)
class PullRequest:
    id: str
    title: str
    doc: str
    new: tuple[str, ...] = ()


@dataclass(frozen=True)
class Edit:
    """An edit inside the upstream definition ``inside`` ("f" or "C.m"):
    insert_before/insert_after the statement ``anchor`` the statements
    ``code`` (or the branch's ``if <take>:``), replace the expression or
    statement ``anchor`` by ``code``, remove the element ``anchor`` of the
    list or tuple ``within``, or decorate ``inside`` with ``anchor``. Each
    anchor must match exactly once."""

    kind: str
    inside: str
    anchor: str
    code: str = ""
    take: str = ""
    within: str = ""


@dataclass(frozen=True)
class FileEntry:
    """What one PR does to one file: ``path`` in the release, ``src`` here."""

    path: str
    pr: str
    src: str
    new: bool = False
    replace: tuple[str, ...] = ()
    add: tuple[str, ...] = ()
    drop: tuple[str, ...] = ()
    drop_if: tuple[str, ...] = ()  # module-level `if`s, by their test
    edits: tuple[Edit, ...] = ()
    envs: tuple[str, ...] = ()
    sha256: dict[str, dict[str, str]] = field(default_factory=dict)
    releases: tuple[str, ...] = ()  # only these (a file not in every release)

    @property
    def changed(self) -> list[str]:
        """The upstream definitions it replaces or edits (a class for members)."""
        names = [*self.replace, *self.drop, *(e.inside for e in self.edits)]
        names += [q for q in self.add if "." in q]
        return sorted({q.split(".")[0] for q in names})


@dataclass(frozen=True)
class Manifest:
    package: str
    local_label: str
    releases: dict[str, Release]
    prs: tuple[PullRequest, ...]
    files: tuple[FileEntry, ...]  # new files and edits, in PR order
    buildkite: dict[str, str] | None = None

    def release(self, version: str) -> Release:
        if version not in self.releases:
            supported = ", ".join(self.releases)
            raise ToolError(f"vllm {version} is not supported ({supported} are)")
        return self.releases[version]

    def entries(self, prs=None, source=False, version=None) -> list[FileEntry]:
        """The entries of ``prs`` (None: all), in order; tests/ and .buildkite/
        paths only for a source tree; with ``version``, only that release's."""
        known = [p.id for p in self.prs]
        if unknown := set(prs or ()) - set(known):
            raise ToolError(f"no PR {sorted(unknown)[0]!r} (the series: {known})")
        return [
            e
            for e in self.files
            if (prs is None or e.pr in prs)
            and (source or e.path.startswith("vllm/"))
            and (version is None or not e.releases or version in e.releases)
        ]


def _table(
    d: object, where: str, need: set[str], may: set | frozenset = frozenset()
) -> dict:
    if not isinstance(d, dict):
        raise ToolError(f"{where}: must be a table")
    if bad := sorted(need - d.keys()) or sorted(d.keys() - need - may):
        raise ToolError(f"{where}: missing or unknown key {bad[0]!r}")
    return d


_RELEASE_KEYS = {"wheel", "wheel_sha256", "sdist", "sdist_sha256"}


def _keys(cls: type) -> set[str]:
    return {f.name for f in fields(cls)}


def load_manifest(path: Path = DEFAULT_MANIFEST) -> Manifest:
    """Read and check the manifest (its format: the comment at its top)."""
    try:
        data = tomllib.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise ToolError(f"{path}: {exc}") from None
    need = {"package", "local_label", "releases", "prs"}
    top = _table(data, Path(path).name, need, {"files", "buildkite"})
    releases = {
        v: Release(v, **_table(r, f"releases.{v}", _RELEASE_KEYS, {"requirements"}))
        for v, r in top["releases"].items()
    }
    prs, files = [], []
    for p in top["prs"]:
        p = _table(p, "prs", {"id", "title", "doc"}, {"new"})
        prs.append(PullRequest(p["id"], p["title"], p["doc"], tuple(p.get("new", ()))))
        files += [FileEntry(f, p["id"], f, new=True) for f in p.get("new", ())]
    order = [p.id for p in prs]
    for f in top.get("files", ()):
        f = _table(f, "files", {"path", "pr"}, _keys(FileEntry))
        if f["pr"] not in order:
            raise ToolError(f"files {f['path']}: no PR {f['pr']!r}")
        if unknown := set(f.get("releases", ())) - set(releases):
            raise ToolError(f"files {f['path']}: no release {sorted(unknown)[0]}")
        edits = []
        for e in f.get("edits", ()):
            kind = next((k for k in _EDITS if k in e), "insert_before")
            where, may = f"files {f['path']}", {"code", "take", "within"}
            e = _table(e, where, {"in", kind}, may)
            args = (e.get("code", ""), e.get("take", ""), e.get("within", ""))
            edits.append(Edit(kind, e["in"], e[kind], *args))
        kw = {k: tuple(v) if isinstance(v, list) else v for k, v in f.items()}
        kw |= {"edits": tuple(edits), "src": f.get("src", f["path"])}
        files.append(FileEntry(**kw))
    files.sort(key=lambda e: order.index(e.pr))  # stable: PR order, then listed
    if (bk := top.get("buildkite")) is not None:
        _table(bk, "buildkite", {"file", "step"})
    return Manifest(
        top["package"], top["local_label"], releases, tuple(prs), tuple(files), bk
    )
