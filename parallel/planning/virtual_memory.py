"""The activation bytes each rank holds under a schedule with virtual stages: the layers split into ranks x chunks
virtual stages, each priced by the per-layer memory model (parallel/planning/memory_model.py) and walked through the
rank's programme (parallel/planning/virtual_walk.py). Pure: no process group."""

import functools
from collections.abc import Sequence
from dataclasses import dataclass, replace

from model import LayerRecipe
from parallel.planning import schedules
from parallel.planning.memory_model import checkpoint_rng_bytes, stage_activations
from parallel.planning.partition import StageRange
from parallel.planning.schedule_walk import ActivationPeak, activation_peak
from parallel.planning.shapes import Shape, Target
from parallel.planning.stage_plan import StagePlan, early_stages
from parallel.planning.virtual_program import UNIT_SLOTS, Slots
from parallel.planning.virtual_schedules import virtual_schedule
from parallel.planning.virtual_walk import ChunkBytes, RankMoments, VirtualPeak
from parallel.planning.weight_grad_bytes import stage_weight_grad_bytes, weight_grad_transient_bytes
from parallel.planning.working_set import backward_working_sets, early_remade_bytes, early_working_sets


def micro_batch_bytes(
    recipes: Sequence[LayerRecipe],
    stage: StageRange,
    plan: StagePlan,
    shape: Shape,
    target: Target,
    micro_batches: int,
    split: bool,
    early: bool = False,
    output_held: bool = False,
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Per micro-batch of the (virtual) stage: what it keeps from its forward to its backward (its checkpoints' RNG
    states included: memory_model.checkpoint_rng_bytes), and what its backward allocates on top (its largest working
    set; `split`: B defers the weight gradients), under `plan` for the micro-batches it recomputes and `none` for the
    others (StagePlan.recomputes_micro_batch). `early`: the stage recomputes each micro-batch as a RecomputeEarly right
    before its backward, which then holds what that recompute remade and works as `none`'s backward (a nested plan's:
    each block's interior), as parallel/planning/stage_bytes.py charges a stage that recomputes early. `output_held`:
    the engine holds the last stage's output through its backward, as DeepSpeed's does under a one-chunk schedule; a
    chunk keeps no output on the last virtual stage (parallel/runtime/chunk_work.py), so its loss's backward frees the
    loss's input (working_set.backward_working_sets)."""
    last = stage.stop == len(recipes)
    out = {}
    for under_plan in {plan.recomputes_micro_batch(k) for k in range(micro_batches)}:
        own = plan if under_plan else StagePlan()
        layers = stage_activations(recipes, stage.layers, own, shape, target, last)
        sets = backward_working_sets(layers, own, shape, target, split, output_held=output_held)
        kept = sum(a.bytes for a in layers) + checkpoint_rng_bytes(own, target)
        remade = 0
        if early and under_plan:
            plain = stage_activations(recipes, stage.layers, StagePlan(), shape, target, last)
            plain_sets = backward_working_sets(plain, StagePlan(), shape, target, split, output_held=output_held)
            sets = early_working_sets(layers, plain_sets, plan, shape, target, split, output_held)
            remade = early_remade_bytes(plan, layers, plain, shape, target)
        out[under_plan] = kept, remade + max(sets.values(), default=0)
    per_micro_batch = [out[plan.recomputes_micro_batch(k)] for k in range(micro_batches)]
    return tuple(k for k, _ in per_micro_batch), tuple(w for _, w in per_micro_batch)


@dataclass(frozen=True)
class RankWalk:
    """One rank's programme walked once, with what its chunks hold whatever their plans (W-pending bytes, received
    messages, outputs): its activation peak under any bytes its chunks keep and allocate per micro-batch."""

    virtual_stages: tuple[int, ...]
    """The rank's virtual stages, in chunk order."""
    moments: RankMoments
    weights_pending: tuple[int, ...]
    weight_working: tuple[int, ...]
    """Per chunk: what its W allocates on top while it runs (0 without a split backward)."""
    message: int
    output: tuple[int, ...]
    """Per chunk: its output, held from its forward to its backward (none on the last virtual stage)."""
    split: bool
    """The schedule splits the backward into B and W."""

    def _chunks(self, kept: Sequence[Sequence[int]], working: Sequence[Sequence[int]]) -> list[ChunkBytes]:
        return [
            ChunkBytes(tuple(k), tuple(w), p, ww, self.message, o)
            for k, w, p, ww, o in zip(kept, working, self.weights_pending, self.weight_working, self.output)
        ]

    def peak(self, kept: Sequence[Sequence[int]], working: Sequence[Sequence[int]]) -> VirtualPeak:
        """`kept[c][m]`, `working[c][m]`: what chunk c's micro-batch m keeps and its backward allocates on top
        (`micro_batch_bytes`)."""
        return self.moments.peak(self._chunks(kept, working))

    @functools.cached_property
    def rows(self) -> tuple[tuple[tuple[tuple[int, ...], ...], int], ...]:
        """RankMoments.linear's rows: the moments that can hold the peak between instructions, each chunk's
        micro-batches alike."""
        return self.moments.linear(self._chunks([()] * len(self.output), [()] * len(self.output)))

    @functools.cached_property
    def rows_by_micro_batch(self) -> tuple[tuple[tuple[tuple[int, ...], ...], int], ...]:
        """`rows` where a chunk may recompute for k of its in-flight micro-batches (RankMoments.linear's `some`)."""
        return self.moments.linear(self._chunks([()] * len(self.output), [()] * len(self.output)), some=True)


def rank_walks(
    recipes: Sequence[LayerRecipe],
    stages: Sequence[StageRange],
    schedule: str,
    chunks: int,
    micro_batches: int,
    shape: Shape,
    target: Target,
    slots: Slots = UNIT_SLOTS,
    early: frozenset[int] = frozenset(),
) -> list[RankWalk]:
    """Each rank's RankWalk under `schedule` (parallel/planning/virtual_schedules.py's) with `chunks` per rank,
    `stages` being the virtual stages in pipeline order. Besides what each chunk keeps per micro-batch (and, under a
    split backward, what its W needs), a received activation or gradient counts from its receive to the instruction
    that reads it. `early`: the virtual stages that recompute early (virtual_schedules.virtual_schedule's)."""
    ranks, extra = divmod(len(stages), chunks)
    if extra:
        raise ValueError(f"{len(stages)} virtual stages do not split into {chunks} chunks per rank")
    programs = virtual_schedule(schedule, micro_batches, ranks, chunks, slots, early)
    placement = programs[0].placement
    split = any(c.kind is schedules.BackwardWeight for c in programs[0].commands())
    message = shape.bsh * target.dtype_bytes  # one hidden-state tensor: an activation or its gradient
    out = []
    for program in programs:
        virtual = tuple(placement.virtual_stage(program.rank, c) for c in range(chunks))
        pending = [stage_weight_grad_bytes(recipes, stages[v].layers, shape, target) if split else 0 for v in virtual]
        transient = [
            weight_grad_transient_bytes(recipes, stages[v].layers, shape, target) if split else 0 for v in virtual
        ]
        output = tuple(0 if v == len(stages) - 1 else message for v in virtual)
        moments = RankMoments.of(program)
        out.append(RankWalk(virtual, moments, tuple(pending), tuple(transient), message, output, split))
    return out


def chunks_in_flight(
    schedule: str, ranks: int, chunks: int, micro_batches: int, slots: Slots = UNIT_SLOTS
) -> tuple[int, ...]:
    """Per virtual stage, in pipeline order: the most micro-batches it holds in flight at once under `schedule`
    (RankMoments.most_in_flight), which a plan for some of them (StagePlan.micro_batches) counts from: a peak of the
    chunk then holds that many recomputed micro-batches. Early recompute moves no forward or backward (it only adds a
    RecomputeEarly before a backward), so it changes none of them."""
    most = {}
    for program in virtual_schedule(schedule, micro_batches, ranks, chunks, slots):
        for chunk, n in enumerate(RankMoments.of(program).most_in_flight):
            most[program.placement.virtual_stage(program.rank, chunk)] = n
    return tuple(most[v] for v in range(ranks * chunks))


def counted_in_chunks(
    plans: Sequence[StagePlan], schedule: str, chunks: int, micro_batches: int, slots: Slots = UNIT_SLOTS
) -> list[StagePlan]:
    """`plans` (one per virtual stage, in pipeline order), each plan for some micro-batches counting them from those
    its chunk holds at once (chunks_in_flight), not from a 1F1B stage's as the stage planner counts them; the plans as
    they are where none is for some (no programme is built)."""
    if all(p.micro_batches is None for p in plans):
        return list(plans)
    most = chunks_in_flight(schedule, len(plans) // chunks, chunks, micro_batches, slots)
    return [p if p.micro_batches is None else replace(p, in_flight=n) for p, n in zip(plans, most)]


def virtual_peaks(
    recipes: Sequence[LayerRecipe],
    stages: Sequence[StageRange],
    plans: Sequence[StagePlan],
    schedule: str,
    chunks: int,
    micro_batches: int,
    shape: Shape,
    target: Target,
    slots: Slots = UNIT_SLOTS,
) -> list[VirtualPeak]:
    """Each rank's activation peak (`rank_walks`) with one plan per virtual stage, each backward's working set
    inside it."""
    out, early = [], early_stages(plans)
    for walk in rank_walks(recipes, stages, schedule, chunks, micro_batches, shape, target, slots, early):
        per_chunk = [
            micro_batch_bytes(recipes, stages[v], plans[v], shape, target, micro_batches, walk.split, v in early)
            for v in walk.virtual_stages
        ]
        out.append(walk.peak([k for k, _ in per_chunk], [w for _, w in per_chunk]))
    return out


def one_chunk_peaks(
    recipes: Sequence[LayerRecipe],
    stages: Sequence[StageRange],
    plans: Sequence[StagePlan],
    schedule: str,
    micro_batches: int,
    shape: Shape,
    target: Target,
) -> list[ActivationPeak]:
    """Each stage's peak under today's one-chunk schedules (1f1b, zb-h1), as schedule_walk walks them, each
    backward's working set inside it (DeepSpeed's buffers left out)."""
    out = []
    for s, (stage, plan) in enumerate(zip(stages, plans)):
        split = schedule == "zb-h1"
        kept, working = micro_batch_bytes(recipes, stage, plan, shape, target, micro_batches, split, output_held=True)
        pending = stage_weight_grad_bytes(recipes, stage.layers, shape, target) if split else 0
        m = micro_batches
        out.append(activation_peak(schedule, False, kept, pending, [0] * m, m, len(stages), s, transient=working))
    return out
