# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Package metadata lives in pyproject.toml; dependencies in requirements/."""

from pathlib import Path

from setuptools import find_packages, setup

ROOT = Path(__file__).parent


def _requirements(name: str) -> list[str]:
    """Read requirements/<name>, following ``-r`` includes, without comments."""
    out: list[str] = []
    for line in (ROOT / "requirements" / name).read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        if line.startswith("-r "):
            out.extend(_requirements(line[3:].strip()))
        else:
            out.append(line)
    return out


def _without_torch(reqs: list[str]) -> list[str]:
    return [r for r in reqs if not r.replace(" ", "").startswith("torch")]


setup(
    packages=find_packages(include=["vllm", "vllm.*"]),
    # torch is not pinned here: requirements/cpu.txt and cuda.txt pick the build.
    install_requires=[*_requirements("common.txt"), "torch >= 2.9"],
    extras_require={
        "test": _requirements("test.txt"),
        "cuda": _without_torch(_requirements("cuda.txt")),
    },
)
