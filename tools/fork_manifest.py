# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""tools/fork_manifest.toml read and checked: releases, the PR series, and what
each PR does to each of vLLM's files (the format: the comment at its top)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import tomllib

__all__ = [
    "DEFAULT_MANIFEST",
    "ROOT",
    "BranchError",
    "Edit",
    "FileEntry",
    "Manifest",
    "PullRequest",
    "Release",
    "load_manifest",
]

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_MANIFEST = ROOT / "tools" / "fork_manifest.toml"
_EDITS = ("insert_before", "insert_after", "replace", "remove")


class BranchError(ValueError):
    """The branch cannot be applied; one line naming release, file, definition."""


@dataclass(frozen=True)
class Release:
    version: str
    wheel: str
    wheel_sha256: str
    sdist: str
    sdist_sha256: str
    requirements: dict[str, str]


@dataclass(frozen=True)
class PullRequest:
    id: str
    title: str
    doc: str
    new: tuple[str, ...]


@dataclass(frozen=True)
class Edit:
    """An edit inside the upstream definition ``inside`` ("f" or "C.m"):
    insert_before/insert_after the statement ``anchor`` the statements
    ``code`` (or the branch's ``if <take>:``), replace the expression
    ``anchor`` by ``code``, or remove the element ``anchor`` of the list or
    tuple ``within``. Each anchor must match exactly once."""

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
            raise BranchError(f"vllm {version} is not supported ({supported} are)")
        return self.releases[version]

    def entries(
        self,
        prs: Sequence[str] | None = None,
        source: bool = False,
        version: str | None = None,
    ) -> list[FileEntry]:
        """The entries of ``prs`` (None: all), in order; tests/ and .buildkite/
        paths only for a source tree; with ``version``, only that release's."""
        known = [p.id for p in self.prs]
        if unknown := set(prs or ()) - set(known):
            raise BranchError(f"no PR {sorted(unknown)[0]!r} (the series: {known})")
        return [
            e
            for e in self.files
            if (prs is None or e.pr in prs)
            and (source or e.path.startswith("vllm/"))
            and (version is None or not e.releases or version in e.releases)
        ]


def _table(d: object, where: str, need: set[str], may: set[str]) -> dict:
    if not isinstance(d, dict):
        raise BranchError(f"{where}: must be a table")
    if bad := sorted(need - d.keys()) or sorted(d.keys() - need - may):
        raise BranchError(f"{where}: missing or unknown key {bad[0]!r}")
    return d


def load_manifest(path: Path = DEFAULT_MANIFEST) -> Manifest:
    """Read and check the manifest (its format: the comment at its top)."""
    try:
        data = tomllib.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise BranchError(f"{path}: {exc}") from None
    need = {"package", "local_label", "releases", "prs"}
    top = _table(data, Path(path).name, need, {"files", "buildkite"})
    releases = {}
    for v, r in top["releases"].items():
        keys = {"wheel", "wheel_sha256", "sdist", "sdist_sha256", "requirements"}
        releases[v] = Release(v, **_table(r, f"releases.{v}", keys, set()))
    prs, files = [], []
    for p in top["prs"]:
        p = _table(p, "prs", {"id", "title", "doc"}, {"new"})
        prs.append(PullRequest(p["id"], p["title"], p["doc"], tuple(p.get("new", ()))))
        files += [FileEntry(f, p["id"], f, new=True) for f in p.get("new", ())]
    order = [p.id for p in prs]
    may = {"src", "new", "replace", "add", "drop", "edits", "envs", "sha256"}
    may.add("releases")
    for f in top.get("files", ()):
        f = _table(f, "files", {"path", "pr"}, may)
        if f["pr"] not in order:
            raise BranchError(f"files {f['path']}: no PR {f['pr']!r}")
        edits = []
        for e in f.get("edits", ()):
            kind = [k for k in _EDITS if k in e][:1] or ["insert_before"]
            e = _table(
                e, f"files {f['path']}", {"in", kind[0]}, {"code", "take", "within"}
            )
            args = (e.get("code", ""), e.get("take", ""), e.get("within", ""))
            edits.append(Edit(kind[0], e["in"], e[kind[0]], *args))
        lists = [tuple(f.get(k, ())) for k in ("replace", "add", "drop")]
        src, envs = f.get("src", f["path"]), tuple(f.get("envs", ()))
        sha, only = f.get("sha256", {}), tuple(f.get("releases", ()))
        if unknown := set(only) - set(releases):
            raise BranchError(f"files {f['path']}: no release {sorted(unknown)[0]}")
        files.append(
            FileEntry(
                f["path"],
                f["pr"],
                src,
                bool(f.get("new")),
                *lists,
                tuple(edits),
                envs,
                sha,
                only,
            )
        )
    files.sort(key=lambda e: order.index(e.pr))  # stable: PR order, then listed
    bk = top.get("buildkite")
    if bk is not None:
        _table(bk, "buildkite", {"pr", "file", "step"}, set())
    return Manifest(
        top["package"], top["local_label"], releases, tuple(prs), tuple(files), bk
    )
