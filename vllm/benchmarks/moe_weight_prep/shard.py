# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The shard of every MoE layer one rank of ``--tp N`` prepares."""

from __future__ import annotations

from dataclasses import dataclass

from vllm.benchmarks.moe_weight_prep.presets import MoEModelPreset

__all__ = [
    "RankShard",
    "shard_of",
]


@dataclass(frozen=True)
class RankShard:
    """The shard of every MoE layer one rank prepares: I split ``tp_size``
    ways (tensor parallelism) or the experts split ``ep_size`` ways (expert
    parallelism, each expert's I whole)."""

    tp_rank: int = 0
    tp_size: int = 1
    ep_rank: int = 0
    ep_size: int = 1

    @property
    def rank(self) -> int:
        return self.tp_rank * self.ep_size + self.ep_rank

    def layer_kwargs(self) -> dict[str, int]:
        return {
            "tp_rank": self.tp_rank,
            "tp_size": self.tp_size,
            "ep_rank": self.ep_rank,
            "ep_size": self.ep_size,
        }

    def describe(self) -> str:
        if self.ep_size > 1:
            return f"EP {self.ep_rank}/{self.ep_size}"
        return f"TP {self.tp_rank}/{self.tp_size}"

    def check(self, preset: MoEModelPreset) -> None:
        """ValueError if ``preset`` cannot be split this way."""
        preset.intermediate_size_per_partition(self.tp_size)
        if preset.num_experts % self.ep_size:
            raise ValueError(
                f"--tp {self.ep_size} with --enable-expert-parallel does not divide "
                f"{preset.name}'s {preset.num_experts} experts"
            )


def shard_of(rank: int, world_size: int, expert_parallel: bool) -> RankShard:
    """Rank ``rank``'s shard of a job of ``world_size`` ranks."""
    if expert_parallel:
        return RankShard(ep_rank=rank, ep_size=world_size)
    return RankShard(tp_rank=rank, tp_size=world_size)
