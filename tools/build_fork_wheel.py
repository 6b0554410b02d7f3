# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Build upstream vLLM's release wheel with this branch's definitions spliced in.

    python tools/build_fork_wheel.py [--wheel PATH] [--out dist] [--work build/fork]

    pip download (unless --wheel, or cached) -> <work>/download/<wheel>
    sha256 checked against tools/fork_manifest.toml
    wheel unpack -> <work>/upstream/   the release, untouched (the control)
                 -> <work>/fork/       a copy (hard links), spliced:
        each [[files]] entry of the manifest (tools/fork_splice.py)
        imports of the package's modules checked against the built tree
        .dist-info renamed to the new version; METADATA's Version and
        Requires-Dist; <package>/_version.py
    wheel pack -> <out>/<name>-<version>+<label>-<release's tags>.whl
                  <out>/<wheel>.splice.json   (what was spliced)

Needs only the standard library (Python 3.11) and the ``wheel`` package.
Exits 0 on success; on any error prints one line on stderr and exits 2,
leaving nothing new in ``--out``. Compiled extensions are copied untouched.
"""

import argparse
import dataclasses
import hashlib
import importlib.util
import json
import os
import re
import shutil
import stat
import subprocess
import sys
import zipfile
from collections.abc import Mapping, Sequence
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python < 3.11: reported by main()
    tomllib = None

try:
    from tools import fork_splice
except ImportError:  # run as `python tools/build_fork_wheel.py`
    import fork_splice

__all__ = [
    "BuildError",
    "FileEntry",
    "Manifest",
    "Release",
    "check_tree",
    "load_manifest",
    "main",
    "rewrite_metadata",
    "splice_entry",
]

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_MANIFEST = ROOT / "tools" / "fork_manifest.toml"
_MODES = {
    # mode -> (required keys, optional keys) besides path and mode
    "splice": ({"definitions"}, {"stand_ins"}),
    "new": (set(), set()),
    "replace": (set(), set()),
    "envs": ({"variables"}, {"definitions", "stand_ins"}),
}
_WHEEL_NAME = re.compile(
    r"^(?P<name>[^-]+)-(?P<version>[^-]+)(?:-(?P<build>\d[^-]*))?"
    r"-(?P<py>[^-]+)-(?P<abi>[^-]+)-(?P<platform>[^-]+)\.whl$"
)
_LOCAL_LABEL = re.compile(r"^[a-z0-9]+(?:\.[a-z0-9]+)*$")
_REQUIREMENT_NAME = re.compile(r"\s*([A-Za-z0-9](?:[A-Za-z0-9._-]*[A-Za-z0-9])?)")


class BuildError(Exception):
    """The build cannot go on; the message is the one line the user sees."""


@dataclasses.dataclass(frozen=True)
class Release:
    """The ``[release]`` table: which upstream wheel, and the result's label."""

    package: str
    version: str
    wheel: str
    sha256: str
    local_label: str
    requirements: Mapping[str, str]

    @property
    def tags(self) -> str:
        m = _WHEEL_NAME.match(self.wheel)
        assert m is not None
        return f"{m['py']}-{m['abi']}-{m['platform']}"

    @property
    def dist_name(self) -> str:
        m = _WHEEL_NAME.match(self.wheel)
        assert m is not None
        return m["name"]


@dataclasses.dataclass(frozen=True)
class FileEntry:
    """One ``[[files]]`` entry: a module of upstream's the branch changes."""

    path: str
    mode: str
    definitions: tuple[str, ...] = ()
    variables: tuple[str, ...] = ()
    stand_ins: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class Manifest:
    release: Release
    files: tuple[FileEntry, ...]


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _strings(where: str, key: str, value: object) -> tuple[str, ...]:
    if not (
        isinstance(value, list)
        and value
        and all(isinstance(v, str) and v for v in value)
    ):
        raise BuildError(f"{where}: {key} must be a non-empty list of names")
    if len(set(value)) != len(value):
        raise BuildError(f"{where}: {key} lists a name twice")
    return tuple(value)


def load_manifest(path: Path) -> Manifest:
    """Read and validate the manifest (format: the comment at its top)."""
    if tomllib is None:
        raise BuildError("this tool needs Python 3.11 or newer (tomllib)")
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise BuildError(f"cannot read the manifest {path}: {exc.strerror}") from None
    except tomllib.TOMLDecodeError as exc:
        raise BuildError(f"{path}: not valid TOML: {exc}") from None
    name = path.name
    unknown = set(data) - {"release", "files"}
    if unknown:
        raise BuildError(f"{name}: unknown table {sorted(unknown)[0]!r}")
    rel = data.get("release")
    if not isinstance(rel, dict):
        raise BuildError(f"{name}: no [release] table")
    keys = {"package", "version", "wheel", "sha256", "local_label"}
    for key in sorted(keys):
        if not isinstance(rel.get(key), str) or not rel[key]:
            raise BuildError(f'{name}: [release] needs {key} = "..."')
    extra = set(rel) - keys - {"requirements"}
    if extra:
        raise BuildError(f"{name}: [release] has an unknown key {sorted(extra)[0]!r}")
    if not re.fullmatch(r"[0-9a-f]{64}", rel["sha256"]):
        raise BuildError(f"{name}: [release] sha256 must be 64 lowercase hex digits")
    if not _LOCAL_LABEL.fullmatch(rel["local_label"]):
        raise BuildError(
            f"{name}: [release] local_label {rel['local_label']!r} is not a PEP 440 "
            "local version label (lowercase letters and digits, dot-separated)"
        )
    m = _WHEEL_NAME.match(rel["wheel"])
    if m is None or m["version"] != rel["version"]:
        raise BuildError(
            f"{name}: [release] wheel {rel['wheel']!r} is not a wheel file name of "
            f"version {rel['version']}"
        )
    if _canonical(m["name"]) != _canonical(rel["package"]):
        raise BuildError(
            f"{name}: [release] wheel {rel['wheel']!r} is not package {rel['package']}"
        )
    requirements = rel.get("requirements", {})
    if not isinstance(requirements, dict):
        raise BuildError(f"{name}: [release.requirements] must be a table")
    for req_name, spec in requirements.items():
        found = _REQUIREMENT_NAME.match(spec) if isinstance(spec, str) else None
        if found is None or _canonical(found[1]) != _canonical(req_name):
            raise BuildError(
                f"{name}: [release.requirements] {req_name} = {spec!r} must be a "
                f"requirement on {req_name}"
            )
    release = Release(
        package=rel["package"],
        version=rel["version"],
        wheel=rel["wheel"],
        sha256=rel["sha256"],
        local_label=rel["local_label"],
        requirements={_canonical(k): v for k, v in requirements.items()},
    )
    files: list[FileEntry] = []
    seen: set[str] = set()
    for i, entry in enumerate(data.get("files", []), 1):
        where = f"{name}: [[files]] {i}"
        if not isinstance(entry, dict):
            raise BuildError(f"{where} must be a table")
        file_path, mode = entry.get("path"), entry.get("mode")
        if not isinstance(file_path, str) or not file_path.endswith(".py"):
            raise BuildError(f"{where}: path must name a .py file")
        where = f"{name}: [[files]] {file_path}"
        parts = file_path.split("/")
        if (
            file_path.startswith("/")
            or ".." in parts
            or "" in parts
            or "\\" in file_path
        ):
            raise BuildError(f"{where}: path must be relative, with / separators")
        if parts[0] != release.package:
            raise BuildError(
                f"{where}: path is not inside the {release.package} package"
            )
        if file_path in seen:
            raise BuildError(f"{where}: listed twice")
        seen.add(file_path)
        if mode not in _MODES:
            raise BuildError(f"{where}: mode must be one of {', '.join(_MODES)}")
        required, optional = _MODES[mode]
        extra = set(entry) - {"path", "mode"} - required - optional
        if extra:
            raise BuildError(
                f"{where}: unknown key {sorted(extra)[0]!r} for mode {mode}"
            )
        for key in sorted(required):
            if key not in entry:
                raise BuildError(f"{where}: mode {mode} needs {key} = [...]")
        files.append(
            FileEntry(
                path=file_path,
                mode=mode,
                definitions=_strings(where, "definitions", entry["definitions"])
                if "definitions" in entry
                else (),
                variables=_strings(where, "variables", entry["variables"])
                if "variables" in entry
                else (),
                stand_ins=_strings(where, "stand_ins", entry["stand_ins"])
                if "stand_ins" in entry
                else (),
            )
        )
    return Manifest(release, tuple(files))


def check_tree(manifest: Manifest, tree: Path) -> None:
    """Every branch file the manifest names exists in ``tree`` and holds the
    definitions and environment variables it lists."""
    for entry in manifest.files:
        path = tree / entry.path
        if not path.is_file():
            raise BuildError(f"{entry.path} ({entry.mode}): not found in {tree}")
        text = _read(path)
        names = fork_splice.top_level_names(entry.path, text)
        for name in (*entry.definitions, *entry.stand_ins):
            if name not in names:
                raise BuildError(
                    f"{entry.path}: {name} is not a top-level definition (def, class "
                    "or NAME = ...) in the branch's file"
                )
        if entry.variables:
            keys = fork_splice.env_variable_names(entry.path, text)
            for name in entry.variables:
                if name not in keys:
                    raise BuildError(
                        f"{entry.path}: {name} is not an entry of the branch's "
                        "environment_variables dict"
                    )


# ------------------------------------------------------------------ metadata


def rewrite_metadata(
    text: str, version: str, requirements: Mapping[str, str]
) -> tuple[str, list[dict[str, str]]]:
    """Set METADATA's ``Version`` and replace each ``Requires-Dist`` whose
    project is a key of ``requirements`` (canonical names) by its value,
    keeping the old line's environment marker when the new one has none.
    Everything else is kept byte-for-byte. Returns the text and the changes."""
    head, sep, body = text.partition("\n\n")
    out: list[str] = []
    changes: list[dict[str, str]] = []
    matched: set[str] = set()
    versions = 0
    for line in head.split("\n"):
        key, colon, value = line.partition(":")
        if colon and key == "Version":
            versions += 1
            out.append(f"Version: {version}")
            changes.append({"field": "Version", "old": value.strip(), "new": version})
            continue
        found = _REQUIREMENT_NAME.match(value) if key == "Requires-Dist" else None
        if colon and found and _canonical(found[1]) in requirements:
            old = value.strip()
            new = requirements[_canonical(found[1])]
            marker = old.partition(";")[2].strip()
            if marker and ";" not in new:
                new = f"{new}; {marker}"
            matched.add(_canonical(found[1]))
            out.append(f"Requires-Dist: {new}")
            changes.append({"field": "Requires-Dist", "old": old, "new": new})
            continue
        out.append(line)
    if versions != 1:
        raise BuildError(f"the release's METADATA has {versions} Version fields, not 1")
    missing = sorted(set(requirements) - matched)
    if missing:
        raise BuildError(
            f"the release's METADATA has no Requires-Dist on {missing[0]} to replace "
            "([release.requirements] in the manifest)"
        )
    return "\n".join(out) + sep + body, changes


# --------------------------------------------------------------------- files


def _read(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise BuildError(f"{path} is not UTF-8 text") from None


def _write(path: Path, text: str) -> None:
    """Write through a new file: ``path`` may be a hard link into upstream/."""
    tmp = path.with_name(path.name + ".fork-tmp")
    tmp.write_text(text, encoding="utf-8", newline="")
    if path.exists():
        os.chmod(tmp, stat.S_IMODE(path.stat().st_mode))
    os.replace(tmp, path)


def _link_or_copy(src: str, dst: str) -> None:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _run(cmd: Sequence[str], what: str) -> None:
    result = subprocess.run(cmd, capture_output=True, text=True)
    if result.returncode != 0:
        lines = (result.stderr + result.stdout).strip().splitlines() or ["no output"]
        raise BuildError(f"{what} failed (exit {result.returncode}): {lines[-1]}")


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()


# --------------------------------------------------------------------- steps


def _verified(path: Path, release: Release) -> None:
    actual = _sha256(path)
    if actual != release.sha256:
        raise BuildError(
            f"sha256 of {path} is {actual}, the manifest says {release.sha256}"
        )


def _fetch(release: Release, work: Path, wheel: Path | None) -> Path:
    """The release wheel, verified: --wheel, a cached download, or pip."""
    if wheel is not None:
        if not wheel.is_file():
            raise BuildError(f"--wheel {wheel}: no such file")
        if wheel.name != release.wheel:
            raise BuildError(
                f"--wheel {wheel.name} is not the manifest's release {release.wheel}"
            )
        _verified(wheel, release)
        return wheel
    download = work / "download"
    cached = download / release.wheel
    if cached.is_file():
        if _sha256(cached) == release.sha256:
            print(f"using the verified download {cached}")
            return cached
        cached.unlink()
    download.mkdir(parents=True, exist_ok=True)
    m = _WHEEL_NAME.match(release.wheel)
    assert m is not None
    py = m["py"].split(".")[0]
    implementation, python = py[:2], py[2:]
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        f"{release.package}=={release.version}",
        "--no-deps",
        "--only-binary=:all:",
        "--ignore-requires-python",
        "--implementation",
        implementation,
        "--abi",
        m["abi"].split(".")[0],
        "-d",
        str(download),
    ]
    if python:
        cmd += ["--python-version", python]
    for platform in m["platform"].split("."):
        cmd += ["--platform", platform]
    print(f"downloading {release.wheel} with pip")
    _run(cmd, f"pip download {release.package}=={release.version}")
    if not cached.is_file():
        got = ", ".join(sorted(p.name for p in download.glob("*.whl"))) or "nothing"
        raise BuildError(f"pip downloaded {got}, not {release.wheel}")
    _verified(cached, release)
    return cached


def _unpack(wheel: Path, work: Path) -> tuple[Path, Path]:
    """Unpack into <work>/upstream (kept untouched) and copy to <work>/fork."""
    upstream, fork, tmp = work / "upstream", work / "fork", work / "unpack"
    for path in (upstream, fork, tmp):
        _remove(path)
    tmp.mkdir(parents=True)
    print(f"unpacking {wheel.name} into {upstream}")
    _run(
        [sys.executable, "-m", "wheel", "unpack", str(wheel), "-d", str(tmp)],
        "wheel unpack",
    )
    (unpacked,) = list(tmp.iterdir())
    unpacked.rename(upstream)
    tmp.rmdir()
    shutil.copytree(upstream, fork, copy_function=_link_or_copy)
    return upstream, fork


def _lookup(fork: Path):
    def lookup(name: str) -> fork_splice.ModuleInfo | None:
        rel = name.replace(".", "/")
        for candidate, is_package in (
            (f"{rel}/__init__.py", True),
            (f"{rel}.py", False),
        ):
            if (fork / candidate).is_file():
                return fork_splice.ModuleInfo(
                    candidate, _read(fork / candidate), is_package
                )
        parent, _, stem = rel.rpartition("/")
        folder = fork / parent
        if folder.is_dir() and any(
            p.name == f"{stem}.so"
            or p.name.startswith(f"{stem}.")
            and p.suffix in (".so", ".pyd")
            for p in folder.iterdir()
        ):
            return fork_splice.ModuleInfo(rel, None, False)
        if (fork / rel).is_dir():  # a namespace package
            return fork_splice.ModuleInfo(rel, None, True)
        return None

    return lookup


def splice_entry(
    entry: FileEntry, tree: Path, upstream: Path
) -> tuple[str, fork_splice.FileReport, list[str] | None]:
    """What the fork's file of one manifest entry is, from the branch's
    ``tree`` and the unpacked release ``upstream``: (its text, the splice
    report's entry, the names whose imports :func:`fork_splice.check_imports`
    checks, or None for the whole file). Writes nothing; raises
    :class:`BuildError` or :class:`fork_splice.SpliceError`."""
    branch = _read(tree / entry.path)
    ours = upstream / entry.path
    theirs = _read(ours) if ours.is_file() else None
    if entry.mode == "new":
        if theirs is not None:
            raise BuildError(
                f"{entry.path} (new): upstream already has this file: use mode "
                "splice or replace"
            )
        return branch, fork_splice.check_new(entry.path, branch), None
    if theirs is None:
        raise BuildError(
            f"{entry.path} ({entry.mode}): upstream has no such file: use mode new"
        )
    if entry.mode == "replace":
        report = fork_splice.check_replacement(entry.path, theirs, branch)
        return branch, report, None
    if entry.mode == "splice":
        result, report = fork_splice.splice_definitions(
            entry.path, theirs, branch, entry.definitions, entry.stand_ins
        )
    else:
        result, report = fork_splice.splice_envs(
            entry.path,
            theirs,
            branch,
            entry.variables,
            entry.definitions,
            entry.stand_ins,
        )
    return result, report, [*entry.definitions, *report.imported_names]


def _splice(
    manifest: Manifest, tree: Path, upstream: Path, fork: Path
) -> list[fork_splice.FileReport]:
    reports: list[fork_splice.FileReport] = []
    checks: list[tuple[str, str, list[str] | None]] = []
    for entry in manifest.files:
        result, report, names = splice_entry(entry, tree, upstream)
        target = fork / entry.path
        target.parent.mkdir(parents=True, exist_ok=True)
        _write(target, result)
        reports.append(report)
        checks.append((entry.path, result, names))
    for entry in manifest.files:
        folder = (fork / entry.path).parent
        if folder != fork and not (folder / "__init__.py").is_file():
            raise BuildError(
                f"{entry.path} ({entry.mode}): its folder has no __init__.py in the "
                "built wheel: add one to the manifest"
            )
    lookup = _lookup(fork)
    for path, text, names in checks:
        fork_splice.check_imports(path, text, lookup, manifest.release.package, names)
    return reports


def _metadata(
    release: Release, fork: Path, version: str
) -> tuple[list[dict[str, str]], str | None]:
    old = fork / f"{release.dist_name}-{release.version}.dist-info"
    if not old.is_dir():
        raise BuildError(f"the release has no {old.name} folder")
    metadata = old / "METADATA"
    text, changes = rewrite_metadata(_read(metadata), version, release.requirements)
    _write(metadata, text)
    (old / "RECORD").unlink(missing_ok=True)  # wheel pack writes it anew
    old.rename(fork / f"{release.dist_name}-{version}.dist-info")
    version_file = fork / release.package / "_version.py"
    if not version_file.is_file():
        return changes, None
    text, count = fork_splice.set_version(
        f"{release.package}/_version.py", _read(version_file), version
    )
    if not count:
        return changes, None
    _write(version_file, text)
    return changes, f"{release.package}/_version.py"


def _pack(fork: Path, work: Path, out: Path, name: str) -> Path:
    """Pack into <work>/pack, then move the whole wheel into ``out``."""
    pack = work / "pack"
    _remove(pack)
    pack.mkdir(parents=True)
    print(f"packing {name}")
    _run(
        [sys.executable, "-m", "wheel", "pack", str(fork), "-d", str(pack)],
        "wheel pack",
    )
    (packed,) = list(pack.glob("*.whl"))
    out.mkdir(parents=True, exist_ok=True)
    final = out / name
    _move(packed, final)
    return final


def _move(src: Path, dst: Path) -> None:
    """Move ``src`` to ``dst`` so that ``dst`` is never seen half-written."""
    try:
        os.replace(src, dst)
    except OSError:  # another file system
        partial = dst.with_name(f".{dst.name}.partial")
        try:
            shutil.copyfile(src, partial)
            os.replace(partial, dst)
        finally:
            partial.unlink(missing_ok=True)
        src.unlink()


def _commit_label(tree: Path, manifest: Manifest, manifest_path: Path) -> str:
    def git(*args: str) -> str:
        try:
            result = subprocess.run(
                ["git", "-C", str(tree), *args], capture_output=True, text=True
            )
        except OSError as exc:
            raise BuildError(f"--with-commit: cannot run git: {exc.strerror}") from None
        if result.returncode != 0:
            raise BuildError(f"--with-commit: git {args[0]} failed in {tree}")
        return result.stdout.strip()

    label = f"g{git('rev-parse', '--short', 'HEAD')}"
    paths = [e.path for e in manifest.files]
    if manifest_path.resolve().is_relative_to(tree.resolve()):
        paths.append(str(manifest_path.resolve().relative_to(tree.resolve())))
    if git("status", "--porcelain", "--", *paths):
        label += ".dirty"
    return label


def _lines(n: int) -> str:
    return f"{n} line" if n == 1 else f"{n} lines"


def _summary(
    manifest: Manifest,
    version: str,
    reports: list[fork_splice.FileReport],
    changes: list[dict[str, str]],
    version_file: str | None,
) -> list[str]:
    rel = manifest.release
    lines = [f"{rel.package} {rel.version} (sha256 {rel.sha256[:12]}...) -> {version}"]
    for r in reports:
        parts = []
        for d in r.definitions:
            if d.action == "replaced":
                parts.append(
                    f"replaced {d.name} ({d.lines_before} -> {_lines(d.lines_after)})"
                )
            elif d.action == "added":
                parts.append(f"added {d.name} ({_lines(d.lines_after)})")
            else:
                parts.append(f"{d.name} unchanged")
        if r.variables_added:
            parts.append(f"added {', '.join(r.variables_added)}")
        if r.variables_present:
            parts.append(f"already there: {', '.join(r.variables_present)}")
        if r.annotations_added:
            parts.append(f"annotated {', '.join(r.annotations_added)}")
        if r.imports_added:
            n = len(r.imports_added)
            parts.append(f"{n} import{'s' if n > 1 else ''} added")
        if r.all_added:
            parts.append(f"__all__ += {', '.join(r.all_added)}")
        size = _lines(r.lines_after)
        if r.lines_before:
            size = f"{r.lines_before} -> {size}"
        lines.append(f"  {r.mode:<8}{r.path}: {'; '.join([*parts, size])}")
        lines += [f"          warning: {w}" for w in r.warnings]
    for c in changes:
        lines.append(f"  METADATA {c['field']}: {c['old']} -> {c['new']}")
    if version_file:
        lines.append(f"  {version_file}: version set to {version}")
    return lines


def build(args: argparse.Namespace) -> int:
    manifest_path = Path(args.manifest)
    manifest = load_manifest(manifest_path)
    tree = Path(args.tree)
    check_tree(manifest, tree)
    rel = manifest.release
    label = rel.local_label
    if args.with_commit:
        label += "." + _commit_label(tree, manifest, manifest_path)
    version = f"{rel.version}+{label}"
    name = f"{rel.dist_name}-{version}-{rel.tags}.whl"
    work, out = Path(args.work), Path(args.out)
    for tool in ("wheel", "pip") if args.wheel is None else ("wheel",):
        if importlib.util.find_spec(tool) is None:
            raise BuildError(f"the {tool} package is not installed: pip install {tool}")
    wheel = _fetch(rel, work, Path(args.wheel) if args.wheel else None)
    upstream, fork = _unpack(wheel, work)
    reports = _splice(manifest, tree, upstream, fork)
    changes, version_file = _metadata(rel, fork, version)
    report = {
        "release": {"wheel": rel.wheel, "sha256": rel.sha256, "version": rel.version},
        "version": version,
        "wheel": name,
        "files": [r.to_json() for r in reports],
        "metadata": changes,
        "version_file": version_file,
    }
    report_tmp = work / "splice.json"
    report_tmp.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    final = _pack(fork, work, out, name)
    _move(report_tmp, out / f"{name}.splice.json")
    for line in _summary(manifest, version, reports, changes, version_file):
        print(line)
    files = len(_zip_names(final))
    print(
        f"wrote {final} ({final.stat().st_size / 1e6:.1f} MB, {files} files) and "
        f"{out / (name + '.splice.json')}"
    )
    return 0


def _zip_names(path: Path) -> list[str]:
    with zipfile.ZipFile(path) as z:
        return z.namelist()


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, not usage + error
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def main(argv: Sequence[str] | None = None) -> int:
    parser = _Parser(
        prog="build_fork_wheel",
        description="Build the release wheel of tools/fork_manifest.toml with this "
        "branch's definitions spliced in.",
    )
    parser.add_argument("--wheel", help="the release wheel (default: pip download)")
    parser.add_argument("--out", default="dist", help="where the wheel goes (dist)")
    parser.add_argument(
        "--work", default="build/fork", help="download and unpack folder (build/fork)"
    )
    parser.add_argument(
        "--manifest", default=str(DEFAULT_MANIFEST), help="tools/fork_manifest.toml"
    )
    parser.add_argument(
        "--tree", default=str(ROOT), help="the branch's tree (this repository)"
    )
    parser.add_argument(
        "--with-commit",
        action="store_true",
        help="append .g<short sha> of the tree's HEAD to the local version",
    )
    args = parser.parse_args(argv)
    try:
        return build(args)
    except (BuildError, fork_splice.SpliceError) as exc:
        message = str(exc)
    except OSError as exc:
        message = f"{exc.filename or ''}: {exc.strerror or exc}".lstrip(": ")
    except KeyboardInterrupt:
        message = "interrupted"
    except Exception as exc:  # the one-line promise holds for bugs too
        message = f"internal error: {type(exc).__name__}: {exc}"
    print(f"build_fork_wheel: error: {' '.join(message.split())}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
