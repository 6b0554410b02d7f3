# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Build vLLM's source releases as git branches carrying the series.

    python tools/build_source_branch.py [--release V ...] [--local DIR ...]
        [--fresh] [--no-install] [--check-wheel FORK_WHEEL]

Per release (default: every release of tools/fork_manifest.toml):
    pip download (or --local DIR) -> build/source/<sdist>, <wheel>; sha256
    unpack (tarfile, data filter) -> build/source/vllm-<V>/   git: the sdist's files
        byte for byte (git add -f -A), tagged v<V>
    one commit per [[prs]] entry on branch nvfp4moe-wip (the tree is the
        release + that PR and those before it, tools/fork_branch.py); each
        changed .py file must compile; then branch nvfp4moe moves to it
    git format-patch v<V>.. -> dist/vllm-<V>-nvfp4moe-patches/, checked by
        git am onto the tag in a scratch worktree (same tree id)
Then, unless --no-install, the first release's tree is installed editable
into this Python (precompiled parts from its wheel), with upstream's
requirements/common.txt and requirements/source-cpu.txt.

A tree the command did not leave as it left it (changes, foreign commits) is
refused; --fresh deletes it first. Errors: one line on stderr, exit 2.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from collections.abc import Callable, Sequence
from pathlib import Path

__all__ = ["AUTHOR", "BRANCH", "SourceError", "build_release", "install", "main"]

ROOT = Path(__file__).resolve().parents[1]
BRANCH, WIP = "nvfp4moe", "nvfp4moe-wip"
AUTHOR = "vLLM NVFP4 MoE branch <nvfp4-moe-branch@users.noreply.github.com>"
# Measured (2026-12-03, build/ after a full run, .venv-source after install):
# per release, sdist + wheel + tree with its .git; the venv's packages.
NEED_PER_RELEASE, NEED_VENV = 1_300 << 20, 4_000 << 20


class SourceError(Exception):
    """The build cannot go on; the message is the one line the user sees."""


def git(tree: Path, *args: str, env: dict | None = None, input: str = "") -> str:
    run = subprocess.run(
        ["git", "-C", str(tree), *args],
        input=input,
        capture_output=True,
        text=True,
        env={**os.environ, **(env or {})},
    )
    if run.returncode:
        said = (run.stderr + run.stdout).splitlines()
        said = [line for line in said if line.strip() and not line.startswith("hint:")]
        raise SourceError(f"git {args[0]} in {tree}: {(said or ['failed'])[0]}")
    return run.stdout.strip()


def _identity(author: str, epoch: int) -> dict:
    name, email = author.rsplit(" <", 1)
    env = {"GIT_CONFIG_GLOBAL": os.devnull, "GIT_CONFIG_NOSYSTEM": "1"}
    for who in ("AUTHOR", "COMMITTER"):
        env |= {f"GIT_{who}_NAME": name, f"GIT_{who}_EMAIL": email.rstrip(">")}
        env[f"GIT_{who}_DATE"] = f"@{epoch} +0000"
    return env


def _sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def fetch(name: str, sha256: str, version: str, out: Path, local=()) -> Path:
    """``out/name`` with the manifest's sha256: copied from the first folder
    of ``local`` holding it, else downloaded with pip."""
    target, source = out / name, "pip download"
    for folder in local if not target.is_file() else ():
        if (folder / name).is_file():
            source = str(folder / name)
            shutil.copyfile(folder / name, target.with_suffix(".part"))
            os.replace(target.with_suffix(".part"), target)
            break
    if not target.is_file():
        print(f"downloading {name} with pip", flush=True)
        cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps"]
        cmd += ["-d", str(out), f"vllm=={version}"]
        if name.endswith(".tar.gz"):  # setup.py runs for the metadata
            cmd += ["--no-binary", ":all:", "--no-build-isolation"]
        else:
            cmd += ["--only-binary", ":all:", "--python-version", "3.11"]
            cmd += ["--platform", "manylinux_2_28_x86_64"]
        env = {"VLLM_TARGET_DEVICE": "empty", "VLLM_VERSION_OVERRIDE": version}
        if subprocess.run(cmd, env={**os.environ, **env}).returncode:
            raise SourceError(f"pip download vllm=={version} failed (see above)")
        if not target.is_file():
            raise SourceError(f"pip download did not write {target}")
    if (got := _sha256(target)) != sha256:
        target.unlink()  # our copy; the source is left as it is
        raise SourceError(
            f"{name} ({source}): sha256 {got}, expected {sha256} (the "
            f"manifest's for vllm {version}); not used"
        )
    return target


def _unpack(sdist: Path, version: str, tree: Path, author: str) -> None:
    """``tree``: the sdist's files, committed and tagged; only whole or absent."""
    partial = tree.with_name(f".{tree.name}.partial")
    shutil.rmtree(partial, ignore_errors=True)  # an interrupted run's, ours
    partial.mkdir(parents=True)
    try:  # the "data" filter: no owners, no paths or links leaving the folder
        with tarfile.open(sdist) as archive:
            archive.extractall(partial, filter="data")
    except (tarfile.TarError, OSError) as exc:
        raise SourceError(f"{sdist}: cannot unpack: {exc}") from None
    top = partial / f"vllm-{version}"
    if not (top / "PKG-INFO").is_file():
        raise SourceError(f"{sdist}: no vllm-{version}/PKG-INFO, not vLLM's sdist")
    env = _identity(author, int((top / "PKG-INFO").stat().st_mtime))
    git(top, "init", "-q")
    git(top, "symbolic-ref", "HEAD", f"refs/heads/{WIP}")
    git(top, "add", "-f", "-A")
    git(top, "commit", "-q", "-m", f"vLLM {version} (source release)", env=env)
    git(top, "tag", f"v{version}")
    os.replace(top, tree)
    partial.rmdir()


def _check_ours(tree: Path, version: str, author: str) -> None:
    """Refuse a tree holding anything the command did not make."""
    fresh = "kept as they are; pass --fresh to delete the tree and start afresh"
    if not (tree / ".git").is_dir():
        raise SourceError(f"{tree} exists and is not a git tree this made; {fresh}")
    tag = f"v{version}"
    try:
        git(tree, "rev-parse", "-q", "--verify", f"refs/tags/{tag}")
    except SourceError:
        raise SourceError(f"{tree} has no tag {tag}; {fresh}") from None
    head = git(tree, "rev-parse", "--abbrev-ref", "HEAD")  # "HEAD": detached
    if head == WIP:  # an interrupted series: its half-applied files are ours
        return
    if status := git(tree, "status", "--porcelain", "--untracked-files=all"):
        n = len(status.splitlines())
        raise SourceError(
            f"{tree} has changes not made by this command ({n} paths); {fresh}"
        )
    tip = BRANCH if git(tree, "branch", "--list", BRANCH) else tag
    on_series = (
        head == "HEAD"
        and not subprocess.run(
            ["git", "-C", str(tree), "merge-base", "--is-ancestor", "HEAD", tip]
        ).returncode
    )
    if head != BRANCH and not on_series:
        raise SourceError(f"{tree} has {head} checked out, not {BRANCH}; {fresh}")
    log = git(tree, "log", "--format=%an <%ae>%n%cn <%ce>", f"{tag}..{tip}")
    if set(log.splitlines()) - {author}:
        raise SourceError(f"{tree} has commits not made by this command; {fresh}")


def _engine():
    try:
        from tools import fork_branch
    except ImportError:  # run as `python tools/build_source_branch.py`
        import fork_branch
    return fork_branch


def _message(pr, repo: Path, author: str) -> str:
    text = (repo / pr.doc).read_text(encoding="utf-8").strip().splitlines()
    body = "\n".join(text[1:] if text and text[0].startswith("# ") else text)
    return f"{pr.title}\n\n{body.strip()}\n\nSigned-off-by: {author}\n"


def _series(tree, version, manifest, repo, author, apply) -> None:
    base = int(git(tree, "log", "-1", "--format=%ct", f"v{version}"))
    git(tree, "checkout", "-q", "-f", "-B", WIP, f"v{version}")
    ids = [pr.id for pr in manifest.prs]
    for k, pr in enumerate(manifest.prs, start=1):
        git(tree, "restore", "-q", f"--source=v{version}", "-SW", "--", ".")
        report = apply(tree, version, repo=repo, prs=ids[:k], source=True)
        git(tree, "add", "-f", "-A", "--", *report.written)
        changed = git(tree, "diff", "--cached", "--name-only", "HEAD").splitlines()
        if not changed:
            raise SourceError(f"PR {pr.id} changes nothing in vllm {version}")
        for name in (n for n in changed if n.endswith(".py")):
            path = tree / name
            try:
                compile(path.read_bytes(), str(path), "exec", dont_inherit=True)
            except SyntaxError as exc:
                raise SourceError(
                    f"PR {pr.id}: {name} does not compile: {exc}"
                ) from None
        env = _identity(author, base + 60 * k)
        git(tree, "commit", "-q", "-F", "-", env=env, input=_message(pr, repo, author))
    git(tree, "branch", "-f", BRANCH, WIP)
    git(tree, "checkout", "-q", BRANCH)
    git(tree, "branch", "-q", "-D", WIP)


def _patches(tree: Path, version: str, dist: Path, author: str) -> Path:
    out = dist / f"vllm-{version}-{BRANCH}-patches"
    shutil.rmtree(out, ignore_errors=True)  # a build output of this command
    git(tree, "format-patch", "-q", "--no-signature", "-o", str(out), f"v{version}..")
    with tempfile.TemporaryDirectory(dir=tree.parent) as scratch:
        wt = Path(scratch) / "am"
        git(tree, "worktree", "add", "-q", "--detach", str(wt), f"v{version}")
        try:
            git(
                wt,
                "am",
                "-q",
                "--keep-cr",
                *sorted(map(str, out.glob("*.patch"))),
                env=_identity(author, 0),
            )
            if git(wt, "rev-parse", "HEAD^{tree}") != git(
                tree, "rev-parse", "HEAD^{tree}"
            ):
                raise SourceError(f"git am of {out} onto v{version} gives another tree")
        finally:
            git(tree, "worktree", "remove", "--force", str(wt))
    return out


def _precompiled(wheel: Path, version: str) -> dict:
    return {
        "VLLM_USE_PRECOMPILED": "1",
        "VLLM_PRECOMPILED_WHEEL_LOCATION": str(wheel),
        "VLLM_VERSION_OVERRIDE": version,
    }


def _pip(*args: str, env: dict | None = None, cwd: Path | None = None) -> None:
    cmd = [sys.executable, "-m", "pip", *args]
    if subprocess.run(cmd, env={**os.environ, **(env or {})}, cwd=cwd).returncode:
        raise SourceError(f"pip {' '.join(args[:3])} ... failed (see above)")


def install(
    tree: Path, wheel: Path, version: str, *, requirements: bool = True
) -> None:
    """``tree`` installed editable into this Python: the release wheel's
    compiled parts copied in, ``import vllm`` resolving into the tree."""
    if sys.prefix == sys.base_prefix:
        raise SourceError("not in a virtual environment: make .venv-source (README)")
    if requirements:
        _pip(
            "install",
            "-q",
            "-r",
            str(ROOT / "requirements/source-cpu.txt"),
            "-r",
            str(tree / "requirements/common.txt"),
        )
    _pip(
        "install",
        "-q",
        "--no-build-isolation",
        "--no-deps",
        "-e",
        str(tree),
        env=_precompiled(wheel, f"{version}+cpu"),  # +cpu: vLLM's CPU platform
    )
    git(tree, "checkout", "-q", "--", "vllm/_version.py")  # setuptools-scm's
    found = subprocess.run(
        [sys.executable, "-c", "import vllm; print(vllm.__file__)"],
        capture_output=True,
        text=True,
        cwd=tempfile.gettempdir(),
    ).stdout.strip()
    if Path(found) != tree.resolve() / "vllm" / "__init__.py":
        raise SourceError(f"import vllm gives {found or 'an error'}, not {tree}")


def check_wheel(tree: Path, wheel: Path, version: str, fork_wheel: Path) -> str:
    """`pip wheel` from ``tree`` vs ``fork_wheel``: their Python files."""
    with tempfile.TemporaryDirectory() as out:
        label = fork_wheel.name.split("-")[1]  # the fork's own version
        _pip(
            "wheel",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            out,
            str(tree),
            env=_precompiled(wheel, label),
        )
        git(tree, "checkout", "-q", "--", "vllm/_version.py")
        (built,) = Path(out).glob("*.whl")
        with zipfile.ZipFile(built) as a, zipfile.ZipFile(fork_wheel) as b:
            pa = {n for n in a.namelist() if n.endswith(".py")}
            pb = {n for n in b.namelist() if n.endswith(".py")}
            differ = sorted(n for n in pa & pb if a.read(n) != b.read(n))
            only = sorted(pa ^ pb)
    if differ or only:
        raise SourceError(
            f"{built.name} vs {fork_wheel.name}: {len(differ)} Python files "
            f"differ ({', '.join(differ[:3])}), {len(only)} in one only "
            f"({', '.join(only[:3])})"
        )
    return f"{built.name}: its {len(pa)} Python files equal {fork_wheel.name}'s"


def build_release(
    version: str,
    *,
    manifest,
    build: Path,
    dist: Path,
    local: Sequence[Path] = (),
    fresh: bool = False,
    author: str = AUTHOR,
    repo: Path = ROOT,
    apply: Callable | None = None,
) -> tuple[Path, Path, Path]:
    """(tree, release wheel, patches folder) of ``version``, built or rebuilt;
    ``apply``: tools/fork_branch.py's apply_branch unless given."""
    release = manifest.release(version)
    tree = build / f"vllm-{version}"
    if tree.exists() and fresh:
        shutil.rmtree(tree)
    elif tree.exists():
        _check_ours(tree, version, author)
    build.mkdir(parents=True, exist_ok=True)
    sdist = fetch(release.sdist, release.sdist_sha256, version, build, local)
    wheel = fetch(release.wheel, release.wheel_sha256, version, build, local)
    if not tree.exists():
        _unpack(sdist, version, tree, author)
    _series(tree, version, manifest, repo, author, apply or _engine().apply_branch)
    return tree, wheel, _patches(tree, version, dist, author)


def _check_disk(build: Path, versions: Sequence[str], install: bool) -> None:
    missing = [v for v in versions if not (build / f"vllm-{v}").exists()]
    need = len(missing) * NEED_PER_RELEASE + (NEED_VENV if install else 0)
    probe = next(p for p in (build, *build.parents) if p.exists())
    if (free := shutil.disk_usage(probe).free) < need:
        raise SourceError(
            f"{free / 2**30:.1f} GiB free under {probe}, about {need / 2**30:.1f} "
            f"GiB needed ({len(missing)} source trees with git, sdists and release "
            f"wheels at {NEED_PER_RELEASE / 2**30:.1f} GiB each"
            + (
                f"; the venv's packages {NEED_VENV / 2**30:.1f} GiB)"
                if install
                else ")"
            )
        )


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="build_source_branch", description=__doc__.splitlines()[0]
    )
    p.add_argument(
        "--release", action="append", help="default: the manifest's releases"
    )
    p.add_argument(
        "--local",
        type=Path,
        action="append",
        default=[],
        help="a folder holding sdists or wheels",
    )
    p.add_argument("--fresh", action="store_true", help="delete existing trees first")
    p.add_argument("--no-install", action="store_true", help="no editable install")
    p.add_argument(
        "--check-wheel",
        type=Path,
        action="append",
        default=[],
        help="a fork wheel: the tree's wheel must hold its Python files",
    )
    p.add_argument("--author", default=AUTHOR, help="of the commits (Name <email>)")
    args = p.parse_args(argv)
    build, dist = ROOT / "build" / "source", ROOT / "dist"
    try:
        if shutil.which("git") is None:
            raise SourceError(
                "git is not installed; the source trees are git repositories"
            )
        manifest = _engine().load_manifest()
        versions = args.release or list(manifest.releases)
        _check_disk(build, versions, not args.no_install)
        built = {}
        for v in versions:
            built[v] = build_release(
                v,
                manifest=manifest,
                build=build,
                dist=dist,
                local=args.local,
                fresh=args.fresh,
                author=args.author,
            )
            print(f"vllm {v}: {built[v][0]} (branch {BRANCH}), {built[v][2]}")
        for fork_wheel in args.check_wheel:
            v = fork_wheel.name.split("-")[1].split("+")[0]
            print(check_wheel(built[v][0], built[v][1], v, fork_wheel))
        if not args.no_install:
            tree, wheel, _ = built[versions[0]]
            install(tree, wheel, versions[0])
            print(f"import vllm: {tree}/vllm (editable, {sys.prefix})")
    except (SourceError, ValueError, OSError) as exc:  # BranchError: a ValueError
        print(f"build_source_branch: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
