# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Every environment that runs a tool installs what the tool imports (its
tools/ modules followed) and runs with ``python -m``: the README's commands,
their requirements files, and CI's follow-pypi job."""

import ast
import re
import sys

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from tool_cli import ROOT

TOOLS = ROOT / "tools"
DISTRIBUTIONS = {"yaml": "pyyaml"}  # import name -> PyPI name, where they differ


def _needs(tool: str) -> set[str]:
    """The PyPI projects ``tools/<tool>.py`` needs: what it imports anywhere
    and runs with ``python -m``, and what the tools it imports do at their
    module level (a function's own import is its caller's need)."""
    seen, todo, found = set(), [tool], set()
    while todo:
        if (name := todo.pop()) in seen:
            continue
        seen.add(name)
        text = (TOOLS / f"{name}.py").read_text()
        found |= set(re.findall(r'"-m", "(\w+)"', text)) - {"pip", "pytest"}
        tree = ast.parse(text)
        for node in ast.walk(tree) if name == tool else tree.body:
            if isinstance(node, ast.Import):
                mods = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level:
                mods = [node.module]
            else:
                continue
            for top in {m.split(".")[0] for m in mods}:
                if (TOOLS / f"{top}.py").is_file():
                    todo.append(top)
                elif top not in sys.stdlib_module_names:
                    found.add(DISTRIBUTIONS.get(top, top))
    return {canonicalize_name(n) for n in found}


def _requirements(path) -> set[str]:
    names = set()
    for line in path.read_text().splitlines():
        line = line.split("#")[0].strip()
        if line.startswith("-r"):
            names |= _requirements(path.parent / line[2:].strip())
        elif line and not line.startswith("-"):
            names.add(canonicalize_name(Requirement(line).name))
    return names


def _readme_command(marker: str) -> str:
    text = (ROOT / "README.md").read_text()
    return text.split(f"<!-- {marker} -->\n```bash\n", 1)[1].split("```", 1)[0]


def _installed(command: str) -> set[str]:
    names = set()
    for step in command.split("&&"):
        words = step.split()
        if words[:2] != ["pip", "install"]:
            continue
        for i, w in enumerate(words[2:], start=2):
            if words[i - 1] == "-r":
                names |= _requirements(ROOT / w)
            elif not w.startswith("-") and words[i - 1] != "-e":
                names.add(canonicalize_name(Requirement(w).name))
    return names


def _ci_follow_pypi() -> tuple[set[str], str]:
    job = (ROOT / ".github/workflows/ci.yml").read_text().split("follow-pypi:")[1]
    (line,) = re.findall(r"pip install ([^\n]+)", job)
    return {canonicalize_name(Requirement(n).name) for n in line.split()}, job


@pytest.mark.parametrize(
    "where, tools",
    [
        ("fork-command", ["build_fork_wheel"]),
        (
            "source-command",
            ["build_source_branch", "compare_upstream_tests", "check_pr_series"],
        ),
        ("gates-command", ["upstream_gates"]),
        ("ci follow-pypi", ["follow_pypi"]),
    ],
)
def test_each_environment_installs_what_its_tools_import(where, tools):
    if where == "ci follow-pypi":
        installed, job = _ci_follow_pypi()
        assert "python tools/follow_pypi.py" in job
    else:
        command = _readme_command(where)
        installed = _installed(command)
        assert f"tools/{tools[0]}.py" in command
    for tool in tools:
        missing = _needs(tool) - installed
        assert not missing, f"{where} runs tools/{tool}.py without {sorted(missing)}"


def test_the_reading_sees_a_missing_project():
    assert {"libcst", "packaging", "ruff"} <= _needs("fork_branch")
    assert "pyyaml" in _needs("upstream_gates")
    assert "packaging" not in _installed("pip install libcst wheel && python x.py")
