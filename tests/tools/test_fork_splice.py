# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""tools/fork_splice.py: definitions spliced into upstream's text exactly, the
rest byte-for-byte; every name they use resolves as in the branch, or a clear
error names the file and the definition."""

import textwrap

import pytest

from tools.fork_splice import (
    ModuleInfo,
    SpliceError,
    check_compiles,
    check_imports,
    check_replacement,
    env_variable_names,
    set_version,
    splice_definitions,
    splice_envs,
    top_level_names,
)

PATH = "pkg/ops.py"


def _src(text: str) -> str:
    return textwrap.dedent(text).lstrip("\n")


UPSTREAM = _src('''
    """Upstream's ops."""

    import math

    from pkg.util import clamp  # upstream's import comment

    __all__ = [
        "reorder",
        "scale",
    ]


    def _traced(fn):
        return fn


    def scale(x: float) -> float:
        # Upstream's comment.
        return clamp(x * 2.0)


    @_traced
    def reorder(values: list[int]) -> list[int]:
        """Upstream's reorder."""
        return values[::-1]


    def tail() -> int:
        return math.floor(2.5)
''')

BRANCH = _src('''
    """The branch's ops."""

    import math

    from pkg.chunks import DEFAULT_CHUNK, chunked, unused
    from pkg.util import clamp

    __all__ = ["reorder", "reorder_into", "scale"]

    CHUNK_LIMIT = DEFAULT_CHUNK * 2


    def _traced(fn):
        return fn


    def scale(x: float) -> float:
        # The branch's formatting of the same code.
        return clamp(
            x * 2.0
        )


    def reorder(values: list[int], chunk: int = CHUNK_LIMIT) -> list[int]:
        """The branch's reorder: reversed, chunk by chunk."""
        out: list[int] = []
        for part in chunked(values[::-1], chunk):
            out.extend(part)
        return out


    # Writes into a given list.
    def reorder_into(values: list[int], out: list[int]) -> None:
        out[:] = reorder(values)


    def tail() -> int:
        return math.floor(2.5)
''')

# CHUNK_LIMIT goes before reorder, whose default needs it when the module
# runs; reorder_into is only called later, so it goes at the end. The import
# holds only the names the spliced code uses (not `unused`).
EXPECTED = _src('''
    """Upstream's ops."""

    import math

    from pkg.util import clamp  # upstream's import comment
    from pkg.chunks import DEFAULT_CHUNK, chunked

    __all__ = [
        "reorder",
        "scale",
        "reorder_into",
    ]


    def _traced(fn):
        return fn


    def scale(x: float) -> float:
        # Upstream's comment.
        return clamp(x * 2.0)


    CHUNK_LIMIT = DEFAULT_CHUNK * 2


    def reorder(values: list[int], chunk: int = CHUNK_LIMIT) -> list[int]:
        """The branch's reorder: reversed, chunk by chunk."""
        out: list[int] = []
        for part in chunked(values[::-1], chunk):
            out.extend(part)
        return out


    def tail() -> int:
        return math.floor(2.5)


    # Writes into a given list.
    def reorder_into(values: list[int], out: list[int]) -> None:
        out[:] = reorder(values)
''')


def test_splice_replaces_adds_imports_and_lists_exactly():
    text, report = splice_definitions(
        PATH, UPSTREAM, BRANCH, ["reorder", "CHUNK_LIMIT", "reorder_into", "scale"]
    )
    assert text == EXPECTED
    assert [
        (d.name, d.action, d.lines_before, d.lines_after) for d in report.definitions
    ] == [
        ("reorder", "replaced", 4, 6),  # upstream's span includes its decorator
        # Same code, other formatting: upstream's text is kept.
        ("scale", "unchanged", 3, 3),
        ("CHUNK_LIMIT", "added", 0, 1),
        ("reorder_into", "added", 0, 3),  # with its comment line
    ]
    assert report.imports_added == ["from pkg.chunks import DEFAULT_CHUNK, chunked"]
    assert report.all_added == ["reorder_into"]
    assert (report.lines_before, report.lines_after) == (
        UPSTREAM.count("\n"),
        EXPECTED.count("\n"),
    )


def test_long_import_is_wrapped_as_ruff_does():
    branch = _src("""
        from pkg.a_rather_long_module_name.and_a_deeper_one import (
            first_helper_name,
            second_helper_name,
        )


        def f():
            return first_helper_name, second_helper_name
    """)
    text, _ = splice_definitions(PATH, "import os\n", branch, ["f"])
    assert text == _src("""
        import os
        from pkg.a_rather_long_module_name.and_a_deeper_one import (
            first_helper_name,
            second_helper_name,
        )


        def f():
            return first_helper_name, second_helper_name
    """)


def test_locals_builtins_comprehensions_and_recursion_need_nothing():
    branch = _src("""
        def f(n):
            total = sum(i for i in range(n))
            g = lambda k: k + total
            class Local:
                size = len([j for j in range(n)])
            return g(Local.size) + f(n - 1) if n else print(total)
    """)
    text, report = splice_definitions(PATH, "x = 1\n", branch, ["f"])
    assert report.imports_added == []
    assert text.startswith("x = 1\n\n\ndef f(n):\n")


def test_a_name_only_in_a_string_annotation_is_not_needed():
    branch = _src("""
        from typing import TYPE_CHECKING

        if TYPE_CHECKING:
            from pkg.layer import Layer


        def f(layer: "Layer") -> "list[Layer]":
            return [layer]
    """)
    text, report = splice_definitions(PATH, "x = 1\n", branch, ["f"])
    assert report.imports_added == []


# --- names that do not resolve as in the branch


def _error(upstream: str, branch: str, names: list[str]) -> str:
    with pytest.raises(SpliceError) as info:
        splice_definitions(PATH, upstream, branch, names)
    return str(info.value)


def test_a_helper_upstream_lacks_must_be_listed():
    branch = "def _helper():\n    return 1\n\n\ndef f():\n    return _helper()\n"
    assert _error("x = 1\n", branch, ["f"]) == (
        "_helper used by f is not defined in upstream's pkg/ops.py: add it to the "
        "manifest or import it"
    )
    # Listing it is the fix.
    splice_definitions(PATH, "x = 1\n", branch, ["f", "_helper"])


def test_a_changed_helper_that_is_not_listed_is_an_error():
    upstream = "def _helper():\n    return 1\n"
    branch = "def _helper():\n    return 2\n\n\ndef f():\n    return _helper()\n"
    assert _error(upstream, branch, ["f"]) == (
        "pkg/ops.py: _helper used by f differs between the branch (line 1) and "
        "upstream (line 1): add _helper to the manifest's definitions"
    )


def test_a_stand_in_keeps_upstreams_binding():
    # The branch carries a stand-in for code of upstream's it does not have;
    # listed as a stand-in, upstream's own (a definition, or an import) stays.
    branch = (
        "def _helper():\n    raise NotImplementedError\n\n\n"
        "def f():\n    return _helper()\n"
    )
    upstream = "def _helper():\n    return 1\n"
    text, _ = splice_definitions(PATH, upstream, branch, ["f"], ["_helper"])
    assert text == upstream + "\n\ndef f():\n    return _helper()\n"
    imported = "from pkg.util import _helper\n"
    text, _ = splice_definitions(PATH, imported, branch, ["f"], ["_helper"])
    assert text == imported + "\n\ndef f():\n    return _helper()\n"
    # Control: not listed, the difference is an error; a stand-in upstream
    # does not bind is one too.
    with pytest.raises(SpliceError, match="differs between the branch"):
        splice_definitions(PATH, upstream, branch, ["f"])
    with pytest.raises(SpliceError, match="a stand-in in the manifest, but"):
        splice_definitions(PATH, "x = 1\n", branch, ["f"], ["_helper"])


def test_an_identical_helper_is_used_as_upstream_has_it():
    upstream = "def _helper():\n    return 1\n"
    branch = "def _helper():\n    return 1\n\n\ndef f():\n    return _helper()\n"
    text, _ = splice_definitions(PATH, upstream, branch, ["f"])
    assert text == upstream + "\n\ndef f():\n    return _helper()\n"


@pytest.mark.parametrize(
    "upstream, message",
    [
        (
            "from pkg.other import clamp\n",
            "pkg/ops.py: clamp used by f: the branch imports it from pkg.util (line 1) "
            "but upstream imports it from pkg.other (line 1): import it from the same "
            "module or rename it",
        ),
        (
            "def clamp(x):\n    return x\n",
            "pkg/ops.py: clamp used by f: the branch imports it from pkg.util (line 1) "
            "but upstream defines it (line 1): import it from the same module or "
            "rename it",
        ),
    ],
    ids=["imported-elsewhere", "defined"],
)
def test_an_import_upstream_binds_otherwise_is_an_error(upstream, message):
    branch = "from pkg.util import clamp\n\n\ndef f(x):\n    return clamp(x)\n"
    assert _error(upstream, branch, ["f"]) == message


def test_the_same_import_in_both_adds_nothing():
    upstream = "from pkg.util import clamp, other\n"
    branch = "from pkg.util import clamp\n\n\ndef f(x):\n    return clamp(x)\n"
    text, report = splice_definitions(PATH, upstream, branch, ["f"])
    assert report.imports_added == []
    assert text == upstream + "\n\ndef f(x):\n    return clamp(x)\n"


def test_a_builtin_upstream_shadows_is_an_error():
    assert _error("def print(x):\n    pass\n", "def f():\n    print(1)\n", ["f"]) == (
        "pkg/ops.py: print used by f is the builtin in the branch, but upstream "
        "defines it (line 1)"
    )


# --- annotations and TYPE_CHECKING

TC_BRANCH = _src("""
    from __future__ import annotations

    from typing import TYPE_CHECKING

    if TYPE_CHECKING:
        from pkg.layer import Layer


    def f(layer: Layer) -> None:
        pass
""")


def test_a_type_checking_import_needed_at_run_time_is_an_error():
    # Upstream has no `from __future__ import annotations`: `Layer` would be
    # evaluated when f is defined.
    assert _error("import os\n", TC_BRANCH, ["f"]) == (
        "pkg/ops.py: Layer used by f is imported only under `if TYPE_CHECKING:` in "
        "the branch, but upstream's pkg/ops.py evaluates it at run time (no `from "
        "__future__ import annotations` there): quote the annotation or import it "
        "at run time in the branch"
    )


def test_a_type_checking_import_goes_into_upstreams_block():
    upstream = _src("""
        from __future__ import annotations

        from typing import TYPE_CHECKING

        if TYPE_CHECKING:
            from pkg.other import Other

        x = 1
    """)
    text, report = splice_definitions(PATH, upstream, TC_BRANCH, ["f"])
    assert text == _src("""
        from __future__ import annotations

        from typing import TYPE_CHECKING

        if TYPE_CHECKING:
            from pkg.other import Other
            from pkg.layer import Layer

        x = 1


        def f(layer: Layer) -> None:
            pass
    """)
    assert report.imports_added == ["from pkg.layer import Layer (under TYPE_CHECKING)"]


def test_a_type_checking_block_is_made_when_upstream_has_none():
    upstream = "from __future__ import annotations\n\nimport os\n\nx = 1\n"
    text, _ = splice_definitions(PATH, upstream, TC_BRANCH, ["f"])
    assert text == _src("""
        from __future__ import annotations

        import os
        from typing import TYPE_CHECKING

        if TYPE_CHECKING:
            from pkg.layer import Layer

        x = 1


        def f(layer: Layer) -> None:
            pass
    """)


def test_an_upstream_type_checking_name_needed_at_run_time_is_an_error():
    upstream = _src("""
        from typing import TYPE_CHECKING

        if TYPE_CHECKING:
            from pkg.layer import Layer
    """)
    branch = "from pkg.layer import Layer\n\n\ndef f() -> Layer:\n    return Layer()\n"
    text, report = splice_definitions(PATH, upstream, branch, ["f"])
    # Same import: the branch's run-time one is added for the run-time use.
    assert report.imports_added == ["from pkg.layer import Layer"]
    assert text.startswith("from typing import TYPE_CHECKING\nfrom pkg.layer import")


# --- order and placement


def test_a_definition_needed_before_it_can_be_placed_is_an_error():
    upstream = _src("""
        def f():
            return 1


        def g():
            return 2
    """)
    # LIMIT (added) goes before f, whose default needs it; but LIMIT itself
    # calls g, defined after f.
    branch = _src("""
        def g():
            return 2


        LIMIT = g()


        def f(n=LIMIT):
            return n
    """)
    assert _error(upstream, branch, ["f", "LIMIT"]) == (
        "pkg/ops.py: g is needed when LIMIT is defined (line 1 of the spliced file) "
        "but is not bound before it: define it earlier in the branch's file or "
        "splice it too"
    )


def test_added_definitions_go_before_a_main_block():
    upstream = 'def main():\n    pass\n\n\nif __name__ == "__main__":\n    main()\n'
    branch = "def extra():\n    pass\n"
    text, _ = splice_definitions(PATH, upstream, branch, ["extra"])
    assert text == (
        "def main():\n    pass\n\n\ndef extra():\n    pass\n\n\n"
        'if __name__ == "__main__":\n    main()\n'
    )


def test_a_file_without_a_final_newline_is_spliced():
    text, _ = splice_definitions(PATH, "x = 1", "def f():\n    pass\n", ["f"])
    assert text == "x = 1\n\n\ndef f():\n    pass\n"


# --- __all__


@pytest.mark.parametrize(
    "upstream_all, expected",
    [
        ('__all__ = ["a"]\n', '__all__ = ["a", "f"]\n'),
        ("__all__ = ('a',)\n", "__all__ = ('a', 'f',)\n"),
        ("__all__ = []\n", '__all__ = ["f",]\n'),
        ('__all__ = [\n    "a"\n]\n', '__all__ = [\n    "a",\n    "f",\n]\n'),
    ],
    ids=["one-line", "tuple", "empty", "no-trailing-comma"],
)
def test_all_gets_the_spliced_name(upstream_all, expected):
    branch = '__all__ = ["f"]\n\n\ndef f():\n    pass\n'
    text, _ = splice_definitions(PATH, upstream_all, branch, ["f"])
    assert text == expected + "\n\ndef f():\n    pass\n"
    compile(text, PATH, "exec")


def test_all_is_left_alone_when_the_branch_does_not_list_the_name():
    text, report = splice_definitions(
        PATH, '__all__ = ["a"]\n', "def _f():\n    pass\n", ["_f"]
    )
    assert text.startswith('__all__ = ["a"]\n') and report.all_added == []


def test_an_all_that_is_not_a_literal_is_an_error():
    branch = '__all__ = ["f"]\n\n\ndef f():\n    pass\n'
    assert _error('__all__ = ["a"] + ["b"]\n', branch, ["f"]) == (
        "upstream's pkg/ops.py has an __all__ (line 1) that is not a list or tuple "
        "literal of strings: cannot add names to it"
    )


# --- what can be spliced


@pytest.mark.parametrize(
    "upstream, branch, names, message",
    [
        (
            "x = 1\n",
            "y = 1\n",
            ["f"],
            "f is not a top-level definition (def, class or NAME = ...) in the "
            "branch's pkg/ops.py",
        ),
        (
            "x = 1\n",
            "def f():\n    pass\n\n\ndef f():\n    pass\n",
            ["f"],
            "f is defined 2 times in the branch's pkg/ops.py (lines 1, 5): cannot "
            "tell which to splice",
        ),
        (
            "x = 1\n",
            "f = g = 1\n",
            ["f"],
            "the branch's pkg/ops.py binds f together with other names (line 1): "
            "splice a statement that binds only f",
        ),
        (
            "from pkg.util import f\n",
            "def f():\n    pass\n",
            ["f"],
            "upstream's pkg/ops.py imports it from pkg.util (line 1) rather than as "
            "a top-level definition: cannot splice f into it",
        ),
        (
            "x = 1\n",
            "def f():\n    pass\n",
            ["__all__"],
            "pkg/ops.py: __all__ is merged (spliced names are added to upstream's), "
            "not spliced: remove it from the definitions",
        ),
        (
            "x = (\n",
            "def f():\n    pass\n",
            ["f"],
            "upstream's pkg/ops.py does not parse: line 1: '(' was never closed",
        ),
    ],
    ids=["missing", "twice", "multi-target", "upstream-import", "all", "unparsable"],
)
def test_what_cannot_be_spliced_is_named(upstream, branch, names, message):
    assert _error(upstream, branch, names) == message


def test_top_level_names():
    assert top_level_names(PATH, BRANCH) == {
        "__all__": "assign",
        "CHUNK_LIMIT": "assign",
        "_traced": "def",
        "scale": "def",
        "reorder": "def",
        "reorder_into": "def",
        "tail": "def",
    }


# --- envs (vllm/envs.py's idiom: TYPE_CHECKING annotations and lambda entries)

ENVS = "pkg/envs.py"
UPSTREAM_ENVS = _src("""
    import os
    from collections.abc import Callable
    from typing import TYPE_CHECKING, Any

    if TYPE_CHECKING:
        PKG_HOST: str = ""
        PKG_PORT: int = 8000


    def env_flag(name: str) -> Callable[[], bool]:
        return lambda: os.getenv(name, "0") == "1"


    environment_variables: dict[str, Callable[[], Any]] = {
        # The host.
        "PKG_HOST": lambda: os.getenv("PKG_HOST", ""),
        # The port.
        "PKG_PORT": lambda: int(os.getenv("PKG_PORT", "8000")),
        "PKG_DEBUG": env_flag("PKG_DEBUG")
    }


    def __getattr__(name: str):
        if name in environment_variables:
            return environment_variables[name]()
        raise AttributeError(name)
""")
BRANCH_ENVS = _src("""
    import os
    from collections.abc import Callable
    from typing import TYPE_CHECKING, Any

    if TYPE_CHECKING:
        PKG_HOST: str = ""
        PKG_THREADS: int = 1
        PKG_CAP: int = 64


    def _at_least(name: str, default: int, low: int) -> Callable[[], int]:
        return lambda: max(low, int(os.getenv(name, str(default))))


    environment_variables: dict[str, Callable[[], Any]] = {
        "PKG_HOST": lambda: os.getenv("PKG_HOST", ""),
        # Threads of the bounded steps on CPU:
        # one by default.
        "PKG_THREADS": lambda: int(
            os.getenv("PKG_THREADS", "1")
        ),
        "PKG_CAP": _at_least("PKG_CAP", 64, 1)
    }
""")


def test_envs_adds_entries_annotations_and_the_helper_before_the_dict():
    text, report = splice_envs(
        ENVS,
        UPSTREAM_ENVS,
        BRANCH_ENVS,
        ["PKG_HOST", "PKG_THREADS", "PKG_CAP"],
        ["_at_least"],
    )
    # PKG_DEBUG had no trailing comma: one is added. _at_least is called when
    # the dict is built, so it goes before the dict.
    assert text == _src("""
        import os
        from collections.abc import Callable
        from typing import TYPE_CHECKING, Any

        if TYPE_CHECKING:
            PKG_HOST: str = ""
            PKG_PORT: int = 8000
            PKG_THREADS: int = 1
            PKG_CAP: int = 64


        def env_flag(name: str) -> Callable[[], bool]:
            return lambda: os.getenv(name, "0") == "1"


        def _at_least(name: str, default: int, low: int) -> Callable[[], int]:
            return lambda: max(low, int(os.getenv(name, str(default))))


        environment_variables: dict[str, Callable[[], Any]] = {
            # The host.
            "PKG_HOST": lambda: os.getenv("PKG_HOST", ""),
            # The port.
            "PKG_PORT": lambda: int(os.getenv("PKG_PORT", "8000")),
            "PKG_DEBUG": env_flag("PKG_DEBUG"),
            # Threads of the bounded steps on CPU:
            # one by default.
            "PKG_THREADS": lambda: int(
                os.getenv("PKG_THREADS", "1")
            ),
            "PKG_CAP": _at_least("PKG_CAP", 64, 1),
        }


        def __getattr__(name: str):
            if name in environment_variables:
                return environment_variables[name]()
            raise AttributeError(name)
    """)
    assert report.variables_added == ["PKG_THREADS", "PKG_CAP"]
    assert report.variables_present == ["PKG_HOST"]
    assert report.annotations_added == ["PKG_THREADS", "PKG_CAP"]
    assert report.warnings == []
    namespace: dict = {}
    exec(compile(text, ENVS, "exec"), namespace)
    assert namespace["environment_variables"]["PKG_THREADS"]() == 1
    assert namespace["environment_variables"]["PKG_CAP"]() == 64


def _envs_error(upstream: str, branch: str, variables: list[str]) -> str:
    with pytest.raises(SpliceError) as info:
        splice_envs(ENVS, upstream, branch, variables)
    return str(info.value)


def test_envs_errors_name_the_variable():
    other_value = UPSTREAM_ENVS.replace('"PKG_PORT", "8000"', '"PKG_PORT", "9000"')
    branch = UPSTREAM_ENVS.replace("PKG_PORT: int = 8000", "PKG_PORT: int = 9000")
    assert _envs_error(other_value, UPSTREAM_ENVS, ["PKG_PORT"]) == (
        "upstream's pkg/envs.py already defines PKG_PORT (line 18) with a different "
        "value than the branch's (line 18)"
    )
    assert _envs_error(UPSTREAM_ENVS, branch, ["PKG_PORT"]) == (
        "upstream's pkg/envs.py already annotates PKG_PORT (line 7) differently from "
        "the branch (line 7)"
    )
    assert _envs_error(UPSTREAM_ENVS, BRANCH_ENVS, ["PKG_NONE"]) == (
        "PKG_NONE is not an entry of the branch's pkg/envs.py environment_variables "
        "dict"
    )
    # The helper is not listed in definitions.
    assert _envs_error(UPSTREAM_ENVS, BRANCH_ENVS, ["PKG_CAP"]) == (
        "_at_least used by PKG_CAP is not defined in upstream's pkg/envs.py: add it "
        "to the manifest or import it"
    )
    assert _envs_error("x = 1\n", BRANCH_ENVS, ["PKG_THREADS"]) == (
        "upstream's pkg/envs.py has no module-level `environment_variables = {...}` "
        "dict literal"
    )


def test_envs_without_an_annotation_warns():
    branch = _src("""
        import os

        environment_variables = {
            "PKG_X": lambda: os.getenv("PKG_X"),
        }
    """)
    text, report = splice_envs(ENVS, UPSTREAM_ENVS, branch, ["PKG_X"])
    assert report.annotations_added == []
    assert report.warnings == [
        "PKG_X has no annotation in the branch's `if TYPE_CHECKING:` block of "
        "pkg/envs.py: none added"
    ]
    assert '    "PKG_X": lambda: os.getenv("PKG_X"),\n}\n' in text


def test_env_variable_names():
    assert env_variable_names(ENVS, BRANCH_ENVS) == [
        "PKG_HOST",
        "PKG_THREADS",
        "PKG_CAP",
    ]


# --- replace, version, compile


def test_replacement_must_define_upstreams_public_names():
    upstream = _src("""
        __all__ = ["Listed"]

        Listed = 1


        class Experts:
            pass


        def make():
            pass


        _private = 1
    """)
    report = check_replacement(PATH, upstream, "Listed = 2\nExperts = make = None\n")
    assert (report.mode, report.lines_before, report.lines_after) == ("replace", 14, 2)
    with pytest.raises(SpliceError) as info:
        check_replacement(PATH, upstream, "class Experts:\n    pass\n")
    assert str(info.value) == (
        "the branch's pkg/ops.py is not a drop-in replacement for upstream's: it "
        "does not define Listed, make"
    )


def test_set_version_keeps_quotes_and_the_rest():
    text = _src("""
        # generated
        __version__ = version = '0.33.0'
        __version_tuple__ = (0, 33, 0)
        x = '0.33.0'
    """)
    new, count = set_version("pkg/_version.py", text, "0.33.0+fork")
    assert count == 1
    assert new == text.replace("= '0.33.0'\n__", "= '0.33.0+fork'\n__", 1)


def test_check_compiles_names_the_file_and_line():
    with pytest.raises(SpliceError) as info:
        check_compiles(PATH, "def f():\n    pass\nreturn 1\n")
    assert str(info.value) == (
        "the spliced pkg/ops.py does not compile: line 3: 'return' outside function"
    )


# --- imports of the package's modules in the built tree

TREE = {
    "pkg": ModuleInfo("pkg/__init__.py", "", True),
    "pkg.util": ModuleInfo("pkg/util.py", "def clamp(x):\n    return x\n", False),
    "pkg.envs": ModuleInfo("pkg/envs.py", UPSTREAM_ENVS, False),
    "pkg._C": ModuleInfo("pkg/_C", None, False),
}


def _check(text: str, names=None) -> str | None:
    try:
        check_imports("pkg/ops.py", text, TREE.get, "pkg", names)
    except SpliceError as exc:
        return str(exc)
    return None


def test_imports_that_resolve_pass():
    text = _src("""
        import os

        from pkg import envs
        from pkg._C import anything
        from pkg.util import clamp

        try:
            from pkg.optional import thing
        except ImportError:
            thing = None


        def f():
            from . import util

            return clamp(envs.PKG_PORT), util.clamp, envs.__getattr__, os.sep
    """)
    assert _check(text) is None


@pytest.mark.parametrize(
    "text, message",
    [
        (
            "from pkg.missing import x\n",
            "pkg/ops.py: line 1: imports from pkg.missing, a module the built wheel "
            'does not have: add it to the manifest (mode "new")',
        ),
        (
            "import pkg.missing\n",
            "pkg/ops.py: line 1: `import pkg.missing` names a module the built wheel "
            "does not have: add it to the manifest",
        ),
        (
            "from pkg.util import nope\n",
            "pkg/ops.py: line 1: imports nope from pkg.util, which the built "
            "pkg/util.py does not define: add it to the manifest",
        ),
        (
            "from pkg import envs\n\n\ndef f():\n    return envs.PKG_THREADS\n",
            "pkg/ops.py: line 5: envs.PKG_THREADS is not defined by the built "
            'pkg/envs.py: add it to the manifest (mode "envs")',
        ),
        (
            "import pkg.util as u\n\n\ndef f():\n    return u.nope\n",
            "pkg/ops.py: line 5: u.nope is not defined by the built pkg/util.py: add "
            "it to the manifest",
        ),
    ],
    ids=["module", "import-module", "name", "envs-variable", "module-attribute"],
)
def test_imports_that_do_not_resolve_are_named(text, message):
    assert _check(text) == message


def test_import_check_can_be_limited_to_spliced_statements():
    text = "from pkg.missing import x\n\n\ndef f():\n    return 1\n"
    assert _check(text, names=["f"]) is None
    assert _check(text, names=["x"]) is not None
