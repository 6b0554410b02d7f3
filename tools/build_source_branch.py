# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Build vLLM's source releases as git branches carrying the series.

    python tools/build_source_branch.py [--release V] [--local DIR] [--fresh]

Per release: build/source/vllm-<V>/ (tag v<V>, branch nvfp4moe: one commit per
PR), build/release/vllm-<V>/ (a worktree of the tag: the release),
dist/vllm-<V>-nvfp4moe-patches/ (checked by git am), then unless --no-install
the first tree installed editable. A tree holding anything the
command did not make is refused (--fresh deletes it first).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path

from fork_manifest import load_manifest
from tool_cli import ROOT, ToolError, command, parser, run

__all__ = ["AUTHOR", "BRANCH", "build_release", "check_disk", "git", "install"]
__all__ += ["precompiled", "source_tree", "switch_install"]

BRANCH, WIP = "nvfp4moe", "nvfp4moe-wip"
AUTHOR = "vLLM NVFP4 MoE branch <nvfp4-moe-branch@users.noreply.github.com>"
BUILD = ROOT / "build" / "source"
# Measured on a fresh clone (du, 2026-12-03): per release its sdist, wheel and
# git tree (0.34.0's with the compiled parts: 49 + 228 + 631 MB); the venv.
NEED_PER_RELEASE, NEED_VENV = 900 << 20, 3 << 30
FRESH = "kept as they are; pass --fresh to delete the tree and start afresh"


def git(tree: Path, *args: str, env: dict | None = None, input: str = "") -> str:
    return run(
        ["git", "-C", str(tree), *args], f"git {args[0]} in {tree}", env, input=input
    )


def _identity(author: str, epoch: int) -> dict:
    name, email = author.rstrip(">").rsplit(" <", 1)
    env = {"GIT_CONFIG_GLOBAL": os.devnull, "GIT_CONFIG_NOSYSTEM": "1"}
    for who in ("AUTHOR", "COMMITTER"):
        env |= {f"GIT_{who}_NAME": name, f"GIT_{who}_EMAIL": email}
        env[f"GIT_{who}_DATE"] = f"@{epoch} +0000"
    return env


def _unpack(sdist: Path, version: str, tree: Path, author: str) -> None:
    """``tree``: the sdist's files, committed and tagged; only whole or absent."""
    partial = tree.with_name(f".{tree.name}.partial")
    shutil.rmtree(partial, ignore_errors=True)  # an interrupted run's, ours
    partial.mkdir(parents=True)
    try:  # the "data" filter: no owners kept, nothing lands outside
        with tarfile.open(sdist) as archive:
            archive.extractall(partial, filter="data")
    except (tarfile.TarError, OSError) as exc:
        raise ToolError(f"{sdist}: cannot unpack: {exc}") from None
    top = partial / f"vllm-{version}"
    if not (top / "PKG-INFO").is_file():
        raise ToolError(f"{sdist}: no vllm-{version}/PKG-INFO, not vLLM's sdist")
    git(top, "init", "-q")
    git(top, "symbolic-ref", "HEAD", f"refs/heads/{WIP}")
    git(top, "add", "-f", "-A")
    env = _identity(author, int((top / "PKG-INFO").stat().st_mtime))
    git(top, "commit", "-q", "-m", f"vLLM {version} (source release)", env=env)
    git(top, "tag", f"v{version}")
    os.replace(top, tree)
    partial.rmdir()


def _check_ours(tree: Path, version: str, author: str) -> None:
    """Refuse a tree holding anything the command did not make."""
    if not (tree / ".git").is_dir():
        raise ToolError(f"{tree} exists and is not a git tree this made; {FRESH}")
    tag, head = f"v{version}", git(tree, "rev-parse", "--abbrev-ref", "HEAD")
    if not git(tree, "tag", "--list", tag):
        raise ToolError(f"{tree} has no tag {tag}; {FRESH}")
    if head == WIP:  # an interrupted series: its half-applied files are ours
        return
    if status := git(tree, "status", "--porcelain", "--untracked-files=all"):
        n = len(status.splitlines())
        raise ToolError(f"{tree} has changes not made by this command ({n}); {FRESH}")
    tip = BRANCH if git(tree, "branch", "--list", BRANCH) else tag
    ancestor = ["git", "-C", str(tree), "merge-base", "--is-ancestor", "HEAD", tip]
    if head != BRANCH and (head != "HEAD" or subprocess.run(ancestor).returncode):
        raise ToolError(f"{tree} has {head} checked out, not {BRANCH}; {FRESH}")
    log = git(tree, "log", "--format=%an <%ae>%n%cn <%ce>", f"{tag}..{tip}")
    if set(log.splitlines()) - {author}:
        raise ToolError(f"{tree} has commits not made by this command; {FRESH}")


def _series(tree, version, manifest, repo, author, apply) -> None:
    tag, ids = f"v{version}", [pr.id for pr in manifest.prs]
    base = int(git(tree, "log", "-1", "--format=%ct", tag))
    git(tree, "checkout", "-q", "-f", "-B", WIP, tag)
    for k, pr in enumerate(manifest.prs, start=1):
        git(tree, "restore", "-q", f"--source={tag}", "-SW", "--", ".")
        report = apply(tree, version, repo=repo, prs=ids[:k], source=True)
        git(tree, "add", "-f", "-A", "--", *report.written)
        changed = git(tree, "diff", "--cached", "--name-only", "HEAD").split()
        if not changed:
            raise ToolError(f"PR {pr.id} changes nothing in vllm {version}")
        for name in (n for n in changed if n.endswith(".py")):
            try:
                compile((tree / name).read_bytes(), name, "exec", dont_inherit=True)
            except SyntaxError as exc:
                raise ToolError(f"PR {pr.id}: {name} does not compile: {exc}") from None
        page = (repo / pr.doc).read_text(encoding="utf-8").strip().split("\n", 1)
        body = page[-1].strip() if page[0].startswith("# ") else "\n".join(page)
        message = f"{pr.title}\n\n{body}\n\nSigned-off-by: {author}\n"
        env = _identity(author, base + 60 * k)
        git(tree, "commit", "-q", "-F", "-", env=env, input=message)
    git(tree, "branch", "-f", BRANCH, WIP)
    git(tree, "checkout", "-q", BRANCH)
    git(tree, "branch", "-q", "-D", WIP)


def _patches(tree: Path, version: str, dist: Path, author: str) -> Path:
    out = dist / f"vllm-{version}-{BRANCH}-patches"
    shutil.rmtree(out, ignore_errors=True)  # this command's build output
    git(tree, "format-patch", "-q", "--no-signature", "-o", str(out), f"v{version}..")
    with tempfile.TemporaryDirectory(dir=tree.parent) as scratch:
        am = Path(scratch) / "am"
        git(tree, "worktree", "add", "-q", "--detach", str(am), f"v{version}")
        try:
            patches = sorted(map(str, out.glob("*.patch")))
            git(am, "am", "-q", "--keep-cr", *patches, env=_identity(author, 0))
            same = {git(t, "rev-parse", "HEAD^{tree}") for t in (am, tree)}
            if len(same) != 1:
                raise ToolError(f"git am of {out} onto v{version} gives another tree")
        finally:
            git(tree, "worktree", "remove", "--force", str(am))
    return out


def precompiled(wheel: Path, version: str) -> dict:
    """vLLM's setup.py settings: the compiled parts from ``wheel``."""
    return {
        "VLLM_USE_PRECOMPILED": "1",
        "VLLM_PRECOMPILED_WHEEL_LOCATION": str(wheel),
        "VLLM_VERSION_OVERRIDE": version,
    }


def install(tree: Path, wheel: Path, version: str, requirements=()) -> None:
    """``tree`` installed editable into this venv (compiled parts from
    ``wheel``, version <V>+cpu: vLLM's CPU platform), after the
    ``requirements`` files with requirements/source-cpu.txt; ``import vllm``
    resolving into the tree is checked."""
    if sys.prefix == sys.base_prefix:
        raise ToolError("not in a virtual environment: make .venv (README)")
    pip = [sys.executable, "-m", "pip", "install", "-q"]
    reqs = [ROOT / "requirements/source-cpu.txt", *requirements]
    editable = [*pip, "--no-build-isolation", "--no-deps", "-e", str(tree)]
    for cmd, env in (
        ([*pip, *(f"-r{r}" for r in reqs)] if requirements else [], {}),
        (editable, precompiled(wheel, f"{version}+cpu")),
    ):
        if cmd and subprocess.run(cmd, env={**os.environ, **env}).returncode:
            raise ToolError(f"pip {' '.join(cmd[3:5])} ... failed (see above)")
    git(tree, "checkout", "-q", "--", "vllm/_version.py")  # setuptools-scm's
    if not _imports_from(tree):
        raise ToolError(f"import vllm does not give {tree}'s after installing it")


def _imports_from(tree: Path) -> bool:
    probe = [sys.executable, "-c", "import vllm; print(vllm.__file__)"]
    found = subprocess.run(probe, capture_output=True, text=True, cwd="/").stdout
    return Path(found.strip()) == tree.resolve() / "vllm" / "__init__.py"


def source_tree(version: str, build: Path = BUILD) -> Path:
    """build/source/vllm-<V>, made by this command, or ToolError."""
    tree = build / f"vllm-{version}"
    if not (tree / ".git").is_dir() or not any(build.glob(f"vllm-{version}-*.whl")):
        raise ToolError(f"no {tree}: run tools/build_source_branch.py")
    return tree


def switch_install(tree: Path, version: str) -> None:
    """The editable install follows ``tree`` (nothing to do if it does)."""
    if not _imports_from(tree):
        install(tree, next(tree.parent.glob(f"vllm-{version}-*.whl")), version)


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
    """(tree, release wheel, patches folder) of ``version``, built or rebuilt
    (``apply``: tools/fork_branch.py's apply_branch unless given)."""
    release, tree = manifest.release(version), build / f"vllm-{version}"
    if tree.exists() and fresh:
        shutil.rmtree(tree)
    elif tree.exists():
        _check_ours(tree, version, author)
    sdist = release.fetch("sdist", build, local)
    wheel = release.fetch("wheel", build, local)
    if not tree.exists():
        _unpack(sdist, version, tree, author)
    if apply is None:
        from fork_branch import apply_branch as apply  # libcst: only here
    _series(tree, version, manifest, repo, author, apply)
    _release_worktree(tree, version, build.parent / "release" / tree.name)
    return tree, wheel, _patches(tree, version, dist, author)


def _release_worktree(tree: Path, version: str, at: Path) -> None:
    """``at``: the untouched release (a worktree of the tag), for the
    benchmarks and tests that compare against it."""
    listed = git(tree, "worktree", "list", "--porcelain")
    if f"worktree {at}" in listed.splitlines():
        git(at, "checkout", "-q", "--detach", "-f", f"v{version}")
        return
    git(tree, "worktree", "prune")
    shutil.rmtree(at, ignore_errors=True)  # not a worktree of this tree: ours
    git(tree, "worktree", "add", "-q", "--detach", str(at), f"v{version}")


def check_disk(build: Path, versions: Sequence[str], venv: bool) -> None:
    missing = [v for v in versions if not (build / f"vllm-{v}").exists()]
    need = len(missing) * NEED_PER_RELEASE + venv * NEED_VENV
    probe = next(p for p in (build, *build.parents) if p.exists())
    if (free := shutil.disk_usage(probe).free) < need:
        raise ToolError(
            f"{free / 2**30:.1f} GiB free under {probe}, about {need / 2**30:.1f} "
            f"GiB needed: {len(missing)} source trees with git, sdists and wheels "
            f"({NEED_PER_RELEASE >> 20} MiB each)"
            + (f", the venv's packages ({NEED_VENV >> 30} GiB)" if venv else "")
        )


def main(argv: Sequence[str] | None = None) -> int:
    p = parser(__doc__)
    p.add_argument("--local", type=Path, action="append", default=[], help="a folder")
    p.add_argument("--fresh", action="store_true", help="delete existing trees first")
    p.add_argument("--no-install", action="store_true", help="no editable install")
    p.add_argument("--author", default=AUTHOR, help="of the commits: Name <email>")
    args = p.parse_args(argv)

    def body() -> None:
        if shutil.which("git") is None:
            raise ToolError(
                "git is not installed; the source trees are git repositories"
            )
        manifest = load_manifest()
        versions = args.release or list(manifest.releases)
        check_disk(BUILD, versions, not args.no_install)
        kw = dict(manifest=manifest, build=BUILD, dist=ROOT / "dist", local=args.local)
        built = []
        for v in versions:
            tree, wheel, patches = build_release(
                v, fresh=args.fresh, author=args.author, **kw
            )
            print(f"vllm {v}: {tree} (branch {BRANCH}), {patches}", flush=True)
            built.append((tree, wheel, v))
        if not args.no_install:  # one venv for every tree's requirements
            install(*built[0], [t / "requirements/common.txt" for t, _, _ in built])
            print(f"vllm {versions[0]}: installed editable in {sys.prefix}")

    return command("build_source_branch", body)


if __name__ == "__main__":
    sys.exit(main())
