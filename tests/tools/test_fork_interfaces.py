# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""tools/fork_interfaces.py (griffe) on two tiny trees: what is compatible
passes, each kind of incompatibility is reported with the object's path."""

import pytest

from tests.tools.fork_fixtures import dedent
from tests.upstream.fork_interfaces import differences, importer_differences

UPSTREAM = dedent("""
    class Experts(Base):
        LIMIT = 1

        def __init__(self, moe_config, quant_config):
            self.max_num_tokens = 1

        def apply(self, output, hidden_states, expert_map=None):
            pass

        @staticmethod
        def _supports_activation(activation):
            return True

        def _private_helper(self):
            pass


    def make_config(backend, w13_scale, layer=None):
        pass
    """)


def _trees(tmp_path, fork: str, user: str = "from vllm.mod import make_config\n"):
    for name, text in (("upstream", UPSTREAM), ("fork", fork)):
        (tmp_path / name / "vllm").mkdir(parents=True)
        (tmp_path / name / "vllm/mod.py").write_text(text)
        (tmp_path / name / "vllm/user.py").write_text(user)
    return tmp_path / "upstream", tmp_path / "fork"


def test_compatible_changes_are_not_differences(tmp_path):
    fork = UPSTREAM.replace("expert_map=None)", "expert_map=None, *, extra=0)")
    fork = fork.replace("def _private_helper(self):\n        pass\n", "")
    fork += "\n\ndef added():\n    pass\n"
    up, fk = _trees(tmp_path, fork)
    assert differences(up, fk, ["vllm/mod.py"]) == []
    assert importer_differences(up, fk, ["vllm/mod.py"]) == []


@pytest.mark.parametrize(
    "old, new, expected",
    [
        (
            "        self.max_num_tokens = 1\n",
            "        pass\n",
            "vllm.mod.Experts.max_num_tokens: Public object was removed",
        ),
        (
            "hidden_states, expert_map=None",
            "hidden_states, expert_map",
            "vllm.mod.Experts.apply: Parameter is now required (expert_map)",
        ),
        (
            "def _supports_activation(activation)",
            "def _supports_activation(act)",
            "vllm.mod.Experts._supports_activation: (activation) is now (act)",
        ),
        (
            "make_config(backend, w13_scale, layer=None)",
            "make_config(w13_scale, backend, layer=None)",
            "vllm.mod.make_config: Positional parameter was moved (backend)",
        ),
        (
            "layer=None)",
            "layer=1)",
            "vllm.mod.make_config: Parameter default was changed (layer)",
        ),
        (
            "    LIMIT = 1\n",
            "    def LIMIT(self):\n        pass\n",
            "vllm.mod.Experts.LIMIT: Public object points to a different kind of "
            "object",
        ),
    ],
)
def test_each_incompatibility_is_reported(tmp_path, old, new, expected):
    assert old in UPSTREAM
    up, fk = _trees(tmp_path, UPSTREAM.replace(old, new))
    assert expected in differences(up, fk, ["vllm/mod.py"])


def test_a_name_upstream_imports_from_a_changed_module_must_stay(tmp_path):
    fork = UPSTREAM.replace("def make_config", "def make_the_config")
    up, fk = _trees(
        tmp_path, fork, user="x = 1\nfrom vllm.mod import Experts, make_config\n"
    )
    assert importer_differences(up, fk, ["vllm/mod.py"]) == [
        "vllm/user.py:2: imports make_config from vllm.mod"
    ]
