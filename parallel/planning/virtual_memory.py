"""The activation bytes each rank holds under a schedule with virtual stages: the layers split into ranks x chunks
virtual stages, each priced by the per-layer memory model (parallel/planning/memory_model.py) and walked through the
rank's programme (parallel/planning/virtual_walk.py). Pure: no process group."""

import functools
from collections.abc import Sequence
from dataclasses import dataclass

from model import LayerRecipe
from parallel.planning import schedules
from parallel.planning.memory_model import stage_activations, stage_weight_grad_bytes
from parallel.planning.partition import StageRange
from parallel.planning.schedule_walk import ActivationPeak, activation_peak
from parallel.planning.shapes import Shape, Target
from parallel.planning.stage_plan import StagePlan
from parallel.planning.virtual_schedules import virtual_schedule
from parallel.planning.virtual_walk import RankMoments, VirtualPeak


def kept_bytes(recipes: Sequence[LayerRecipe], stage: StageRange, plan: StagePlan, shape: Shape, target: Target) -> int:
    """What one micro-batch keeps on the (virtual) stage from its forward to its backward under `plan`."""
    last = stage.stop == len(recipes)
    return sum(a.bytes for a in stage_activations(recipes, stage.layers, plan, shape, target, last))


@dataclass(frozen=True)
class RankWalk:
    """One rank's programme walked once, with what its chunks hold whatever their plans (W-pending bytes, received
    messages): its activation peak under any bytes its chunks keep per micro-batch."""

    virtual_stages: tuple[int, ...]
    """The rank's virtual stages, in chunk order."""
    moments: RankMoments
    weights_pending: tuple[int, ...]
    message: tuple[int, ...]
    output: tuple[int, ...]
    """Per chunk: its output, held from its forward to its backward (none on the last virtual stage)."""

    def peak(self, kept: Sequence[int]) -> VirtualPeak:
        """`kept[c]`: what chunk c keeps per micro-batch (`kept_bytes`)."""
        return self.moments.peak(kept, self.weights_pending, self.message, self.output)

    @functools.cached_property
    def rows(self) -> tuple[tuple[tuple[int, ...], int], ...]:
        return self.moments.linear(self.weights_pending, self.message, self.output)

    def peak_bytes(self, kept: Sequence[int]) -> int:
        """`peak(kept).bytes`, from the walk's few moments that can hold the peak (auto per chunk asks often)."""
        return max([0] + [sum(n * k for n, k in zip(in_flight, kept)) + held for in_flight, held in self.rows])


def rank_walks(
    recipes: Sequence[LayerRecipe],
    stages: Sequence[StageRange],
    schedule: str,
    chunks: int,
    micro_batches: int,
    shape: Shape,
    target: Target,
) -> list[RankWalk]:
    """Each rank's RankWalk under `schedule` (parallel/planning/virtual_schedules.py's) with `chunks` per rank,
    `stages` being the virtual stages in pipeline order. Besides what each chunk keeps per micro-batch (and, under a
    split backward, what its W needs), a received activation or gradient counts from its receive to the instruction
    that reads it."""
    ranks, extra = divmod(len(stages), chunks)
    if extra:
        raise ValueError(f"{len(stages)} virtual stages do not split into {chunks} chunks per rank")
    programs = virtual_schedule(schedule, micro_batches, ranks, chunks)
    placement = programs[0].placement
    split = any(c.kind is schedules.BackwardWeight for c in programs[0].commands())
    message = shape.bsh * target.dtype_bytes  # one hidden-state tensor: an activation or its gradient
    out = []
    for program in programs:
        virtual = tuple(placement.virtual_stage(program.rank, c) for c in range(chunks))
        pending = [stage_weight_grad_bytes(recipes, stages[v].layers, shape, target) if split else 0 for v in virtual]
        output = tuple(0 if v == len(stages) - 1 else message for v in virtual)
        out.append(RankWalk(virtual, RankMoments.of(program), tuple(pending), (message,) * chunks, output))
    return out


def virtual_peaks(
    recipes: Sequence[LayerRecipe],
    stages: Sequence[StageRange],
    plans: Sequence[StagePlan],
    schedule: str,
    chunks: int,
    micro_batches: int,
    shape: Shape,
    target: Target,
) -> list[VirtualPeak]:
    """Each rank's activation peak (`rank_walks`) with one plan per virtual stage."""
    return [
        walk.peak([kept_bytes(recipes, stages[v], plans[v], shape, target) for v in walk.virtual_stages])
        for walk in rank_walks(recipes, stages, schedule, chunks, micro_batches, shape, target)
    ]


def one_chunk_peaks(
    recipes: Sequence[LayerRecipe],
    stages: Sequence[StageRange],
    plans: Sequence[StagePlan],
    schedule: str,
    micro_batches: int,
    shape: Shape,
    target: Target,
) -> list[ActivationPeak]:
    """Each stage's peak under today's one-chunk schedules (1f1b, zb-h1), as schedule_walk walks them."""
    out = []
    for s, (stage, plan) in enumerate(zip(stages, plans)):
        kept = kept_bytes(recipes, stage, plan, shape, target)
        pending = stage_weight_grad_bytes(recipes, stage.layers, shape, target) if schedule == "zb-h1" else 0
        m = micro_batches
        out.append(activation_peak(schedule, False, [kept] * m, pending, [0] * m, m, len(stages), s))
    return out
