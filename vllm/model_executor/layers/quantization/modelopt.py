# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The branch's edit in vLLM's modelopt.py is in tools/fork_manifest.toml
(statements inserted)."""
