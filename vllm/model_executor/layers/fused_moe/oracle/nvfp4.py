# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The branch's edits in vLLM's fused_moe/oracle/nvfp4.py are in
tools/fork_manifest.toml (expressions and a statement replaced)."""
