# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""tools/fork_branch.py on a tiny synthetic release (tests/tools/fork_fixtures.py):
each edit kind gives exactly the expected text, and every refusal names the
release, file and definition and writes nothing."""

import shutil

import libcst as cst
import pytest

from tests.tools.fork_fixtures import BUILDKITE, FILES, UPSTREAM, Toy, dedent

from fork_branch import apply_branch, main
from fork_cst import (
    add_definition,
    add_imports,
    bindings,
    buildkite_dependencies,
    drop_unused_imports,
    edit,
    find,
    sort_imports,
    source_hash,
)
from fork_manifest import Edit, load_manifest
from tool_cli import ToolError

OPS = dedent('''
    """Upstream's ops."""

    import math
    import os

    from vllm.helpers import fresh_helper, helper


    def _scale(x):
        return math.sqrt(x)


    def unchanged(a):
        return a + 2


    def pick(backend, use_a16):
        # which config
        if use_a16 and backend in ("B12X", "FLASHINFER_B12X"):
            return "w4a16"
        assert backend in [
            "X",
            "Y",
        ]
        if backend == "FLASHINFER_B12X":
            # the branch's early return
            return _scale(4.0)

        # reorder for these
        gated = True
        if gated and backend in [
            "CUTLASS",
            "TRTLLM",
        ]:
            return helper(os.sep)
        return "w4a4"


    class Experts:
        """The branch's experts."""

        def __init__(self):
            self.x = 2

        def prepare(self):
            return fresh_helper(_scale(self.x))

        def keep(self):
            return self.x  # kept as upstream wrote it
    ''')

ENVS = dedent("""
    import os

    if TYPE_CHECKING:
        VLLM_A: int = 0
        VLLM_B: bool = False

    environment_variables = {
        # upstream's variable
        "VLLM_A": lambda: int(os.getenv("VLLM_A", "0")),
        # the branch's variable
        "VLLM_B": lambda: bool(int(os.getenv("VLLM_B", "0"))),
    }
    """)


@pytest.fixture
def toy(tmp_path):
    return Toy(tmp_path)


def _apply(toy, **kwargs):
    return apply_branch(
        toy.tree, "1.0.0", repo=toy.repo, manifest=toy.manifest, **kwargs
    )


def test_every_edit_kind_gives_exactly_the_expected_text(toy):
    report = _apply(toy, source=True)
    assert (toy.tree / "vllm/ops.py").read_text() == OPS
    assert (toy.tree / "vllm/envs.py").read_text() == ENVS
    assert (toy.tree / "vllm/newmod.py").read_text() == (
        toy.repo / "vllm/newmod.py"
    ).read_text()
    assert (toy.tree / "vllm/helpers.py").read_text() == UPSTREAM["vllm/helpers.py"]
    assert sorted(report.written) == [
        ".buildkite/kernels.yaml",
        "vllm/envs.py",
        "vllm/newmod.py",
        "vllm/ops.py",
    ]


def test_buildkite_step_gets_the_uncovered_vllm_files_in_source_trees_only(toy):
    _apply(toy)
    assert (toy.tree / ".buildkite/kernels.yaml").read_text() == BUILDKITE
    fresh = Toy(toy.root / "again")
    apply_branch(
        fresh.tree, "1.0.0", repo=fresh.repo, manifest=fresh.manifest, source=True
    )
    expected = BUILDKITE.replace(
        "  - vllm/model_executor/\n",
        "  - vllm/model_executor/\n  - vllm/newmod.py\n  - vllm/ops.py\n",
    )
    assert (fresh.tree / ".buildkite/kernels.yaml").read_text() == expected


def test_each_pr_adds_its_own_uncovered_vllm_files_to_the_step(toy):
    _apply(toy, prs=["first"], source=True)
    added = "  - vllm/model_executor/\n  - vllm/newmod.py\n  - vllm/ops.py\n"
    expected = BUILDKITE.replace("  - vllm/model_executor/\n", added)
    assert (toy.tree / ".buildkite/kernels.yaml").read_text() == expected
    # the second PR alone: its ops.py, not the first's newmod.py; envs.py is
    # covered already
    fresh = Toy(toy.root / "second")
    report = apply_branch(
        fresh.tree, "1.0.0", repo=fresh.repo, manifest=fresh.manifest,
        prs=["second"], source=True,
    )  # fmt: skip
    expected = BUILDKITE.replace(
        "  - vllm/model_executor/\n", "  - vllm/model_executor/\n  - vllm/ops.py\n"
    )
    assert (fresh.tree / ".buildkite/kernels.yaml").read_text() == expected
    assert ".buildkite/kernels.yaml" in report.written


def test_a_definition_an_earlier_pr_added_is_edited_without_a_hash(toy):
    # _scale is the first PR's; upstream has none to hash
    later = '[[files]]\npath = "vllm/ops.py"\npr = "second"\n'
    later += '[[files.edits]]\nin = "_scale"\nreplace = "math.sqrt(x)"\n'
    later += 'code = "math.sqrt(x) * 2"\n'
    toy.write_manifest(FILES + later)
    _apply(toy)
    assert (toy.tree / "vllm/ops.py").read_text() == OPS.replace(
        "return math.sqrt(x)", "return math.sqrt(x) * 2"
    )


def test_one_pr_at_a_time_gives_the_same_tree_as_all_at_once(toy):
    _apply(toy, prs=["first"])
    first = (toy.tree / "vllm/ops.py").read_text()
    assert "def _scale" in first and 'class Experts:\n    """Upstream\'s' in first
    _apply(toy, prs=["second"])
    fresh = Toy(toy.root / "all")
    apply_branch(fresh.tree, "1.0.0", repo=fresh.repo, manifest=fresh.manifest)
    assert toy.snapshot() == fresh.snapshot()


def test_same_inputs_give_the_same_bytes(toy):
    other = Toy(toy.root / "other")
    _apply(toy, source=True)
    apply_branch(
        other.tree, "1.0.0", repo=other.repo, manifest=other.manifest, source=True
    )
    assert toy.snapshot() == other.snapshot()


def _refused(toy, match, **kwargs):
    before = toy.snapshot()
    with pytest.raises(ToolError, match=match) as info:
        _apply(toy, **kwargs)
    assert "\n" not in str(info.value)
    assert toy.snapshot() == before, "a refused apply wrote something"
    return str(info.value)


def test_a_planted_change_in_upstream_stops_it_naming_release_file_definition(toy):
    path = toy.tree / "vllm/ops.py"
    path.write_text(path.read_text().replace('return "w4a4"', 'return "w4a8"'))
    message = _refused(toy, "upstream's source changed")
    assert message.startswith("vllm 1.0.0: vllm/ops.py: pick: ")


def test_a_comment_changed_upstream_is_drift(toy):
    path = toy.tree / "vllm/ops.py"
    path.write_text(path.read_text().replace("# which config", "# which configs"))
    _refused(toy, "vllm 1.0.0: vllm/ops.py: pick: upstream's source changed")


def test_a_name_defined_twice_is_refused(toy):
    path = toy.tree / "vllm/ops.py"
    path.write_text(path.read_text() + "\n\ndef unchanged(a):\n    return a\n")
    _refused(toy, "vllm 1.0.0: vllm/ops.py: unchanged: unchanged: defined twice")


def test_whitespace_alone_is_not_drift(toy):
    path = toy.tree / "vllm/ops.py"
    path.write_text(path.read_text().replace("return  a  +  1", "return a+1"))
    _apply(toy)
    assert (toy.tree / "vllm/ops.py").read_text() == OPS


def test_an_unknown_release_is_refused_with_the_supported_list(toy):
    with pytest.raises(
        ToolError, match=r"vllm 9\.9\.9 is not supported \(1\.0\.0 are\)"
    ):
        apply_branch(toy.tree, "9.9.9", repo=toy.repo, manifest=toy.manifest)


def test_the_cli_refuses_with_one_line_and_exit_2(toy, capsys):
    assert main(["apply", str(toy.tree), "0.1.0"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "not supported (0.34.0, 0.33.0 are)" in err


@pytest.mark.parametrize(
    "old, new, match",
    [
        # an anchor upstream's definition does not have, or has twice
        (
            'insert_before = "gated = True"',
            'insert_before = "gated = False"',
            "matches 0 places",
        ),
        (
            'insert_before = "gated = True"',
            'insert_before = "return \\"w4a8\\""',
            "matches 0 places",
        ),
        (
            """replace = "backend == 'B12X' and use_a16\"""",
            'replace = "backend"',
            "matches 4 places",
        ),
        ("remove = '\"B12X\"'", "remove = '\"B13X\"'", "is not once an element"),
        # the branch's `if` to take is not there
        (
            "take = 'backend == \"FLASHINFER_B12X\"'",
            "take = 'backend == \"B14X\"'",
            "matches 0 places",
        ),
        # names the files do not define
        (
            'drop = ["Experts.MAP", "Experts.old"]',
            'drop = ["Experts.gone"]',
            "Experts.gone: not found",
        ),
        ('add = ["Experts.prepare"]', 'add = ["Experts.keep"]', "upstream defines it"),
    ],
)
def test_anchors_and_names_must_match_exactly_once(toy, old, new, match):
    assert old in FILES
    toy.write_manifest(FILES.replace(old, new))
    assert "vllm 1.0.0: vllm/ops.py" in _refused(toy, match)


def test_an_anchor_matching_two_places_is_refused(toy):
    path = toy.tree / "vllm/ops.py"
    text = path.read_text().replace(
        '    return "w4a4"', '    gated = True\n    return "w4a4"'
    )
    path.write_text(text)
    toy.write_manifest()  # hashes of the changed upstream: drift passes
    _refused(
        toy, "vllm 1.0.0: vllm/ops.py: pick: 'gated = True' matches 2 places, not 1"
    )


def test_a_relied_on_definition_needs_its_hash_and_is_checked(toy):
    # The branch's _scale calls keep_me, which upstream defines (the branch's
    # file has it as a stand-in): the fork relies on upstream's.
    stand_in = "\n\ndef keep_me():\n    return 1\n"
    branch = (toy.repo / "vllm/ops.py").read_text()
    branch = branch.replace("math.sqrt(x)", "math.sqrt(x) + keep_me()")
    (toy.repo / "vllm/ops.py").write_text(branch + stand_in)
    ops = toy.tree / "vllm/ops.py"
    ops.write_text(ops.read_text() + stand_in)
    _refused(
        toy, r"vllm/ops.py: keep_me: no sha256 recorded \(the branch relies on it\)"
    )
    toy.write_manifest(extra=("keep_me",))
    ops.write_text(ops.read_text().replace("return 1", "return 2"))
    _refused(toy, "vllm/ops.py: keep_me: upstream's source changed")
    ops.write_text(ops.read_text().replace("return 2", "return 1"))
    _apply(toy)
    assert "math.sqrt(x) + keep_me()" in ops.read_text()


def test_code_reading_a_name_upstream_lacks_is_refused(toy):
    text = (toy.repo / "vllm/ops.py").read_text().replace("math.sqrt(x)", "_missing(x)")
    (toy.repo / "vllm/ops.py").write_text(text + "\n\ndef _missing(x):\n    return x\n")
    _refused(toy, "reads _missing; upstream does not define it")


def test_a_new_file_upstream_already_has_is_refused(toy):
    (toy.tree / "vllm/newmod.py").write_text("UPSTREAMS = 1\n")
    _refused(toy, "vllm/newmod.py: the release already has this file")


def test_an_import_that_does_not_resolve_is_refused(toy):
    (toy.repo / "vllm/newmod.py").write_text("from vllm.helpers import nothing\n")
    _refused(toy, "imports nothing from vllm.helpers, which lacks it")
    (toy.repo / "vllm/newmod.py").write_text("from vllm.nowhere import x\n")
    _refused(toy, "imports vllm.nowhere, which the tree lacks")


def test_envs_refuses_a_variable_upstream_has(toy):
    path = toy.tree / "vllm/envs.py"
    path.write_text(path.read_text().replace('"VLLM_A"', '"VLLM_B"'))
    _refused(toy, "vllm/envs.py: upstream has VLLM_B")


def test_an_unknown_pr_is_refused(toy):
    with pytest.raises(
        ToolError, match=r"no PR 'third' \(the series: \['first', 'second'\]\)"
    ):
        _apply(toy, prs=["third"])


@pytest.mark.parametrize(
    "edit, match",
    [
        ('[[files]]\npath = "vllm/ops.py"\npr = "nope"\n', "no PR 'nope'"),
        (
            '[[files]]\npath = "vllm/ops.py"\npr = "first"\nreplce = []\n',
            "unknown key 'replce'",
        ),
        ('[[files]]\npr = "first"\n', "missing or unknown key 'path'"),
    ],
)
def test_the_manifest_is_checked(toy, edit, match):
    with pytest.raises(ToolError, match=match):
        toy.write_manifest(edit, hashes=False)


def test_the_branch_files_are_read_from_src(toy):
    shutil.move(toy.repo / "vllm/envs.py", toy.repo / "elsewhere_envs.py")
    toy.write_manifest(
        FILES.replace(
            'path = "vllm/envs.py"\n',
            'path = "vllm/envs.py"\nsrc = "elsewhere_envs.py"\n',
        )
    )
    _apply(toy)
    assert (toy.tree / "vllm/envs.py").read_text() == ENVS


def test_an_entry_for_some_releases_only(toy):
    extra = '[[files]]\npath = "vllm/only_new.py"\npr = "first"\nnew = true\n'
    extra += 'src = "vllm/newmod.py"\nreleases = ["RELEASE"]\n'
    toy.write_manifest(FILES + extra.replace("RELEASE", "1.0.0"))
    _apply(toy)
    assert (toy.tree / "vllm/only_new.py").is_file()
    with pytest.raises(ToolError, match="no release 2.0.0"):
        toy.write_manifest(FILES + extra.replace("RELEASE", "2.0.0"))
    # a release the manifest has, but not this one: the entry is left out
    other = Toy(toy.root / "other")
    text = other.write_manifest(FILES + extra.replace("RELEASE", "1.0.0")).read_text()
    block = text[text.index('[releases."1.0.0"]') : text.index("[[prs]]")]
    text = text.replace('releases = ["1.0.0"]', 'releases = ["2.0.0"]')
    text = text.replace("[[prs]]", block.replace("1.0.0", "2.0.0") + "[[prs]]", 1)
    other.manifest_path.write_text(text)
    other.manifest = load_manifest(other.manifest_path)
    apply_branch(other.tree, "1.0.0", repo=other.repo, manifest=other.manifest)
    assert not (other.tree / "vllm/only_new.py").exists()


@pytest.mark.parametrize(
    "before, wanted, after",
    [
        (  # a section of its own, before the others
            '"""Doc."""\n\nfrom vllm.a import b\n\nX = 1\n',
            {"os": ("import", "", "os")},
            '"""Doc."""\n\nimport os\n\nfrom vllm.a import b\n\nX = 1\n',
        ),
        (  # the first import
            '"""Doc."""\n\nX = 1\n',
            {"os": ("import", "", "os")},
            '"""Doc."""\n\nimport os\n\nX = 1\n',
        ),
        (  # a section of its own, after the others
            "import os\n\nimport torch\n\nX = 1\n",
            {"y": ("import", "vllm.a", "y")},
            "import os\n\nimport torch\n\nfrom vllm.a import y\n\nX = 1\n",
        ),
        (  # a section of its own, between two
            "import os\n\nfrom vllm.a import b\n",
            {"torch": ("import", "", "torch")},
            "import os\n\nimport torch\n\nfrom vllm.a import b\n",
        ),
        (  # sorted into its section
            "from vllm.b import c\nfrom vllm.d import e\n",
            {"y": ("import", "vllm.c", "y"), "m": ("import", "", "vllm.m")},
            "import vllm.m as m\nfrom vllm.b import c\n"
            "from vllm.c import y\nfrom vllm.d import e\n",
        ),
        (  # merged into upstream's import of the module, constants first
            "from vllm.b import c\n",
            {"A_B": ("import", "vllm.b", "A_B"), "D": ("import", "vllm.b", "D")},
            "from vllm.b import A_B, D, c\n",
        ),
        (  # then formatted as upstream's ruff format leaves it
            "from vllm.b import c\nx = [c,c]\n",
            {},
            "from vllm.b import c\n\nx = [c, c]\n",
        ),
    ],
)
def test_imports_are_placed_as_upstreams_ruff_places_them(before, wanted, after):
    added = add_imports(cst.parse_module(before), wanted).code
    assert sort_imports(added, "vllm/x.py", "vllm", "x") == after


def test_a_new_import_keeps_the_branchs_noqa_for_a_path_too_long_to_wrap():
    long = "vllm.model_executor.layers.quantization.compressed_tensors"
    long += ".compressed_tensors_moe"
    branch = cst.parse_module(
        f"from {long} import (  # noqa: E501\n    mod as m,\n)\nfrom vllm.a import b\n"
    )
    wanted = {"m": ("import", long, "mod"), "b": ("import", "vllm.a", "b")}
    upstream = cst.parse_module("from vllm.a import c\n")
    added = add_imports(upstream, wanted, branch).code
    assert sort_imports(added, "tests/x.py", "vllm", "x") == (
        f"from vllm.a import b, c\nfrom {long} import (  # noqa: E501\n"
        "    mod as m,\n)\n"
    )
    # without the branch's comment, ruff's E501 line as before
    assert "noqa" not in add_imports(upstream, wanted).code


# Each case: upstream's file, where every import is read (USE), and what an
# edit leaves when it no longer reads the names in it.
USE = "\n\nuse(os, sys, a, b, F, G, c)\n"


@pytest.mark.parametrize(
    "edited, after",
    [
        (  # the comment above an import goes with it; the header's blank stays
            "# header\n\nimport os\n\n# after the guard\nimport sys\n\nX = 1\n",
            "# header\n\nX = 1\n",
        ),
        (  # one name of several; TYPE_CHECKING imports alike; relative ones stay
            "from vllm.x import a, b\nfrom .c import d\n\nif TYPE_CHECKING:\n"
            "    from vllm.e import F\n\n\ndef g(x: 'F'):\n    return b\n",
            "from vllm.x import b\nfrom .c import d\n\nif TYPE_CHECKING:\n"
            "    from vllm.e import F\n\n\ndef g(x: 'F'):\n    return b\n",
        ),
        (  # __all__ reads, __future__ and * imports stay
            "from __future__ import annotations\n\nfrom vllm.a import *\n"
            "from vllm.b import c\n\n__all__ = ['c']\n",
            None,
        ),
        (  # one name of several under TYPE_CHECKING
            "if TYPE_CHECKING:\n    from vllm.e import F, G\n\n\n"
            "def g(x: 'F'):\n    pass\n",
            "if TYPE_CHECKING:\n    from vllm.e import F\n\n\n"
            "def g(x: 'F'):\n    pass\n",
        ),
    ],
)
def test_imports_an_edit_stops_reading_are_dropped_with_their_comments(edited, after):
    before = cst.parse_module(edited + USE)
    got = drop_unused_imports(before, cst.parse_module(edited), "vllm/pkg/mod.py")
    assert got.code == (edited if after is None else after)


def test_bindings_are_absolute_imports_and_definitions_type_checking_too():
    module = cst.parse_module(
        "import os.path\nimport numpy as np\nfrom vllm.a import b as c, d\n"
        "from .rel import e\nfrom . import f\n\nif TYPE_CHECKING:\n"
        "    from vllm.g import H\n\nX = 1\nY = Z = 2\n\n\ndef fn():\n    pass\n"
    )
    got = {name: b for name, b in bindings(module).items() if name}
    assert got == {  # `Y = Z = 2` binds two names: not a definition
        "os": ("import", "", "os"),
        "np": ("import", "", "numpy"),
        "c": ("import", "vllm.a", "b"),
        "d": ("import", "vllm.a", "d"),
        "H": ("import", "vllm.g", "H"),
        "X": ("def",),
        "fn": ("def",),
    }


def test_a_class_docstring_is_its_first_statement_only():
    module = cst.parse_module(
        'class C:\n    """Doc."""\n\n    x: int = 0\n    """Of x."""\n'
    )
    (doc, _, _) = module.body[0].body.body
    assert find(module, "C.__doc__", "t") is doc
    with pytest.raises(ToolError, match="t: Y: not found"):
        find(cst.parse_module("Y = Z = 2\n"), "Y", "t")


@pytest.mark.parametrize(
    "branch, after",
    [  # before the next one upstream has, else after the last earlier one
        ("def a(): ...\ndef new(): ...\ndef b(): ...\n", ["a", "new", "b", "c"]),
        (
            "def a(): ...\ndef b(): ...\ndef x(): ...\ndef new(): ...\n",
            ["a", "b", "new", "c"],
        ),
        ("def new(): ...\n", ["a", "b", "c", "new"]),
        # by names only: the branch's docstring and import are not upstream's
        ('"""Doc."""\n\nimport torch\n\ndef new(): ...\n', ["a", "b", "c", "new"]),
    ],
)
def test_an_added_definition_goes_where_the_branch_has_it(branch, after):
    up = '"""Upstream\'s."""\n\nimport os\nimport sys\n\n'
    up = cst.parse_module(up + "def a(): ...\ndef b(): ...\ndef c(): ...\n")
    got = add_definition(up, cst.parse_module(branch), "new", "t")
    names = [getattr(s, "name", None) for s in got.body[3:]]
    assert [n.value for n in names if n] == after
    assert got.code.startswith('"""Upstream\'s."""\n\nimport os\nimport sys\n\n')


def test_a_decorator_goes_first_and_its_name_is_read():
    up = cst.parse_module("@pytest.mark.parametrize('m', [1])\ndef test_a(m): ...\n")
    got, reads = edit(up, up, Edit("decorate", "test_a", "requires_b12x"), "t")
    assert got.code == (
        "@requires_b12x\n@pytest.mark.parametrize('m', [1])\ndef test_a(m): ...\n"
    )
    assert reads == {"requires_b12x"}


def test_a_statement_is_replaced_keeping_upstreams_comment_above_it():
    up = cst.parse_module(
        "def f(backend):\n    # upstream's reason\n"
        "    from vllm.x import (  # noqa: E501\n        A,\n    )\n\n"
        "    return [A]\n"
    )
    code = "from vllm.x import (  # noqa: E501\n    A,\n    B,\n)\nn = len(B)\n"
    got, reads = edit(up, up, Edit("replace", "f", "from vllm.x import A", code), "t")
    assert got.code == (
        "def f(backend):\n    # upstream's reason\n"
        "    from vllm.x import (  # noqa: E501\n        A,\n        B,\n    )\n"
        "    n = len(B)\n\n    return [A]\n"
    )
    assert reads == {"len", "B", "n"}  # the import binds; the rest is read


def test_inserted_code_keeps_the_comment_lines_above_it():
    up = cst.parse_module("def f(a):\n    x = a\n    return x\n")
    code = "# the branch's step\nx = g(x)\n"
    got, reads = edit(up, up, Edit("insert_after", "f", "x = a", code), "t")
    assert got.code == (
        "def f(a):\n    x = a\n    # the branch's step\n    x = g(x)\n    return x\n"
    )
    assert reads == {"g", "x"}


def test_a_folder_covers_only_the_paths_under_it():
    text = "- label: x\n  key: s\n  source_file_dependencies:\n  - vllm/other/\n"
    paths = ["vllm/other.py", "vllm/other/x.py", "vllm/otherx/y.py"]
    assert buildkite_dependencies(text, "s", paths, "t") == (
        text + "  - vllm/other.py\n  - vllm/otherx/y.py\n"
    )


def test_the_hash_ignores_line_breaks_inside_brackets_and_blank_lines():
    one = cst.parse_module("def f(a, b):\n    return [a, b]\n")
    two = cst.parse_module("def f(a,\n      b):\n\n    return [\n        a, b]\n")
    assert source_hash(one, "f") == source_hash(two, "f")
    other = cst.parse_module("def f(a, b):\n    return [b, a]\n")
    assert source_hash(one, "f") != source_hash(other, "f")


@pytest.mark.parametrize(
    "text",
    [
        "import vllm.kernels  # noqa: F401\n\nX = 1\n",
        "import vllm._C  # noqa\n\n\ndef f():\n    import vllm._C  # noqa: F401\n",
    ],
)
def test_upstreams_side_effect_imports_are_kept(text):
    # upstream keeps them unread on purpose; an edit elsewhere leaves them be
    before = cst.parse_module(text + "\n\ndef gone():\n    return np\n")
    after = cst.parse_module(text)
    assert drop_unused_imports(before, after, "vllm/x.py").code == text


def test_dropping_an_import_a_function_repeats_is_refused():
    # libcst's remover would also take the function's own unused import
    text = "import os\n\n\ndef f():\n    import os  # noqa: F401\n"
    before = cst.parse_module(text.replace("\n\n\ndef", "\n\nX = os.sep\n\n\ndef"))
    with pytest.raises(ToolError, match="vllm/x.py: dropping os would drop a func"):
        drop_unused_imports(before, cst.parse_module(text), "vllm/x.py")


def test_a_step_without_dependencies_does_not_take_the_next_steps():
    text = "- label: x\n  key: s\n- label: y\n  key: t\n"
    text += "  source_file_dependencies:\n  - a/\n"
    with pytest.raises(ToolError, match="t: step s has no source_file_dependencies"):
        buildkite_dependencies(text, "s", ["vllm/x.py"], "t")
