# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""tools/follow_pypi.py offline (PyPI's JSON and the wheel given as files): a
supported newest release passes, a supported release whose files changed on
PyPI fails, a newer release is reported definition by definition and never
fails."""

import json
import zipfile

import pytest

from tests.tools.fork_fixtures import UPSTREAM, Toy

from follow_pypi import drift_report, main
from fork_manifest import load_manifest


def _pypi(latest: str, tamper: str = "") -> dict:
    releases = {}
    for v, r in load_manifest().releases.items():
        releases[v] = [
            {"filename": r.wheel, "digests": {"sha256": r.wheel_sha256}},
            {
                "filename": r.sdist,
                "digests": {"sha256": r.sdist_sha256 if v != tamper else "0" * 64},
            },
        ]
    return {"info": {"version": latest}, "releases": releases}


def _run(tmp_path, capsys, pypi: dict, *extra: str):
    (tmp_path / "pypi.json").write_text(json.dumps(pypi))
    code = main(["--json", str(tmp_path / "pypi.json"), *extra])
    return code, capsys.readouterr()


def test_the_newest_release_supported(tmp_path, capsys):
    code, out = _run(tmp_path, capsys, _pypi("0.34.0"))
    assert code == 0 and out.out == "0.34.0: supported (the newest on PyPI)\n"


def test_a_supported_release_whose_bytes_changed_on_pypi_fails(tmp_path, capsys):
    code, out = _run(tmp_path, capsys, _pypi("0.34.0", tamper="0.33.0"))
    assert code == 1 and "0.33.0: vllm-0.33.0.tar.gz: PyPI has sha256 0000" in out.err


def test_a_supported_release_file_gone_from_pypi_fails(tmp_path, capsys):
    pypi = _pypi("0.34.0")
    wheel = load_manifest().releases["0.33.0"].wheel
    pypi["releases"]["0.33.0"] = [
        f for f in pypi["releases"]["0.33.0"] if f["filename"] != wheel
    ]
    code, out = _run(tmp_path, capsys, pypi)
    assert code == 1 and f"0.33.0: {wheel}: no longer on PyPI" in out.err
    del pypi["releases"]["0.33.0"]  # the whole release yanked
    code, out = _run(tmp_path, capsys, pypi)
    assert code == 1 and "0.33.0: vllm-0.33.0.tar.gz: no longer on PyPI" in out.err


def test_a_newer_release_is_reported_and_never_fails(tmp_path, capsys):
    pypi = _pypi("0.35.0")
    wheel = tmp_path / "vllm-0.35.0-cp38-abi3-manylinux_2_28_x86_64.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr("vllm/__init__.py", "")
    sha = __import__("hashlib").sha256(wheel.read_bytes()).hexdigest()
    pypi["releases"]["0.35.0"] = [{"filename": wheel.name, "digests": {"sha256": sha}}]
    code, out = _run(tmp_path, capsys, pypi, "--wheel", str(wheel))
    assert code == 0, out.err
    assert out.out.startswith(
        "0.35.0: not supported yet (the newest supported: 0.34.0)\n"
    )
    oracle = "vllm/model_executor/layers/fused_moe/oracle/nvfp4.py"
    assert f"make_nvfp4_moe_quant_config ({oracle})" in out.out
    assert out.out.endswith("  unchanged: none\n")
    # a wheel with other bytes than PyPI's is refused
    pypi["releases"]["0.35.0"][0]["digests"]["sha256"] = "1" * 64
    code, out = _run(tmp_path, capsys, pypi, "--wheel", str(wheel))
    assert code == 2 and "(the manifest's for vllm 0.35.0); not used" in out.err


@pytest.mark.parametrize(
    "plant, drifted", [(("", ""), []), (("w4a4", "w4a8"), ["pick"])]
)
def test_drift_per_definition(tmp_path, plant, drifted):
    toy = Toy(tmp_path)
    wheel = toy.wheel(tmp_path / "wheels", plant=plant)
    rows = drift_report(toy.manifest, wheel)
    assert sorted(n for p, n, s in rows) == ["Experts", "pick", "unchanged"]
    assert [n for p, n, s in rows if s == "drifted"] == drifted
    assert all(p == "vllm/ops.py" for p, n, s in rows)
    assert UPSTREAM  # the release the toy's hashes were recorded on


def test_drift_is_measured_against_the_newest_supported_release(tmp_path):
    # An older supported release that recorded other hashes (its own
    # upstream source) does not count: the newest one's do.
    import dataclasses

    toy = Toy(tmp_path)
    wheel = toy.wheel(tmp_path / "wheels")
    (newest,) = toy.manifest.releases
    older = "0.0.1"  # below the newest
    files = tuple(
        dataclasses.replace(
            e,
            sha256={
                **e.sha256,
                older: dict.fromkeys(e.sha256.get(newest, ()), "0" * 64),
            },
        )
        for e in toy.manifest.files
    )
    releases = {**toy.manifest.releases, older: toy.manifest.releases[newest]}
    two = dataclasses.replace(toy.manifest, releases=releases, files=files)
    assert {s for p, n, s in drift_report(two, wheel)} == {"unchanged"}
    # and the newest's hashes are read: change them, everything drifts
    files = tuple(
        dataclasses.replace(
            e, sha256={newest: dict.fromkeys(e.sha256.get(newest, ()), "1" * 64)}
        )
        for e in toy.manifest.files
    )
    wrong = dataclasses.replace(toy.manifest, files=files)
    assert {s for p, n, s in drift_report(wrong, wheel)} == {"drifted"}


def test_a_definition_or_file_the_wheel_lacks_is_gone(tmp_path):
    toy = Toy(tmp_path)
    twice = toy.wheel(tmp_path / "wheels", plant=("def unchanged(", "def pick("))
    assert sorted(drift_report(toy.manifest, twice)) == [
        ("vllm/ops.py", "Experts", "unchanged"),
        ("vllm/ops.py", "pick", "gone"),  # defined twice
        ("vllm/ops.py", "unchanged", "gone"),
    ]
    empty = tmp_path / "empty.whl"
    with zipfile.ZipFile(empty, "w") as z:
        z.writestr("vllm/__init__.py", "")
    assert sorted(drift_report(toy.manifest, empty)) == [
        ("vllm/ops.py", "Experts", "gone"),
        ("vllm/ops.py", "pick", "gone"),
        ("vllm/ops.py", "unchanged", "gone"),
    ]
