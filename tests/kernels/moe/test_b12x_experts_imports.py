# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The b12x experts import no module that imports them back: the NVFP4
oracle picks the experts, so neither it nor ``flashinfer_fp4_moe`` (which
imports the oracle) comes in with them."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
EXPERTS = "vllm.model_executor.layers.fused_moe.experts"
OWNERS_OF_THE_EXPERTS = (
    "vllm.model_executor.layers.fused_moe.oracle.nvfp4",
    "vllm.model_executor.layers.quantization.utils.flashinfer_fp4_moe",
)


def test_importing_the_experts_imports_no_module_that_imports_them():
    modules = ", ".join(
        (f"{EXPERTS}.flashinfer_b12x_w4a4", f"{EXPERTS}.flashinfer_b12x_w4a16")
        + (f"{EXPERTS}.flashinfer_b12x_moe",)
    )
    code = (
        f"import sys, {modules}\n"
        f"print(sorted(m for m in {OWNERS_OF_THE_EXPERTS!r} if m in sys.modules))"
    )
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    out = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    assert out.stdout.strip() == "[]", out.stdout


def test_no_import_of_the_experts_modules_names_an_owner_even_inside_a_function():
    # The static form of the test above: an import a step runs later (inside
    # a function) closes the same circle when the step runs.
    import ast

    experts_dir = ROOT / "vllm/model_executor/layers/fused_moe/experts"
    files = [p for p in experts_dir.glob("flashinfer_b12x_*.py")]
    files += (ROOT / "vllm/model_executor/layers/fused_moe").glob("weight_prep_*.py")
    assert len(files) >= 9, files
    found = []
    for path in files:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            if any(n in OWNERS_OF_THE_EXPERTS for n in names):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert found == []
