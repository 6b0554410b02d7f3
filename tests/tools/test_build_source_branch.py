# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""tools/build_source_branch.py on a tiny synthetic source release and a
stand-in engine: the first commit holds the sdist's files byte for byte, one
commit per PR, the same ids on every run, patches that `git am` back; and
every bad input (another sha256, a tree changed by hand, an interrupted
series, no git, too little disk) refused in one line with nothing lost."""

import hashlib
import io
import re
import shutil
import subprocess
import tarfile
from pathlib import Path
from types import SimpleNamespace

import pytest

if shutil.which("git") is None:
    pytest.skip("git is not installed", allow_module_level=True)

import build_source_branch as bsb  # noqa: E402
from fork_manifest import Release  # noqa: E402
from tool_cli import ROOT, ToolError  # noqa: E402

V = "9.9.0"
SDIST_FILES = {
    "PKG-INFO": b"Metadata-Version: 2.1\nName: vllm\nVersion: 9.9.0\n",
    ".gitignore": b"vllm/_version.py\n*.so\n",
    "vllm/__init__.py": b"from vllm._version import version\n",
    "vllm/_version.py": b"version = '9.9.0'\n",  # ignored by git: kept with -f
    "vllm/a.py": b"def a():\r\n    return 1\r\n",  # CRLF: bytes, not text
    "tests/test_a.py": b"def test_a():\n    pass\n",
}
GIT_TREES = "the source trees are git repositories"
WHEEL = b"not really a wheel, but the manifest's bytes"


def _sdist(path: Path, files=SDIST_FILES) -> Path:
    with tarfile.open(path, "w:gz") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(f"vllm-{V}/{name}")
            info.size, info.mtime, info.uid = len(data), 1_700_000_000, 4242
            tar.addfile(info, io.BytesIO(data))
    return path


def _engine(broken_at: str | None = None, interrupt_at: str | None = None):
    """A stand-in for fork_branch.apply_branch: PR "one" edits vllm/a.py and
    adds vllm/b.py; PR "two" adds a test and edits tests/test_a.py."""
    edits = {
        "one": {"vllm/a.py": "def a():\n    return 2\n", "vllm/b.py": "B = 1\n"},
        "two": {"tests/test_b.py": "def test_b():\n    pass\n"},
    }

    def apply(tree, version, *, repo, prs, source):
        assert version == V and source and prs[0] == "one"
        if prs[-1] == interrupt_at:
            (Path(tree) / "vllm/a.py").write_text("half written")
            raise KeyboardInterrupt
        written = []
        for pr in prs:
            for name, text in edits[pr].items():
                if pr == broken_at:
                    text = "def broken(:\n"
                (Path(tree) / name).write_text(text)
                written.append(name)
        return SimpleNamespace(version=version, written=written)

    return apply


@pytest.fixture
def env(tmp_path):
    local = tmp_path / "local"
    local.mkdir()
    sdist = _sdist(local / f"vllm-{V}.tar.gz")
    (local / "vllm-9.9.0-py3-none-any.whl").write_bytes(WHEEL)
    repo = tmp_path / "repo"
    (repo / "docs/pr").mkdir(parents=True)
    for pr in ("one", "two"):
        page = f"# {pr}\n\nWhat PR {pr} does, and why: 2 MiB, not 288.\n"
        (repo / f"docs/pr/{pr}.md").write_text(page)
    release = Release(
        V,
        wheel="vllm-9.9.0-py3-none-any.whl",
        wheel_sha256=hashlib.sha256(WHEEL).hexdigest(),
        sdist=sdist.name,
        sdist_sha256=hashlib.sha256(sdist.read_bytes()).hexdigest(),
    )
    prs = [
        SimpleNamespace(id=p, title=f"[MoE] PR {p}", doc=f"docs/pr/{p}.md")
        for p in ("one", "two")
    ]
    manifest = SimpleNamespace(
        prs=prs, releases={V: release}, release=lambda v: release
    )
    return SimpleNamespace(
        tmp=tmp_path,
        local=local,
        repo=repo,
        manifest=manifest,
        build=tmp_path / "build",
        dist=tmp_path / "dist",
    )


def _build(env, apply=None, **kw):
    return bsb.build_release(
        V,
        manifest=env.manifest,
        build=env.build,
        dist=env.dist,
        local=[env.local],
        repo=env.repo,
        apply=apply or _engine(),
        **kw,
    )


def _git(tree, *args):
    return bsb.git(tree, *args)


def test_tree_commits_patches_and_the_same_ids_twice(env):
    tree, wheel, patches = _build(env)
    assert wheel.read_bytes() == WHEEL and wheel.parent == env.build
    # The tag's tree: the sdist's files, byte for byte, the ignored one too.
    names = _git(tree, "ls-tree", "-r", "--name-only", f"v{V}").splitlines()
    assert sorted(names) == sorted(SDIST_FILES)
    for name, data in SDIST_FILES.items():
        blob = subprocess.run(
            ["git", "-C", tree, "show", f"v{V}:{name}"], capture_output=True
        )
        assert blob.stdout == data, name
    # One commit per PR, titled and signed off, changing that PR's files only.
    log = _git(tree, "log", "--format=%s|%an", f"v{V}..{bsb.BRANCH}").splitlines()
    assert log == [
        f"[MoE] PR two|{bsb.AUTHOR.split(' <')[0]}",
        f"[MoE] PR one|{bsb.AUTHOR.split(' <')[0]}",
    ]
    body = _git(tree, "log", "-1", "--format=%B", f"{bsb.BRANCH}~1")
    assert "What PR one does, and why: 2 MiB" in body and body.endswith(
        f"Signed-off-by: {bsb.AUTHOR}"
    )
    assert (
        _git(tree, "diff", "--name-only", f"{bsb.BRANCH}~1", bsb.BRANCH)
        == "tests/test_b.py"
    )
    assert _git(tree, "symbolic-ref", "--short", "HEAD") == bsb.BRANCH
    assert _git(tree, "branch", "--list") == f"* {bsb.BRANCH}"  # no scratch branch left
    assert (tree / "vllm/a.py").read_text() == "def a():\n    return 2\n"
    assert [p.name for p in sorted(patches.iterdir())] == [
        "0001-MoE-PR-one.patch",
        "0002-MoE-PR-two.patch",
    ]
    first = _git(tree, "rev-parse", bsb.BRANCH)
    # A re-run, and a build elsewhere, give the same commits.
    assert _git(_build(env)[0], "rev-parse", bsb.BRANCH) == first
    env.build, env.dist = env.tmp / "elsewhere", env.tmp / "dist2"
    assert _git(_build(env)[0], "rev-parse", bsb.BRANCH) == first


def test_another_sha256_is_refused_and_the_file_kept(env):
    sdist = env.local / f"vllm-{V}.tar.gz"
    _sdist(sdist, {**SDIST_FILES, "vllm/a.py": b"tampered\n"})
    before = sdist.read_bytes()
    with pytest.raises(
        ToolError,
        match=r"vllm-9\.9\.0\.tar\.gz \(.*local.*\): sha256 [0-9a-f]{64}, expected",
    ):
        _build(env)
    assert sdist.read_bytes() == before
    assert not (env.build / f"vllm-{V}").exists()


@pytest.mark.parametrize("change", ["edit", "untracked", "commit", "branch"])
def test_a_tree_changed_by_hand_is_refused_kept_and_fresh_restarts(env, change):
    tree = _build(env)[0]
    first = _git(tree, "rev-parse", bsb.BRANCH)
    if change == "edit":
        (tree / "vllm/a.py").write_text("my work\n")
    elif change == "untracked":
        (tree / "vllm/mine.py").write_text("my work\n")
    elif change == "commit":
        (tree / "vllm/a.py").write_text("my work\n")
        subprocess.run(
            [
                "git",
                "-C",
                tree,
                "-c",
                "user.name=Me",
                "-c",
                "user.email=me@x",
                "commit",
                "-qam",
                "mine",
            ],
            check=True,
        )
    else:
        _git(tree, "checkout", "-q", "-b", "mine")
    head = _git(tree, "rev-parse", "HEAD")
    why = {
        "edit": "changes not made",
        "untracked": "changes not made",
        "commit": "commits not made",
        "branch": "has mine checked out",
    }[change]
    with pytest.raises(ToolError, match=f"{why}.*kept as they are.*--fresh"):
        _build(env)
    assert _git(tree, "rev-parse", "HEAD") == head
    assert change == "branch" or "my work" in "".join(
        p.read_text() for p in (tree / "vllm").glob("*.py")
    )
    _build(env, fresh=True)
    assert _git(tree, "rev-parse", bsb.BRANCH) == first
    assert _git(tree, "status", "--porcelain") == ""


def test_a_folder_that_is_not_our_git_tree_is_refused(env):
    tree = env.build / f"vllm-{V}"
    tree.mkdir(parents=True)
    (tree / "notes.txt").write_text("mine")
    with pytest.raises(
        ToolError, match="not a git tree this made; kept as they are.*--fresh"
    ):
        _build(env)
    assert (tree / "notes.txt").read_text() == "mine"


def test_an_interrupted_series_never_looks_finished_and_a_rerun_completes(env):
    tree = _build(env)[0]
    good = _git(tree, "rev-parse", bsb.BRANCH)
    with pytest.raises(KeyboardInterrupt):
        _build(env, apply=_engine(interrupt_at="two"))
    # The branch still names the complete series; the half-made one is elsewhere.
    assert _git(tree, "rev-parse", bsb.BRANCH) == good
    assert _git(tree, "symbolic-ref", "--short", "HEAD") == "nvfp4moe-wip"
    assert _build(env)[0] == tree
    assert _git(tree, "rev-parse", bsb.BRANCH) == good


def test_an_interrupted_first_run_leaves_no_branch_and_unpacks_whole(env, monkeypatch):
    with pytest.raises(KeyboardInterrupt):
        _build(env, apply=_engine(interrupt_at="one"))
    tree = env.build / f"vllm-{V}"
    assert _git(tree, "branch", "--list", bsb.BRANCH) == ""
    # An unpack cut short leaves only the hidden partial folder.
    shutil.rmtree(tree)
    monkeypatch.setattr(
        bsb.os, "replace", lambda *a: (_ for _ in ()).throw(KeyboardInterrupt())
    )
    with pytest.raises(KeyboardInterrupt):
        _build(env)
    assert not tree.exists()
    monkeypatch.undo()
    assert _git(_build(env)[0], "log", "--format=%s", "-1") == "[MoE] PR two"


def test_a_pr_that_does_not_compile_stops_before_the_branch_moves(env):
    with pytest.raises(ToolError, match=r"PR one: vllm/a\.py does not compile"):
        _build(env, apply=_engine(broken_at="one"))
    assert _git(env.build / f"vllm-{V}", "branch", "--list", bsb.BRANCH) == ""


def test_no_git_and_too_little_disk_are_one_line_errors(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(bsb.shutil, "which", lambda name: None)
    assert bsb.main(["--no-install"]) == 2
    err = capsys.readouterr().err
    assert err == f"build_source_branch: error: git is not installed; {GIT_TREES}\n"
    monkeypatch.undo()
    monkeypatch.setattr(
        bsb.shutil, "disk_usage", lambda p: SimpleNamespace(free=1 << 30)
    )
    with pytest.raises(
        ToolError,
        match=r"1\.0 GiB free under .*, about 4\.8 GiB needed: 2 source trees "
        r"with git, sdists and wheels \(900 MiB each\), the venv",
    ):
        bsb.check_disk(tmp_path / "build", ["0.34.0", "0.33.0"], venv=True)


@pytest.mark.parametrize(
    "marker,tool",
    [
        ("source-command", "python tools/build_source_branch.py"),
        ("compare-command", "python tools/compare_upstream_tests.py"),
        ("gates-command", "python tools/upstream_gates.py"),
    ],
)
def test_the_readmes_commands_are_one_line_and_name_files_that_exist(marker, tool):
    text = (ROOT / "README.md").read_text()
    block = text.split(f"<!-- {marker} -->\n```bash\n", 1)[1].split("```", 1)[0]
    (command,) = block.strip().splitlines()
    assert command.split(" && ")[-1] == tool
    for requirements in re.findall(r"-r (\S+)", command):
        assert (ROOT / requirements).is_file(), requirements
    assert (ROOT / tool.split()[-1]).is_file()


def test_a_source_tree_is_one_with_git_and_its_wheel(tmp_path):
    tree = tmp_path / f"vllm-{V}"
    (tree / ".git").mkdir(parents=True)
    missing = rf"no {re.escape(str(tree))}: run tools/build_source_branch\.py"
    with pytest.raises(ToolError, match=missing):
        bsb.source_tree(V, tmp_path)  # no wheel
    wheel = tmp_path / f"vllm-{V}-cp38-abi3-manylinux_2_28_x86_64.whl"
    wheel.write_bytes(b"")
    assert bsb.source_tree(V, tmp_path) == tree
    (tree / ".git").rmdir()
    with pytest.raises(ToolError, match=missing):
        bsb.source_tree(V, tmp_path)


def test_the_install_is_switched_only_to_another_tree(tmp_path, monkeypatch):
    installed = []
    monkeypatch.setattr(bsb, "install", lambda *args: installed.append(args))
    monkeypatch.setattr(bsb, "_imports_from", lambda tree: tree.name == "on")
    wheel = tmp_path / f"vllm-{V}-cp38-abi3-manylinux_2_28_x86_64.whl"
    wheel.write_bytes(b"")
    bsb.switch_install(tmp_path / "on", V)
    assert installed == []
    bsb.switch_install(tmp_path / "off", V)
    assert installed == [(tmp_path / "off", wheel, V)]


def test_a_detached_head_is_ours_only_on_the_branchs_history(env):
    tree = _build(env)[0]
    first = _git(tree, "rev-parse", bsb.BRANCH)
    _git(tree, "checkout", "-q", f"v{V}")  # as an interrupted compare leaves it
    _build(env)
    assert _git(tree, "rev-parse", bsb.BRANCH) == first
    _git(tree, "checkout", "-q", "--detach")
    (tree / "vllm/a.py").write_text("my work\n")
    me = ["-c", "user.name=Me", "-c", "user.email=me@x"]
    subprocess.run(["git", "-C", tree, *me, "commit", "-qam", "mine"], check=True)
    with pytest.raises(ToolError, match="has HEAD checked out, not nvfp4moe"):
        _build(env)
    assert (tree / "vllm/a.py").read_text() == "my work\n"
