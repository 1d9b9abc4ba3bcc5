"""What one stage recomputes (`StagePlan`), and the plan of a uniform recompute mode for a stage. Pure data:
the memory model, the FLOP count, the layout print-out and the engine all read the same plan.

Plans never look outside their stage, so stage boundaries are always checkpoint boundaries.
"""

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from parallel.planning.config import FullRecompute, NoRecompute, RecomputeConfig, SelectiveRecompute


@dataclass(frozen=True)
class StagePlan:
    """What one stage recomputes, by local layer index."""

    segments: tuple[tuple[int, int], ...] = ()
    """[start, stop) local layer ranges, each run as one checkpointed segment."""
    nested: bool = False
    """Each segment's recompute checkpoints its blocks again (`recompute.nested`): it keeps only their inputs, and
    each block's interior is remade just before that block's backward."""
    compress: str = "none"
    """How each segment stores its input until its recompute (`recompute.compress`: parallel/planning/compression.py);
    `none`: as it is."""
    selective: dict[int, tuple[str, ...]] = field(default_factory=dict)
    """Local block index -> modules recomputed inside that block."""
    micro_batches: int | None = None
    """Recompute for only this many of the stage's in-flight micro-batches (`recomputes_micro_batch` says
    which); the others run with no recompute. None: all of them."""
    in_flight: int | None = None
    """Micro-batches the stage holds at once (parallel/planning/schedule_walk.py), of which `micro_batches`
    recompute: set by the layout, which knows the schedule, whenever `micro_batches` is."""
    early: bool = False
    """This stage runs its recompute as RecomputeEarly, before it waits for the gradient (never the last
    stage, whose backward follows its forward with no wait: parallel/planning/schedules.py)."""
    deferred_weights: int | None = None
    """zb-h1: the most micro-batches B'd but not W'd at a forward (ZeroBubbleH1Schedule's `deferred`), chosen
    by the layout within 1F1B's peak; None: the schedule's own default (the stage index)."""

    def to_record(self) -> dict:
        """What the stage recomputes as plain data (plan.json's per-stage `plan`, which +recompute=plan reads back:
        parallel/planning/given_plan.py): by local layer index, without what the run that reads it sets itself (the
        schedule's `early` and `deferred_weights`, and `in_flight`)."""
        return {
            "segments": [list(segment) for segment in self.segments],
            "nested": self.nested,
            "compress": self.compress,
            "selective": {str(index): list(modules) for index, modules in sorted(self.selective.items())},
            "micro_batches": self.micro_batches,
        }

    def choice_of(self, local_index: int) -> str:
        """`none`, `full`, `nested` (a block of a nested segment) or `selective:<modules>` for one local layer (for
        print-outs and W&B)."""
        if any(start <= local_index < stop for start, stop in self.segments):
            return "nested" if self.nested else "full"
        if local_index in self.selective:
            return "selective:" + "+".join(self.selective[local_index])
        return "none"

    def recomputed_in_flight(self, in_flight: int) -> int:
        """How many of the `in_flight` micro-batches live at the stage's peak run under the plan."""
        return in_flight if self.micro_batches is None else min(self.micro_batches, in_flight)

    def recomputes_micro_batch(self, index: int) -> bool:
        """Whether micro-batch `index` (0-based within the step) runs under the plan: with P = `in_flight`
        and k = `micro_batches`, those with index mod P >= P - k.

        Why this rule: DeepSpeed's 1F1B TrainSchedule runs a stage's forwards in micro-batch order and its
        backwards in the same order, so the micro-batches it holds (forward run, backward not yet: the walk
        of `in_flight_micro_batches`) are always consecutive indices, at most P of them, and exactly P at
        each peak. Any P consecutive indices hold every residue mod P once, so every peak holds exactly k
        recomputed and P - k plain micro-batches, and no shorter window holds more of either: the stage never
        keeps more than k x (bytes under the plan) + (P - k) x (bytes with none). Of the warm-up
        micro-batches 0..P-1 the later ones wait longest (their backward comes after the fill and the drain
        of every later stage; those of the steady state wait least), and these residues take the last k of
        each run of P. It is also the fewest recomputed micro-batches any rule with k per peak can have."""
        if self.micro_batches is None:
            return True
        if self.in_flight is None:
            raise RuntimeError(
                "StagePlan.micro_batches is set without in_flight: plan it through parallel/planning/layout.py"
            )
        return index % self.in_flight >= self.in_flight - self.recomputed_in_flight(self.in_flight)

    def recomputed_count(self, micro_batches: int) -> int:
        """Micro-batches of a step of `micro_batches` that run under the plan."""
        return sum(self.recomputes_micro_batch(i) for i in range(micro_batches))


def early_stages(plans: Sequence[StagePlan]) -> frozenset[int]:
    """The stages whose plan recomputes early: never the last, whose backward follows its forward."""
    return frozenset(stage for stage, plan in enumerate(plans[:-1]) if plan.early)


def with_early(plans: Sequence[StagePlan], early: bool) -> list[StagePlan]:
    """The plans with early recompute on (`early`: on every stage that recomputes, but the last) or off."""
    last = len(plans) - 1
    return [replace(p, early=early and s < last and bool(p.segments or p.selective)) for s, p in enumerate(plans)]


def segment_length(interval: str, blocks_in_stage: int) -> int:
    if interval == "stage":
        return max(1, blocks_in_stage)
    if interval == "sqrt":
        return max(1, round(math.sqrt(blocks_in_stage)))
    return int(interval)


def plan_stage(is_block: Sequence[bool], recompute: RecomputeConfig, in_flight: int | None = None) -> StagePlan:
    """The plan for a stage whose local layers are blocks where `is_block` is true; `in_flight` (the stage's
    micro-batches in flight) is needed with `recompute.micro_batches`."""
    block_positions = [i for i, flag in enumerate(is_block) if flag]
    if isinstance(recompute, NoRecompute) or not block_positions:
        return StagePlan()
    if not isinstance(recompute, (SelectiveRecompute, FullRecompute)):
        raise TypeError(f"unknown recompute config {recompute!r}")
    k = recompute.micro_batches
    per_micro_batch = {"micro_batches": k, "in_flight": in_flight if k is not None else None}
    if isinstance(recompute, SelectiveRecompute):
        return StagePlan(selective={i: tuple(recompute.modules) for i in block_positions}, **per_micro_batch)
    length = segment_length(recompute.interval, len(block_positions))
    # Blocks of a stage are contiguous in the flat sequence, so a segment is a plain range.
    segments = tuple(
        (block_positions[i], block_positions[min(i + length, len(block_positions)) - 1] + 1)
        for i in range(0, len(block_positions), length)
    )
    return StagePlan(segments=segments, nested=recompute.nested, compress=recompute.compress, **per_micro_batch)
