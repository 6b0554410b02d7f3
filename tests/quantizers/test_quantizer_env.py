# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Collecting tests/quantizers imports neither quantizer: the tools come in
only through the ``quantized_case`` fixture, so the normal suite skips these
tests without them and their environment pays for them only when a case
runs."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
_TOOLS = ("llmcompressor", "compressed_tensors", "modelopt")


def test_collecting_the_quantizer_tests_imports_no_tool():
    code = (
        "import sys\n"
        "import tests.quantizers.conftest\n"
        "import tests.quantizers.test_quantizer_checkpoints\n"
        f"print(sorted({{m.split('.')[0] for m in sys.modules}} & set({_TOOLS!r})))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    assert result.stdout.strip().splitlines()[-1] == "[]", result.stdout
