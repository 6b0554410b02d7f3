# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""tools/build_fork_wheel.py on a tiny synthetic release wheel: the fork wheel
holds the branch's files, the release's other bytes and the new version (its
requirements the release's: the manifest has none); bad input and interrupted
builds leave nothing finished-looking."""

import zipfile

import pytest

from tests.tools.fork_fixtures import Toy, sha256

import build_fork_wheel
from build_fork_wheel import build_release, main, rewrite_metadata
from tool_cli import ToolError

NAME = "vllm-1.0.0+fork-py3-none-any.whl"


@pytest.fixture
def toy(tmp_path):
    toy = Toy(tmp_path)
    toy.release_wheel = toy.wheel(tmp_path / "wheels")
    return toy


def _build(toy, out=None, work=None):
    out, work = out or toy.root / "dist", work or toy.root / "build"
    return build_release(toy.manifest, "1.0.0", out, work, toy.release_wheel, toy.repo)


def _finished(toy) -> list[str]:
    """What under dist/ and build/ looks like a finished result."""
    dist, work = toy.root / "dist", toy.root / "build" / "1.0.0"
    found = [p.name for p in dist.glob("*.whl")] if dist.is_dir() else []
    return found + [p.name for p in (work / "upstream", work / "fork") if p.exists()]


def test_the_wheel_holds_the_branch_and_the_release_otherwise(toy):
    built = _build(toy)
    assert built.name == NAME
    release, fork = zipfile.ZipFile(toy.release_wheel), zipfile.ZipFile(built)
    names = set(fork.namelist())
    assert names == {
        n.replace("vllm-1.0.0.dist-info", "vllm-1.0.0+fork.dist-info")
        for n in release.namelist()
    } | {"vllm/newmod.py"}
    for n in release.namelist():
        if n.startswith("vllm/") and n not in (
            "vllm/ops.py",
            "vllm/envs.py",
            "vllm/_version.py",
        ):
            assert fork.read(n) == release.read(n), n
    tree = toy.root / "build" / "1.0.0"
    assert fork.read("vllm/ops.py") == (tree / "fork/vllm/ops.py").read_bytes()
    assert b"def _scale" in fork.read("vllm/ops.py")
    assert fork.read("vllm/_version.py") == b"__version__ = version = '1.0.0+fork'\n"
    # no requirements in the manifest: only the version line changes
    metadata = fork.read("vllm-1.0.0+fork.dist-info/METADATA").decode()
    before = release.read("vllm-1.0.0.dist-info/METADATA").decode()
    assert metadata == before.replace("Version: 1.0.0\n", "Version: 1.0.0+fork\n")
    # the untouched release beside it, for the tests that compare with it
    assert (tree / "upstream/vllm/ops.py").read_bytes() == release.read("vllm/ops.py")


def test_two_builds_give_the_same_bytes(toy):
    built = _build(toy)
    stamps = {i.date_time for i in zipfile.ZipFile(built).infolist()}
    assert stamps == {(1980, 1, 1, 0, 0, 0)}  # not the files' times
    first = sha256(built)
    assert sha256(_build(toy, toy.root / "dist2", toy.root / "build2")) == first


def test_a_wrong_sha256_is_refused_and_nothing_is_left(toy):
    with toy.release_wheel.open("ab") as f:
        f.write(b"\0")
    want = r"sha256 [0-9a-f]{64}, expected [0-9a-f]{64} \(the manifest's for vllm 1"
    with pytest.raises(ToolError, match=want):
        _build(toy)
    assert _finished(toy) == []


def test_drift_stops_the_build_naming_release_file_definition(toy, monkeypatch):
    # a one-line change in a copy of the release (its sha256 recorded)
    toy.release_wheel = toy.wheel(toy.root / "wheels", plant=("w4a4", "w4a8"))
    with pytest.raises(
        ToolError, match="vllm 1.0.0: vllm/ops.py: pick: upstream's source changed"
    ):
        _build(toy)
    assert _finished(toy) == []


def test_an_interrupted_build_leaves_nothing_finished_and_reruns_cleanly(
    toy, monkeypatch
):
    clean = sha256(_build(toy, toy.root / "clean", toy.root / "clean-build"))

    def interrupt(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(build_fork_wheel, "apply_branch", interrupt)
    with pytest.raises(KeyboardInterrupt):
        _build(toy)
    assert _finished(toy) == []
    assert not (toy.root / "build" / "1.0.0" / ".partial").exists()
    monkeypatch.undo()
    # what a killed build leaves (no cleanup ran): removed by the next build,
    # a half-edited fork tree with a file of its own and a stale wheel among it
    partial = toy.root / "build" / "1.0.0" / ".partial"
    (partial / "upstream").mkdir(parents=True)
    (partial / "fork" / "vllm").mkdir(parents=True)
    (partial / "fork" / "vllm" / "ops.py").write_text("half = 'edited'\n")
    (partial / "fork" / "vllm" / "stale.py").write_text("left = 'behind'\n")
    (partial / f"{NAME}").write_bytes(b"an old wheel")
    (toy.root / "dist").mkdir()
    (toy.root / "dist" / f".{NAME}.partial").write_bytes(b"half")
    assert sha256(_build(toy)) == clean
    assert sorted(p.name for p in (toy.root / "dist").iterdir()) == [NAME]
    assert sorted(p.name for p in (toy.root / "build" / "1.0.0").iterdir()) == [
        "fork",
        "upstream",
    ]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--release", "9.9.9"], "vllm 9.9.9 is not supported (0.34.0, 0.33.0 are)"),
        (
            [
                "--release",
                "0.34.0",
                "--wheel",
                "vllm-0.33.0-cp38-abi3-manylinux_2_28_x86_64.whl",
            ],
            "vllm 0.33.0 is not a release being built",
        ),
        (
            [
                "--release",
                "0.34.0",
                "--wheel",
                "vllm-0.34.0-cp38-abi3-manylinux_2_28_x86_64.whl",
            ],
            "sha256 ",
        ),
        (["--wheel", "not-a-wheel.zip"], "Invalid wheel filename"),
    ],
)
def test_the_command_line_refuses_with_one_line_and_exit_2(
    tmp_path, capsys, argv, message
):
    argv = [str(tmp_path / a) if a.endswith((".whl", ".zip")) else a for a in argv]
    for a in argv:
        if a.endswith(".whl"):
            (tmp_path / a).write_bytes(b"not the release")
    code = main(
        [*argv, "--out", str(tmp_path / "dist"), "--work", str(tmp_path / "build")]
    )
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and message in err
    assert not (tmp_path / "dist").exists()


def test_metadata_rewrite_keeps_everything_else():
    text = (
        "Metadata-Version: 2.1\nName: vllm\nVersion: 0.34.0\nRequires-Dist: numpy\n"
        "Requires-Dist: flashinfer-python==0.7.3\n\nVersion: body\n"
    )
    pin = {"flashinfer-python": "flashinfer-python==0.7.4"}
    new = rewrite_metadata(text, "0.34.0+nvfp4moe", pin)
    expected = text.replace("0.7.3", "0.7.4")
    assert new == expected.replace("Version: 0.34.0", "Version: 0.34.0+nvfp4moe")
    with pytest.raises(ToolError, match="no Requires-Dist on torch"):
        rewrite_metadata(text, "1", {"torch": "torch==2"})


def test_the_command_builds_every_release_of_the_manifest_by_default(
    tmp_path, monkeypatch, capsys
):
    built = []

    def fake_build(manifest, version, out, work, wheel):
        built.append(version)
        path = tmp_path / f"{version}.whl"
        path.write_bytes(b"x")
        return path

    monkeypatch.setattr(build_fork_wheel, "build_release", fake_build)
    assert main(["--out", str(tmp_path / "dist"), "--work", str(tmp_path)]) == 0
    assert built == ["0.34.0", "0.33.0"]
    built.clear()
    assert main(["--release", "0.33.0", "--out", str(tmp_path / "d")]) == 0
    assert built == ["0.33.0"]
