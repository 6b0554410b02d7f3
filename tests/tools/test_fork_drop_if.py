# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""tools/fork_branch.py's ``drop_if``: upstream's module-level ``if``
statements (a test file's skip guards) removed by their test, matched by
structure exactly once, the imports only they read removed with them."""

import pytest

from fork_branch import apply_branch
from fork_manifest import load_manifest
from tool_cli import ToolError

UPSTREAM = """import pytest

from vllm.platforms import current_platform

if not current_platform.is_sm120():
    pytest.skip(reason="SM120 only", allow_module_level=True)

# fast_op needs the platform checked first
from vllm.kernels import fast_op
import os
from tests.helpers import helper


def test_op():
    assert fast_op(1) == 2 and os and helper


if __name__ == "__main__":
    test_op()
"""


def _manifest(path, tests) -> None:
    zeros = "0" * 64
    path.write_text(
        'package = "vllm"\nlocal_label = "x"\n[releases."1.0.0"]\n'
        f'wheel = "w"\nwheel_sha256 = "{zeros}"\nsdist = "s"\n'
        f'sdist_sha256 = "{zeros}"\nrequirements = {{}}\n'
        '[[prs]]\nid = "p"\ntitle = "t"\ndoc = "d"\n'
        '[[files]]\npath = "tests/test_op.py"\npr = "p"\n'
        f"drop_if = [{', '.join(repr(t) for t in tests)}]\n"
    )


def _apply(tmp_path, manifest) -> None:
    """The branch applied as source onto ``tmp_path/tree``, from
    ``tmp_path/repo``, by the manifest file ``manifest``."""
    apply_branch(
        tmp_path / "tree",
        "1.0.0",
        repo=tmp_path / "repo",
        manifest=load_manifest(manifest),
        source=True,
    )


@pytest.mark.parametrize(
    "tests",
    [
        ["not current_platform . is_sm120( )", "__name__ == '__main__'"],
    ],
)
def test_module_level_ifs_go_with_the_imports_only_they_read(tmp_path, tests):
    (tmp_path / "tree/tests").mkdir(parents=True)
    (tmp_path / "tree/tests/helpers.py").write_text("helper = None\n")
    for mod in ("platforms", "kernels"):
        (tmp_path / f"tree/vllm/{mod}").mkdir(parents=True)
        names = "current_platform = fast_op = None\n"
        (tmp_path / f"tree/vllm/{mod}/__init__.py").write_text(names)
    (tmp_path / "tree/tests/test_op.py").write_text(UPSTREAM)
    (tmp_path / "repo/tests").mkdir(parents=True)
    (tmp_path / "repo/tests/test_op.py").write_text(UPSTREAM)
    m = tmp_path / "m.toml"
    _manifest(m, tests)
    _apply(tmp_path, m)
    text = (tmp_path / "tree/tests/test_op.py").read_text()
    assert "current_platform" not in text and "__main__" not in text
    # the two import blocks are one now, as ruff's isort orders it (the
    # comment above the block's first line stays at its top)
    head = text.split("\n\n\ndef test_op", 1)[0]
    assert head == (
        "# fast_op needs the platform checked first\nimport os\n\n"
        "from tests.helpers import helper\nfrom vllm.kernels import fast_op"
    )
    _manifest(m, ["not current_platform.is_sm121()"])
    with pytest.raises(ToolError, match="matches 0 places"):
        _apply(tmp_path, m)
