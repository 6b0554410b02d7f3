# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""tools/fork_interfaces.py on synthetic upstream/branch pairs: each way a
changed definition can break upstream's interface is reported, naming the
definition; compatible changes are not; the use collectors find what a file
takes from a module."""

import textwrap

import pytest

from tools.fork_interfaces import (
    CallShape,
    Param,
    Signature,
    SourceTree,
    code_uses,
    compare_definition,
    importer_uses,
    public_names,
    signature_differences,
)
from tools.fork_splice import ModuleInfo

MODULE = "pkg.ops"


def _src(text: str) -> str:
    return textwrap.dedent(text).lstrip("\n")


BASE = _src('''
    """The base classes both sides share."""

    import abc


    class Base(abc.ABC):
        def __init__(self, config):
            self.config = config
            self.max_tokens = 8

        @staticmethod
        def _supports_device() -> bool:
            return False

        def finalize(self, out, *, scale=1.0):
            return out


    class Other:
        pass
''')

UPSTREAM = _src('''
    """Upstream's ops."""

    from pkg import base as b
    from pkg.base import Base


    def reorder(weight, scale, dim=-2, *, chunk=None):
        return weight, scale


    class Experts(Base, b.Other):
        LIMIT = 4

        def __init__(self, config, quant):
            super().__init__(config)
            self.quant = quant
            self.hidden = 16

        @staticmethod
        def activation_format():
            return "standard"

        @staticmethod
        def _supports_device() -> bool:
            return True

        def _private_helper(self):
            return None

        @property
        def expects_inputs(self) -> bool:
            return True

        def apply(self, out, x, w1, w2):
            return out
''')


def _tree(label: str, ops: str) -> SourceTree:
    files = {
        "pkg": ModuleInfo("pkg/__init__.py", "", True),
        "pkg.base": ModuleInfo("pkg/base.py", BASE, False),
        MODULE: ModuleInfo("pkg/ops.py", ops, False),
    }
    return SourceTree(files.get, label)


def _differences(branch: str, name: str) -> list[str]:
    result = compare_definition(
        _tree("upstream", UPSTREAM), _tree("the branch", branch), MODULE, name
    )
    return [str(d) for d in result.differences]


def _edit(old: str, new: str) -> str:
    assert old in UPSTREAM, old
    return UPSTREAM.replace(old, new)


def test_identical_definitions_have_no_differences():
    for name in ("reorder", "Experts"):
        assert _differences(UPSTREAM, name) == []


def test_compatible_changes_are_not_differences():
    # Keyword-only extras with defaults, members upstream lacks, a changed
    # body, a private helper gone (not interface): all compatible.
    branch = _edit(
        "def reorder(weight, scale, dim=-2, *, chunk=None):\n    return",
        "def reorder(weight, scale, dim=-2, *, chunk=None, cap=64):\n"
        "    weight = weight + 0\n    return",
    )
    branch = branch.replace(
        "    def _private_helper(self):\n        return None\n",
        "    def prepare(self, layer):\n        return layer\n",
    )
    assert _differences(branch, "reorder") == []
    assert _differences(branch, "Experts") == []


@pytest.mark.parametrize(
    "old, new, expected",
    [
        pytest.param(
            "def reorder(weight, scale, dim=-2,",
            "def reorder(weight, dim=-2,",
            "pkg.ops: reorder: drops parameter `scale`",
            id="drops-a-parameter",
        ),
        pytest.param(
            "def reorder(weight, scale, dim=-2,",
            "def reorder(weight, scales, dim=-2,",
            "pkg.ops: reorder: renames parameter 2 `scale` to `scales`",
            id="renames-a-parameter",
        ),
        pytest.param(
            "def reorder(weight, scale, dim=-2,",
            "def reorder(weight, scale, dim=-2, cap=64,",
            "pkg.ops: reorder: adds positional parameter `cap`",
            id="adds-a-positional-parameter",
        ),
        pytest.param(
            "def reorder(weight, scale, dim=-2,",
            "def reorder(weight, scale, dim=-1,",
            "pkg.ops: reorder: default of `dim`: `-2` upstream, `-1` in the branch",
            id="changes-a-default",
        ),
        pytest.param(
            "*, chunk=None):",
            "*, chunk=None, cap):",
            "pkg.ops: reorder: adds keyword-only parameter `cap` without a default",
            id="adds-a-required-keyword",
        ),
        pytest.param(
            "def reorder(weight, scale, dim=-2, *, chunk=None):",
            "def reorder(weight, scale, *, dim=-2, chunk=None):",
            "pkg.ops: reorder: `dim` is positional upstream, keyword-only in the "
            "branch",
            id="makes-a-parameter-keyword-only",
        ),
        pytest.param(
            "def reorder(weight, scale, dim=-2, *, chunk=None):",
            "def reorder(scale, weight, dim=-2, *, chunk=None):",
            "pkg.ops: reorder: positional order: upstream (weight, scale, dim), "
            "branch (scale, weight, dim)",
            id="swaps-two-parameters",
        ),
        pytest.param(
            "def reorder(weight, scale, dim=-2, *, chunk=None):",
            "def reorder(weight, scale, dim=-2, *, chunk=None, **kwargs):",
            "pkg.ops: reorder: adds **kwargs",
            id="adds-kwargs",
        ),
    ],
)
def test_function_differences_are_reported(old, new, expected):
    assert expected in _differences(_edit(old, new), "reorder")


@pytest.mark.parametrize(
    "old, new, expected",
    [
        pytest.param(
            "    @staticmethod\n    def activation_format():",
            "    def activation_format(self):",
            "pkg.ops: Experts.activation_format: a staticmethod upstream, a method "
            "in the branch",
            id="staticmethod-to-method",
        ),
        pytest.param(
            "class Experts(Base, b.Other):",
            "class Experts(Base):",
            "pkg.ops: Experts: drops base `pkg.base.Other`",
            id="drops-a-base",
        ),
        pytest.param(
            "    def apply(self, out, x, w1, w2):",
            "    def apply(self, out, x, w1):",
            "pkg.ops: Experts.apply: drops parameter `w2`",
            id="method-drops-a-parameter",
        ),
        pytest.param(
            "    def __init__(self, config, quant):",
            "    def __init__(self, config, quant_config):",
            "pkg.ops: Experts.__init__: renames parameter 3 `quant` to `quant_config`",
            id="init-renames-a-parameter",
        ),
        pytest.param(
            "    @property\n    def expects_inputs(self) -> bool:",
            "    def expects_inputs(self) -> bool:",
            "pkg.ops: Experts.expects_inputs: a property upstream, a method in the "
            "branch",
            id="property-to-method",
        ),
        pytest.param(
            "    @staticmethod\n    def _supports_device() -> bool:\n"
            "        return True\n",
            "",
            "pkg.ops: Experts._supports_device: not defined by the branch's class "
            "(it inherits `pkg.base.Base`'s)",
            id="drops-a-hook-override",
        ),
        pytest.param(
            "        self.hidden = 16\n",
            "",
            "pkg.ops: Experts.hidden: missing instance attribute (upstream's "
            "`__init__` sets it)",
            id="drops-an-instance-attribute",
        ),
        pytest.param(
            "    LIMIT = 4\n",
            "",
            "pkg.ops: Experts.LIMIT: missing (upstream: attribute)",
            id="drops-a-class-attribute",
        ),
        pytest.param(
            "    def apply(self, out, x, w1, w2):\n        return out\n",
            "    def apply(self, out, x, w1, w2):\n        return out\n\n"
            "    def finalize(self, out, scale=1.0):\n        return out\n",
            "pkg.ops: Experts.finalize: overrides `pkg.base.Base`'s: `scale` is "
            "keyword-only upstream, positional in the branch",
            id="overrides-a-base-method-incompatibly",
        ),
    ],
)
def test_class_differences_are_reported(old, new, expected):
    assert expected in _differences(_edit(old, new), "Experts")


def test_inherited_instance_attribute_counts_as_present():
    # Upstream's class sets `max_tokens` itself; the branch's inherits it
    # from Base.__init__.
    upstream = _edit(
        "        self.hidden = 16\n",
        "        self.hidden = 16\n        self.max_tokens = 4\n",
    )
    result = compare_definition(
        _tree("upstream", upstream), _tree("the branch", UPSTREAM), MODULE, "Experts"
    )
    assert "Experts.max_tokens" in result.compared
    assert result.differences == []


def test_a_stand_in_upstream_lacks_is_a_difference():
    branch = UPSTREAM + "\n\ndef helper(x):\n    return x\n"
    up, br = _tree("upstream", UPSTREAM), _tree("the branch", branch)
    assert compare_definition(up, br, MODULE, "helper").added == ["helper"]
    stand_in = compare_definition(up, br, MODULE, "helper", must_exist=True)
    assert [str(d) for d in stand_in.differences] == [
        "pkg.ops: helper: upstream does not define it"
    ]


def test_a_kind_change_is_a_difference():
    branch = UPSTREAM.replace(
        "def reorder(weight, scale, dim=-2, *, chunk=None):\n"
        "    return weight, scale\n",
        "reorder = None\n",
    )
    assert _differences(branch, "reorder") == [
        "pkg.ops: reorder: a function upstream, an assignment in the branch"
    ]


def test_signature_text_and_kinds():
    sig = Signature(
        (
            Param("a", "positional-only"),
            Param("b", "positional", "1"),
            Param("args", "*args"),
            Param("c", "keyword-only", "None"),
            Param("kw", "**kwargs"),
        )
    )
    assert sig.text() == "(a, /, b=1, *args, c=None, **kw)"
    assert signature_differences(sig, sig) == []


def test_dataclass_init_comes_from_its_fields():
    up = _src("""
        from dataclasses import dataclass, field


        @dataclass
        class Config:
            num_experts: int
            hidden: int
            device: str = "cpu"
            tags: list = field(default_factory=list)
    """)
    br = up.replace("    hidden: int\n", "").replace('"cpu"', '"cuda"')
    result = compare_definition(
        _tree("upstream", up), _tree("the branch", br), MODULE, "Config"
    )
    assert [str(d) for d in result.differences] == [
        "pkg.ops: Config.__init__: drops parameter `hidden`",
        "pkg.ops: Config.__init__: default of `device`: `'cpu'` upstream, "
        "`'cuda'` in the branch",
        "pkg.ops: Config.hidden: missing (upstream: attribute)",
    ]


def test_qualify_follows_re_exports():
    files = {
        "pkg": ModuleInfo("pkg/__init__.py", "from pkg.base import Base\n", True),
        "pkg.base": ModuleInfo("pkg/base.py", BASE, False),
        "pkg.user": ModuleInfo(
            "pkg/user.py",
            "import pkg.base as mk\nfrom pkg import Base\nfrom abc import ABC\n",
            False,
        ),
    }
    tree = SourceTree(files.get)
    assert tree.qualify("pkg.user", ["Base"]) == "pkg.base.Base"
    assert tree.qualify("pkg.user", ["mk", "Other"]) == "pkg.base.Other"
    assert tree.qualify("pkg.user", ["ABC"]) == "abc.ABC"
    assert tree.qualify("pkg.user", ["len"]) == "builtins.len"
    assert public_names(tree, "pkg.base") == ["Base", "Other"]


def test_importer_uses_find_every_way_a_file_takes_a_name():
    text = _src("""
        import pkg.ops
        import pkg.ops as ops_alias
        from pkg import ops
        from pkg.ops import reorder as r


        def f(x):
            from .ops import Experts

            ops.LIMIT
            getattr(ops_alias, "activation_format")
            pkg.ops.apply
            return r(x, 1, dim=0), Experts
    """)
    uses = importer_uses("pkg/user.py", text, {MODULE})
    assert {(u.module, u.name) for u in uses} == {
        (MODULE, n)
        for n in ("reorder", "Experts", "LIMIT", "activation_format", "apply")
    }
    (call,) = [u for u in uses if u.call is not None]
    assert (call.name, call.call) == ("reorder", CallShape(2, ("dim",)))


def test_code_uses_find_chains_self_super_and_annotated_parameters():
    text = _src("""
        import pkg.base as mk
        from pkg.base import Base


        class Experts(mk.Base):
            def __init__(self, config: Base | None):
                super().__init__(config=config)
                self.own = config.max_tokens
                mk.Base._supports_device()

            def run(self):
                return self.finalize(1, scale=2.0), self.own
    """)
    uses = code_uses("pkg/ops.py", text, ["Experts"])
    found = {(u.root, u.origin, u.attrs, u.call) for u in uses}
    module = ("module", "pkg.base")
    assert ("mk", module, ("Base",), None) in found
    assert ("mk", module, ("Base", "_supports_device"), CallShape(0, ())) in found
    assert (
        "super",
        ("class", "Experts"),
        ("__init__",),
        CallShape(0, ("config",)),
    ) in found
    assert ("config", ("annotation", "Base"), ("max_tokens",), None) in found
    assert (
        "self",
        ("class", "Experts"),
        ("finalize",),
        CallShape(1, ("scale",)),
    ) in found
