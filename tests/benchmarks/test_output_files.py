# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Output files: checked before a run, written whole or not at all."""

import os
import stat
from pathlib import Path

import pytest

from vllm.benchmarks.moe_weight_prep.output_files import (
    check_output_path,
    plot_formats,
    write_atomically,
)


def test_a_failed_write_leaves_nothing_and_keeps_the_old_file(tmp_path):
    path = tmp_path / "r.json"

    def half_then_fail(tmp):
        with open(tmp, "w") as f:
            f.write('{"half": ')
        raise KeyboardInterrupt  # Ctrl-C in the middle of writing

    with pytest.raises(KeyboardInterrupt):
        write_atomically(str(path), half_then_fail)
    assert os.listdir(tmp_path) == []  # no partial file, no temporary one
    path.write_text("old")

    def disk_full(tmp):
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError):
        write_atomically(str(path), disk_full)
    assert path.read_text() == "old" and os.listdir(tmp_path) == ["r.json"]


def test_a_complete_write_is_renamed_into_place_readable(tmp_path):
    path = tmp_path / "r.json"
    write_atomically(str(path), lambda tmp: Path(tmp).write_text("{}"))
    assert path.read_text() == "{}" and os.listdir(tmp_path) == ["r.json"]
    umask = os.umask(0)
    os.umask(umask)
    # Like any new file (mkstemp alone would leave it 0600).
    assert stat.S_IMODE(path.stat().st_mode) == 0o666 & ~umask


@pytest.mark.parametrize(
    "path, written",
    [("p.png", "p.png"), ("p", "p.png"), ("p.SVG", "p.SVG"), ("d.x/p", "d.x/p.png")],
)
def test_plot_paths_name_the_file_written(tmp_path, path, written):
    (tmp_path / "d.x").mkdir()
    got = check_output_path(str(tmp_path / path), "--plot", plot=True)
    assert got == str(tmp_path / written)


def test_plot_formats_are_matplotlibs_and_others_are_refused(tmp_path):
    formats = plot_formats()
    assert {"png", "svg", "pdf"} <= set(formats) and "pgf" not in formats
    with pytest.raises(ValueError, match="unknown plot format 'txt'; use one of"):
        check_output_path(str(tmp_path / "p.txt"), "--plot", plot=True)
    # Control: --json takes any name.
    assert check_output_path(str(tmp_path / "p.txt"), "--json").endswith("p.txt")


def test_a_directory_where_nothing_can_be_created_is_refused(tmp_path):
    # /proc exists and (for root) passes the permission bits; creating a
    # file there fails, and that is what is tried.
    with pytest.raises(ValueError, match=r"--plot /proc/p.png: cannot write in /proc"):
        check_output_path("/proc/p.png", "--plot", plot=True)
    assert os.listdir(tmp_path) == []
    check_output_path(str(tmp_path / "p.png"), "--plot", plot=True)
    assert os.listdir(tmp_path) == []  # the trial file is gone
