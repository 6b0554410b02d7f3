# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The tree's import rules, read from the source with ``ast`` (nothing is
imported): no import circle among ``vllm/`` modules, and no test outside
``tests/benchmarks/`` importing ``vllm.benchmarks``."""

from __future__ import annotations

import ast
import re
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_THIS_FILE = Path(__file__).resolve().relative_to(ROOT)

#: Imports left out of the module graph, each with its reason; every one
#: must still be in the tree (a stale entry fails the test).
ALLOWED_EDGES = {
    (
        "vllm.model_executor.layers.quantization.utils.flashinfer_fp4_moe",
        "vllm.model_executor.layers.fused_moe.oracle.nvfp4",
    ): "upstream 0.33.0's own delayed import in prepare_nvfp4_moe_layer_for_fi_"
    "or_cutlass (oracle.nvfp4 imports flashinfer_fp4_moe at module level)",
}

#: Code in a string (a script a test runs in a subprocess) counts too.
_IMPORT_IN_TEXT = re.compile(
    r"^\s*(?:from\s+vllm\.benchmarks\b|import\s+vllm\.benchmarks\b|"
    r"from\s+vllm\s+import\s+(?:.*\b)?benchmarks\b)",
    re.MULTILINE,
)


def _modules(root: Path, package: str) -> dict[str, Path]:
    """Dotted module name -> file, for every .py under ``root / package``."""
    mods = {}
    for path in sorted((root / package).rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        mods[".".join(parts)] = path
    return mods


def _imported_names(path: Path, module: str, is_package: bool) -> set[str]:
    """Every dotted name ``path`` imports, at module level or inside a
    function (a delayed import is a circle all the same); ``from a import
    b`` gives ``a.b`` and ``a``: the caller keeps whichever is a module."""
    package = module if is_package else module.rpartition(".")[0]
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                parts = parts[: len(parts) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names)
    return names


def import_graph(root: Path, package: str = "vllm") -> dict[str, set[str]]:
    """Module -> the modules of ``package`` it imports (the longest dotted
    prefix of each imported name that is a module of the tree)."""
    mods = _modules(root, package)
    graph = {}
    for module, path in mods.items():
        edges = set()
        for name in _imported_names(path, module, path.name == "__init__.py"):
            while name and name not in mods:
                name = name.rpartition(".")[0]
            if name and name != module:
                edges.add(name)
        graph[module] = edges
    return graph


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan),
    each as a sorted list: empty when the graph has no circle."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components = []
    for start in sorted(graph):
        if start in index:
            continue
        # Iterative, so deep chains cannot hit the recursion limit.
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    components.append(sorted(component))
    return components


def benchmark_imports(root: Path) -> list[str]:
    """Test files outside ``tests/benchmarks/`` that import
    ``vllm.benchmarks`` (in code, or in code they run from a string); this
    file, whose controls spell such imports, is not read."""
    found = []
    for path in sorted((root / "tests").rglob("*.py")):
        rel = path.relative_to(root)
        if rel.parts[:2] == ("tests", "benchmarks") or rel == _THIS_FILE:
            continue
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            hit = None
            if isinstance(node, ast.Import):
                hit = next((a.name for a in node.names if _is_benchmarks(a.name)), None)
            elif isinstance(node, ast.ImportFrom) and not node.level:
                module = node.module or ""
                if _is_benchmarks(module):
                    hit = module
                elif module == "vllm" and any(
                    a.name == "benchmarks" for a in node.names
                ):
                    hit = "vllm.benchmarks"
            elif (
                isinstance(node, ast.Constant)
                and isinstance(node.value, str)
                and _IMPORT_IN_TEXT.search(textwrap.dedent(node.value))
            ):
                hit = "vllm.benchmarks (in a string)"
            if hit:
                found.append(f"{rel}:{node.lineno}: {hit}")
    return found


def _is_benchmarks(name: str) -> bool:
    return name == "vllm.benchmarks" or name.startswith("vllm.benchmarks.")


def test_no_import_circle_among_vllm_modules():
    graph = import_graph(ROOT)
    for (src, dst), reason in ALLOWED_EDGES.items():
        assert dst in graph.get(src, set()), (
            f"ALLOWED_EDGES lists {src} -> {dst} ({reason}), which the tree no "
            "longer imports: remove the entry"
        )
        graph[src].discard(dst)
    cycles = find_cycles(graph)
    assert not cycles, "import circles among vllm/ modules:\n" + "\n".join(
        " <-> ".join(c) for c in cycles
    )


def _write(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))


def test_a_planted_import_circle_is_found(tmp_path):
    # Control: the detector sees a circle made of a delayed import and a
    # relative one, as the benchmark's ranks -> run -> ranks was, and leaves
    # a chain without one alone.
    _write(
        tmp_path,
        {
            "vllm/__init__.py": "",
            "vllm/pkg/__init__.py": "",
            "vllm/pkg/ranks.py": """
                def job():
                    from vllm.pkg.run import run
                    return run
            """,
            "vllm/pkg/run.py": "from .ranks import job\n",
            "vllm/pkg/leaf.py": "import vllm.pkg.run\n",
        },
    )
    graph = import_graph(tmp_path)
    assert graph["vllm.pkg.leaf"] == {"vllm.pkg.run"}
    assert find_cycles(graph) == [["vllm.pkg.ranks", "vllm.pkg.run"]]
    (tmp_path / "vllm/pkg/ranks.py").write_text("def job():\n    return None\n")
    assert find_cycles(import_graph(tmp_path)) == []


def test_no_test_outside_tests_benchmarks_imports_vllm_benchmarks():
    found = benchmark_imports(ROOT)
    assert not found, (
        "tests outside tests/benchmarks/ import vllm.benchmarks (a test helper "
        "belongs in tests/):\n" + "\n".join(found)
    )


def test_a_planted_benchmark_import_is_found(tmp_path):
    # Control: each spelling is caught outside tests/benchmarks, none inside.
    spellings = {
        "a.py": "from vllm.benchmarks.moe_weight_prep.presets import get_preset\n",
        "b.py": "import vllm.benchmarks.moe_weight_prep.run as job\n",
        "c.py": "from vllm import benchmarks\n",
        "d.py": 'SCRIPT = """\n    from vllm.benchmarks.x import y\n"""\n',
        "e.py": "def f():\n    import vllm.benchmarks\n",
    }
    _write(tmp_path, {f"tests/kernels/{k}": v for k, v in spellings.items()})
    _write(tmp_path, {f"tests/benchmarks/{k}": v for k, v in spellings.items()})
    _write(tmp_path, {"tests/kernels/ok.py": "import vllm.benchmarking_notes\n"})
    found = benchmark_imports(tmp_path)
    assert [f.split(":")[0] for f in found] == [
        f"tests/kernels/{k}" for k in sorted(spellings)
    ], found
