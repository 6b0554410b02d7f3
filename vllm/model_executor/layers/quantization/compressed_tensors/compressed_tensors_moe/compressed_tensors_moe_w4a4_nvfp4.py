# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The branch's edit in vLLM's compressed_tensors_moe_w4a4_nvfp4.py is in
tools/fork_manifest.toml (statements inserted)."""
