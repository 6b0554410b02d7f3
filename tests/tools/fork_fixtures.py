# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""A tiny synthetic vLLM release, branch and manifest for the tools' tests."""

import hashlib
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import libcst as cst

from fork_cst import source_hash
from fork_manifest import load_manifest

__all__ = ["BRANCH", "BUILDKITE", "FILES", "UPSTREAM", "Toy", "dedent", "sha256"]

VERSION = "1.0.0"


def dedent(text: str) -> str:
    return textwrap.dedent(text).lstrip("\n")


UPSTREAM = {
    "vllm/__init__.py": "",
    "vllm/_version.py": "__version__ = version = '1.0.0'\n",
    "vllm/helpers.py": dedent("""
        def helper(x):
            return x


        def old_helper(x):
            return x


        def fresh_helper(x):
            return x
        """),
    "vllm/ops.py": dedent('''
        """Upstream's ops."""

        import os

        from vllm.helpers import helper, old_helper


        def unchanged(a):
            # upstream's comment, kept
            return  a  +  1


        def pick(backend, use_a16):
            # which config
            if backend == "B12X" and use_a16:
                return "w4a16"
            assert backend in [
                "X",
                "Y",
            ]

            # reorder for these
            gated = True
            if gated and backend in [
                "CUTLASS",
                "TRTLLM",
                "B12X",
            ]:
                return helper(os.sep)
            return "w4a4"


        class Experts:
            """Upstream's experts."""

            MAP = {"silu": 1}

            def __init__(self):
                self.x = 1

            def keep(self):
                return self.x  # kept as upstream wrote it

            def old(self):
                return old_helper(0)
        '''),
    "vllm/envs.py": dedent("""
        import os

        if TYPE_CHECKING:
            VLLM_A: int = 0

        environment_variables = {
            # upstream's variable
            "VLLM_A": lambda: int(os.getenv("VLLM_A", "0")),
        }
        """),
}

BRANCH = {
    "vllm/ops.py": dedent('''
        """The branch's ops."""

        import math

        from vllm.helpers import fresh_helper, helper


        def _scale(x):
            return math.sqrt(x)


        def unchanged(a):
            return a + 2


        def pick(backend, use_a16):
            if use_a16 and backend in ("B12X", "FLASHINFER_B12X"):
                return "w4a16"
            if backend == "FLASHINFER_B12X":
                # the branch's early return
                return _scale(4.0)
            return "w4a4"


        class Experts:
            """The branch's experts."""

            def __init__(self):
                self.x = 2

            def prepare(self):
                return fresh_helper(_scale(self.x))

            def keep(self):
                return self.x
        '''),
    "vllm/envs.py": dedent("""
        import os

        if TYPE_CHECKING:
            VLLM_B: bool = False

        environment_variables = {
            # the branch's variable
            "VLLM_B": lambda: bool(int(os.getenv("VLLM_B", "0"))),
        }
        """),
    "vllm/newmod.py": 'from vllm.helpers import helper\n\nNEW = helper("new")\n',
}

MANIFEST = """
package = "vllm"
local_label = "fork"

[releases."1.0.0"]
wheel = "vllm-1.0.0-py3-none-any.whl"
wheel_sha256 = "{wheel_sha256}"
sdist = "vllm-1.0.0.tar.gz"
sdist_sha256 = "{zero}"

[[prs]]
id = "first"
title = "First"
doc = "docs/first.md"
new = ["vllm/newmod.py"]

[[prs]]
id = "second"
title = "Second"
doc = "docs/second.md"

{files}
"""

FILES = """
[[files]]
path = "vllm/ops.py"
pr = "first"
replace = ["unchanged"]
add = ["_scale"]
#HASHES

[[files]]
path = "vllm/ops.py"
pr = "second"
replace = ["Experts.__doc__", "Experts.__init__"]
add = ["Experts.prepare"]
drop = ["Experts.MAP", "Experts.old"]

[[files.edits]]
in = "pick"
replace = "backend == 'B12X' and use_a16"
code = 'use_a16 and backend in ("B12X", "FLASHINFER_B12X")'

[[files.edits]]
in = "pick"
insert_before = "gated = True"
take = 'backend == "FLASHINFER_B12X"'

[[files.edits]]
in = "pick"
remove = '"B12X"'
within = '["CUTLASS", "TRTLLM", "B12X"]'

[[files]]
path = "vllm/envs.py"
pr = "second"
envs = ["VLLM_B"]

[buildkite]
file = ".buildkite/kernels.yaml"
step = "kernels-moe-test"
"""

BUILDKITE = dedent("""
    - label: other
      key: other-test
      source_file_dependencies:
      - vllm/other/
    - label: ":nvidia: MoE"
      key: kernels-moe-test
      source_file_dependencies:
      - vllm/envs.py
      - vllm/model_executor/
      commands:
        - pytest kernels/moe
    """)


def _write(root: Path, files: dict[str, str]) -> None:
    for path, text in files.items():
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        (root / path).write_text(text, encoding="utf-8")


class Toy:
    """A release tree, a branch repository and its manifest under ``root``."""

    def __init__(self, root: Path, files: str = FILES, wheel_sha256: str = "0" * 64):
        self.root, self.tree, self.repo = root, root / "release", root / "repo"
        _write(self.tree, UPSTREAM)
        _write(self.tree, {".buildkite/kernels.yaml": BUILDKITE})
        _write(self.repo, BRANCH)
        self.files, self.wheel_sha256 = files, wheel_sha256
        self.write_manifest()

    def write_manifest(
        self, files: str | None = None, hashes: bool = True, extra: tuple = ()
    ) -> Path:
        lines = []
        if hashes:  # the sha256 lines, as `fork_branch.py hashes` prints them
            module = cst.parse_module((self.tree / "vllm/ops.py").read_text())
            for name in ("unchanged", "pick", "Experts", *extra):
                h = source_hash(module, name)
                lines.append(f'sha256."{VERSION}".{name} = "{h}"')
        text = MANIFEST.format(
            wheel_sha256=self.wheel_sha256, zero="0" * 64, files=files or self.files
        )
        self.manifest_path = self.root / "manifest.toml"
        self.manifest_path.write_text(text.replace("#HASHES", "\n".join(lines)))
        self.manifest = load_manifest(self.manifest_path)
        return self.manifest_path

    def snapshot(self) -> dict[str, bytes]:
        return {
            str(p.relative_to(self.tree)): p.read_bytes()
            for p in sorted(self.tree.rglob("*"))
            if p.is_file()
        }

    def wheel(self, out: Path, plant: tuple[str, str] = ("", "")) -> Path:
        """The release as a wheel (``wheel pack``), its sha256 in the manifest;
        ``plant``: (old, new) text replaced in its vllm/ops.py."""
        root = self.root / "wheel-src"
        _write(root, {p: t.replace(*plant) for p, t in UPSTREAM.items()})
        info = root / "vllm-1.0.0.dist-info"
        wheel = "Wheel-Version: 1.0\nGenerator: toy\nRoot-Is-Purelib: true\n"
        _write(info, {"WHEEL": wheel + "Tag: py3-none-any\n"})
        (info / "METADATA").write_text(
            "Metadata-Version: 2.1\nName: vllm\nVersion: 1.0.0\n"
            'Requires-Dist: toykernels==0.1; platform_machine == "x86_64"\n'
            "Requires-Dist: numpy\n\nA toy. Version: 9 stays.\n"
        )
        out.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "wheel", "pack", str(root), "-d", str(out)]
        env = {**os.environ, "SOURCE_DATE_EPOCH": "315532800"}
        subprocess.run(cmd, check=True, capture_output=True, env=env)
        path = out / "vllm-1.0.0-py3-none-any.whl"
        self.wheel_sha256 = hashlib.sha256(path.read_bytes()).hexdigest()
        self.write_manifest()
        return path


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()
