"""What one stage recomputes (`StagePlan`), and the plan of a uniform recompute mode for a stage. Pure data:
the memory model, the FLOP count, the layout print-out and the engine all read the same plan.

Plans never look outside their stage, so stage boundaries are always checkpoint boundaries.
"""

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from parallel.config import FullRecompute, NoRecompute, RecomputeConfig, SelectiveRecompute


@dataclass(frozen=True)
class StagePlan:
    """What one stage recomputes, by local layer index."""

    segments: tuple[tuple[int, int], ...] = ()
    """[start, stop) local layer ranges, each run as one checkpointed segment."""
    selective: dict[int, tuple[str, ...]] = field(default_factory=dict)
    """Local block index -> modules recomputed inside that block."""

    def choice_of(self, local_index: int) -> str:
        """`none`, `full` or `selective:<modules>` for one local layer (for print-outs and W&B)."""
        if any(start <= local_index < stop for start, stop in self.segments):
            return "full"
        if local_index in self.selective:
            return "selective:" + "+".join(self.selective[local_index])
        return "none"


def segment_length(interval: str, blocks_in_stage: int) -> int:
    if interval == "stage":
        return max(1, blocks_in_stage)
    if interval == "sqrt":
        return max(1, round(math.sqrt(blocks_in_stage)))
    return int(interval)


def plan_stage(is_block: Sequence[bool], recompute: RecomputeConfig) -> StagePlan:
    """The plan for a stage whose local layers are blocks where `is_block` is true."""
    block_positions = [i for i, flag in enumerate(is_block) if flag]
    if isinstance(recompute, NoRecompute) or not block_positions:
        return StagePlan()
    if isinstance(recompute, SelectiveRecompute):
        return StagePlan(selective={i: tuple(recompute.modules) for i in block_positions})
    if isinstance(recompute, FullRecompute):
        length = segment_length(recompute.interval, len(block_positions))
        # Blocks of a stage are contiguous in the flat sequence, so a segment is a plain range.
        segments = tuple(
            (block_positions[i], block_positions[min(i + length, len(block_positions)) - 1] + 1)
            for i in range(0, len(block_positions), length)
        )
        return StagePlan(segments=segments)
    raise TypeError(f"unknown recompute config {recompute!r}")
