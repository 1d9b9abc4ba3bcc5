"""The schedules with virtual stages priced for a run, as the dry run prints them beside today's: the model split into
v chunks per rank (a V's 2; interleaved 1F1B's parallel.chunks, or each count virtual_support.chunk_choices allows),
each chunk planned under the run's fixed recompute mode by the stage planner and priced by
`price_stage` (its seconds per instruction), every rank's programme replayed by parallel/planning/virtual_sim.py
and walked for its activation bytes (parallel/planning/virtual_memory.py). The chunk boundaries are chosen per
schedule: the even split of the blocks, then single-block moves while the simulated step gets shorter.

`parallel.schedule=NAME` trains one (parallel/planning/virtual_layout.py), and `parallel.schedule=auto` picks one where
it simulates faster than 1f1b and zb-h1. Under `auto` recompute each rank's chunks are planned together against the
rank's budget (parallel/planning/virtual_auto.py) on every boundaries tried; a schedule no boundaries fit is left out.
"""

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from functools import partial

from model import GPTConfig, LayerRecipe
from parallel.planning.balanced_search import shortened_by_single_moves
from parallel.planning.config import AutoRecompute, GivenRecompute, RecomputeConfig
from parallel.planning.layout import PipelineLayout
from parallel.planning.model_states import largest_parameter, rank_step_bytes
from parallel.planning.partition import StageRange, stages_of_block_counts
from parallel.planning.shapes import GIB, RunShape, Shape, Topology
from parallel.planning.stage_plan import StagePlan, early_stages, with_early
from parallel.planning.stage_planner import StagePlanner
from parallel.planning.stage_price import StagePrice, StagePricing, price_stage
from parallel.planning.virtual_auto import plan_ranks
from parallel.planning.virtual_memory import counted_in_chunks, one_chunk_peaks, virtual_peaks
from parallel.planning.virtual_program import V_CHUNKS, VIRTUAL_SCHEDULES, Slots, VirtualProgram, placement_of
from parallel.planning.virtual_schedules import virtual_schedule
from parallel.planning.virtual_sim import simulate_virtual
from parallel.planning.virtual_slots import stage_slots
from parallel.planning.virtual_support import chunk_choices


@dataclass(frozen=True)
class VirtualOption:
    """One schedule with virtual stages, priced."""

    schedule: str
    chunks: int
    """Model chunks per rank."""
    step_time_s: float
    activation_bytes: tuple[int, ...]
    """Each rank's activation peak (its chunks' kept bytes, deferred W's and received messages at once)."""
    state_bytes: tuple[int, ...]
    """Each rank's parameters, gradients and optimizer state: its chunks' together."""
    blocks: tuple[int, ...]
    """Blocks per virtual stage, in pipeline order."""


def virtual_options(
    model: GPTConfig,
    recompute: RecomputeConfig,
    layout: PipelineLayout,
    run: RunShape,
    schedules: Sequence[str] = VIRTUAL_SCHEDULES,
    chunks: int | None = None,
) -> list[VirtualOption]:
    """Every schedule of `schedules` that takes the run's micro-batches, with each count of chunks per rank it may
    run with (`chunks`: parallel.chunks; virtual_support.chunk_choices), priced with `layout`'s time model, each on
    its own chunk boundaries (`_chunk_counts`: a search that prices, and under auto plans, each boundary it tries, so
    a caller names only the schedules it reads); in VIRTUAL_SCHEDULES' order, fewest chunks first."""
    ranks = run.topology.pipeline_stages
    counts = {s: chunk_choices(s, chunks, model.n_layer, ranks) for s in schedules}
    out = []
    for count in sorted({c for choices in counts.values() for c in choices if c * ranks <= model.n_layer}):
        wanted = [s for s in schedules if count in counts[s]]
        out += _options(model, recompute, layout, run, wanted, count)
    return sorted(out, key=lambda o: (VIRTUAL_SCHEDULES.index(o.schedule), o.chunks))


def _options(
    model: GPTConfig,
    recompute: RecomputeConfig,
    layout: PipelineLayout,
    run: RunShape,
    schedules: Sequence[str],
    chunks: int,
) -> list[VirtualOption]:
    """virtual_options' for `chunks` per rank."""
    ranks = run.topology.pipeline_stages
    virtual_run = replace(run, topology=Topology(chunks * ranks, run.topology.data_parallel_size))
    shape = Shape.of(model, run.micro_batch_size)
    # the run's own prices (measured, curves or analytic: layout.timing.table), as the layout's stages were planned
    planner = StagePlanner(
        StagePricing.of(layout.recipes, virtual_run, shape, layout.timing), recompute, layout.timing.table
    )
    priced: dict[StageRange, StagePrice] = {}

    def price(stage: StageRange) -> StagePrice:
        if stage not in priced:
            priced[stage] = planner.price(stage)
        return priced[stage]

    # the slots of any split of the model (parallel/planning/virtual_slots.py): the even one's
    slots = stage_slots(
        planner.pricing, stages_of_block_counts(layout.recipes, even_counts(model.n_layer, chunks * ranks))
    )
    auto = isinstance(recompute, AutoRecompute)
    programs: dict[tuple[str, frozenset[int]], list[VirtualProgram]] = {}

    def plans_of(prices: Sequence[StagePrice]) -> list[StagePlan]:
        """The chunks' plans with early recompute as the run has it: the mode's recompute.early on every chunk that
        recomputes, or auto's choice per rank (plan_ranks')."""
        plans = [p.plan for p in prices]
        return plans if auto else with_early(plans, recompute.early)

    def programs_of(schedule: str, prices: Sequence[StagePrice]) -> list[VirtualProgram]:
        """The ranks' programmes with each chunk recomputed early where its plan says so."""
        key = (schedule, early_stages(plans_of(prices)))
        if key not in programs:
            programs[key] = virtual_schedule(schedule, run.micro_batches, ranks, chunks, slots, key[1])
        return programs[key]

    out = []
    for schedule in schedules:
        try:
            programs_of(schedule, ())
        except ValueError:  # interleaved-1f1b's rounds: micro-batches not a multiple of the ranks
            continue
        placement = placement_of(schedule, ranks, chunks)
        mine = [[placement.virtual_stage(rank, chunk) for chunk in range(chunks)] for rank in range(ranks)]

        def prices_of(counts: list[int], schedule: str = schedule) -> list[StagePrice] | None:
            """Each chunk priced under its plan: the mode's, or auto's per rank (None: some rank fits none)."""
            stages = stages_of_block_counts(layout.recipes, counts)
            if not auto:
                prices = [price(stage) for stage in stages]
                plans = counted_in_chunks([p.plan for p in prices], schedule, chunks, run.micro_batches, slots)
                return [
                    p if p.plan == plan else price_stage(planner.pricing, stage, plan)
                    for p, stage, plan in zip(prices, stages, plans)
                ]
            plans, budgets = plan_ranks(planner, stages, schedule, chunks, slots, floors=False)
            if any(b.choice is None for b in budgets):
                return None
            return [price_stage(planner.pricing, stage, plan) for stage, plan in zip(stages, plans)]

        step_s = partial(_step_s, partial(programs_of, schedule), mine, prices_of, run.grad_clip > 0)
        counts = _chunk_counts(model.n_layer, chunks * ranks, step_s)
        stages = stages_of_block_counts(layout.recipes, counts)
        prices = prices_of(counts)
        if prices is None:  # auto: not even the chosen boundaries fit the budget
            continue
        peaks = rank_peaks(layout.recipes, stages, plans_of(prices), prices, schedule, mine, run, shape, slots)
        states = tuple(sum(sum(prices[v].memory.states.values()) for v in stages) for stages in mine)
        out.append(VirtualOption(schedule, chunks, step_s(counts), peaks, states, tuple(counts)))
    return out


def rank_peaks(
    recipes: Sequence[LayerRecipe],
    stages: Sequence[StageRange],
    plans: Sequence[StagePlan],
    prices: Sequence[StagePrice],
    schedule: str,
    mine: Sequence[Sequence[int]],
    run: RunShape,
    shape: Shape,
    slots: Slots,
) -> tuple[int, ...]:
    """Each rank's activation peak (`mine[rank]`: its virtual stages): its walk's (virtual_memory.virtual_peaks), or
    where larger what its ReduceGrads or optimizer step allocates after every backward, over all its chunks'
    parameters at once (model_states.rank_step_bytes)."""
    chunks = len(mine[0])
    walked = virtual_peaks(recipes, stages, plans, schedule, chunks, run.micro_batches, shape, run.target, slots)
    return tuple(
        max(
            walk.bytes,
            rank_step_bytes(
                [largest_parameter(recipes, stages[v].layers, shape) for v in rank_stages],
                [prices[v].memory.params for v in rank_stages],
                run.target,
                run.zero_stage,
                run.topology.data_parallel_size,
            ),
        )
        for walk, rank_stages in zip(walked, mine)
    )


def _step_s(programs_of, mine, prices_of, clip: bool, counts: list[int]) -> float:
    """The simulated step of the schedule's programmes (`programs_of(prices)`: each chunk recomputed early where its
    plan says so) with `counts` blocks per virtual stage (`mine[rank]`: its virtual stages), with the optimizer
    steps' barrier where the run clips (`clip`: virtual_sim's `clip_barrier`); infinite where `prices_of(counts)` is
    None (auto fits no plan: any boundaries that fit are shorter)."""
    prices = prices_of(counts)
    if prices is None:
        return math.inf
    costs = [[prices[v].costs for v in stages] for stages in mine]
    tied = prices[0].pricing.shape.tied
    return simulate_virtual(programs_of(prices), costs, clip_barrier=clip, tied_weights=tied).step_time_s


def _chunk_counts(blocks: int, chunks: int, step_s) -> list[int]:
    """Blocks per virtual stage: the even split, then single-block moves across a chunk boundary while the
    simulated step of the schedule gets shorter (as `balanced` moves stage boundaries: a V's rank 0 holds both the
    embedding's chunk and the LM head's, so even chunks load it most)."""
    return shortened_by_single_moves(even_counts(blocks, chunks), step_s)


def even_counts(blocks: int, chunks: int) -> list[int]:
    """Blocks per virtual stage split as evenly as can be, the first ones one more."""
    return [blocks // chunks + (c < blocks % chunks) for c in range(chunks)]


def virtual_lines(
    model: GPTConfig, recompute: RecomputeConfig, layout: PipelineLayout, run: RunShape, chunks: int | None = None
) -> list[str]:
    """The dry run's lines: each virtual-stage schedule's simulated step and largest rank with each count of chunks
    per rank it may run with (`chunks`: parallel.chunks), against 1F1B's activation peak on the layout's own stages
    under the same mode."""
    if layout.timing is None:
        return []
    if model.n_layer < V_CHUNKS * run.topology.pipeline_stages:
        return [f"virtual stages ({V_CHUNKS} chunks per rank): fewer blocks than chunks"]
    if isinstance(recompute, GivenRecompute):
        return ["virtual stages: not priced, +recompute=plan's file plans one stage per rank"]
    shape = Shape.of(model, run.micro_batch_size)
    peaks = one_chunk_peaks(layout.recipes, layout.stages, layout.plans, "1f1b", run.micro_batches, shape, run.target)
    one_f_one_b = max(peak.bytes for peak in peaks)
    lines = [
        "virtual stages (parallel.schedule=<schedule> parallel.chunks=<chunks> trains one):",
        f"{'schedule':>16} {'chunks':>6} {'step (s)':>9} {'activations GiB':>15} {'x 1f1b':>7} {'states GiB':>10}  "
        "blocks per chunk",
    ]
    for option in virtual_options(model, recompute, layout, run, chunks=chunks):
        largest = max(option.activation_bytes)
        lines.append(
            f"{option.schedule:>16} {option.chunks:>6} {option.step_time_s:>9.4g} {largest / GIB:>15.3f} "
            f"{largest / max(one_f_one_b, 1):>7.2f} {max(option.state_bytes) / GIB:>10.3f}  "
            + "/".join(map(str, option.blocks))
        )
    return lines
