# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Shared pieces of the ``vllm bench moe-weight-prep`` tests: example
checkpoints from the package's writer, and the command's arguments on one."""

from tests.model_loader.nvfp4_ckpt_utils import writer_cli_args
from vllm.model_executor.model_loader.nvfp4_checkpoint_writer import main as write

__all__ = ["checkpoint_argv", "example_checkpoint"]


def example_checkpoint(path, *flags, layers=2, experts=8, intermediate=256):
    """An NVFP4 checkpoint of ``layers`` MoE layers of ``experts`` experts
    (hidden size 256) written into ``path`` with the writer's ``flags``;
    returns ``path``."""
    write(
        writer_cli_args(
            path,
            *flags,
            layers=layers,
            experts=experts,
            hidden=256,
            intermediate=intermediate,
        )
    )
    return path


def checkpoint_argv(ckpt, *argv) -> list[str]:
    """``bench moe-weight-prep --checkpoint ckpt --no-progress`` and ``argv``."""
    return [
        "bench",
        "moe-weight-prep",
        "--checkpoint",
        str(ckpt),
        "--no-progress",
        *argv,
    ]
