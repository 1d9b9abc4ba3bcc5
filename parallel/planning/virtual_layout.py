"""The layout and plan of a run under a schedule with virtual stages (parallel.schedule=interleaved-1f1b, zb-v,
v-half): the model split into ranks x v virtual stages (v chunks per rank: a V's 2, interleaved 1F1B's parallel.chunks
or the planner's choice), each planned under the run's recompute mode as a stage is (under `auto`, each rank's chunks
together against the rank's budget: parallel/planning/virtual_auto.py), and the
rank-level figures the layout's per-stage ones cannot give (each rank's activation peak over its chunks, its
states, the schedule's simulated step). Pure: start-up, the dry run and the trainer read it.

The chunk boundaries, and with them the chunks per rank: a resume's (its checkpoint's), else under `balanced` the ones
the dry run prices the schedule with (parallel/planning/virtual_choice.py: the even split, then single-block moves while
the simulated step of the schedule shortens; of each count of chunks the planner may choose, the fastest), else
DeepSpeed's method over the virtual stages (the count: the fastest as `balanced` prices it)."""

from collections.abc import Callable, Sequence
from dataclasses import replace
from functools import partial

from model import GPTConfig, LayerRecipe
from parallel.planning.block_prices import BlockPrices
from parallel.planning.budget_refusal import BudgetTooSmall
from parallel.planning.config import AutoRecompute, NoRecompute, RecomputeConfig
from parallel.planning.instruction_seconds import DeviceRates
from parallel.planning.layout import PipelineLayout, build_layout
from parallel.planning.partition import stages_of_block_counts
from parallel.planning.plan_record import RunPlan
from parallel.planning.schedule_choice import choose_schedule
from parallel.planning.shapes import RunShape, Shape, Topology
from parallel.planning.stage_plan import early_stages
from parallel.planning.stage_planner import StagePlanner
from parallel.planning.stage_price import StagePricing, price_stage
from parallel.planning.virtual_auto import plan_ranks
from parallel.planning.virtual_choice import VirtualOption, even_counts, rank_peaks, virtual_options
from parallel.planning.virtual_memory import counted_in_chunks
from parallel.planning.virtual_plan import VirtualPlan
from parallel.planning.virtual_program import V_CHUNKS, VIRTUAL_SCHEDULES, placement_of
from parallel.planning.virtual_schedules import virtual_schedule
from parallel.planning.virtual_sim import simulate_virtual
from parallel.planning.virtual_slots import stage_slots
from parallel.planning.virtual_support import chunk_choices, virtual_run_refusal


def virtual_shape(run: RunShape, chunks: int = V_CHUNKS) -> RunShape:
    """The run as `chunks` x its pipeline ranks stages: what each virtual stage is planned for."""
    topology = run.topology
    return replace(run, topology=Topology(chunks * topology.pipeline_stages, topology.data_parallel_size))


def virtual_layout(
    model: GPTConfig,
    recompute: RecomputeConfig,
    run: RunShape,
    partition_method: str,
    seed: int,
    schedule: str,
    costs: BlockPrices | None,
    rates: DeviceRates | None,
    held_parts: list[int] | None,
    chunks: int | None = None,
) -> PipelineLayout:
    """The run's virtual stages (ranks x v, in pipeline order) with one plan each under `recompute`, v being
    `chunks` (parallel.chunks), else `held_parts`' (a resume's), else the fastest count virtual_options prices; `auto`
    plans each rank's chunks together against the rank's budget (parallel/planning/virtual_auto.py) and raises
    BudgetTooSmall naming the ranks that fit no plan."""
    auto = isinstance(recompute, AutoRecompute)
    fixed = NoRecompute() if auto else recompute  # auto's chunks are planned per rank below, not per stage
    ranks = run.topology.pipeline_stages
    if held_parts is not None:
        chunks = (len(held_parts) - 1) // ranks
    else:
        one_chunk = partial(build_layout, model, fixed, run, "balanced", seed, costs, rates)
        chunks, held_parts = _chunks_and_parts(model, recompute, run, partition_method, schedule, chunks, one_chunk)
    method = "uniform" if partition_method == "balanced" else partition_method  # too few blocks for every chunk
    virtual_run = virtual_shape(run, chunks)
    layout = build_layout(model, fixed, virtual_run, method, seed, costs, rates, held_parts=held_parts)
    pricing = None
    if layout.timing is not None:
        shape = Shape.of(model, run.micro_batch_size)
        pricing = StagePricing.of(layout.recipes, virtual_run, shape, layout.timing)
    layout = replace(
        layout, virtual_schedule=schedule, virtual_chunks=chunks, virtual_slots=stage_slots(pricing, layout.stages)
    )
    if auto:
        return _planned_per_rank(recompute, layout, pricing, schedule)
    plans = counted_in_chunks(layout.plans, schedule, chunks, run.micro_batches, layout.virtual_slots)
    return replace(layout, plans=plans)


def _chunks_and_parts(
    model: GPTConfig,
    recompute: RecomputeConfig,
    run: RunShape,
    partition_method: str,
    schedule: str,
    chunks: int | None,
    one_chunk: Callable[[], PipelineLayout],
) -> tuple[int, list[int] | None]:
    """The chunks per rank (`chunks`, else of the counts the planner may choose the one virtual_options prices
    fastest on `one_chunk()`, the run's layout of one stage per rank) and, under `balanced`, the chunk boundaries
    (that option's; the even split where none is priced: auto fitting no boundaries is refused on it); None:
    `partition_method` splits the virtual stages."""
    ranks = run.topology.pipeline_stages
    choices = chunk_choices(schedule, chunks, model.n_layer, ranks)
    balanced = partition_method == "balanced"
    if model.n_layer < choices[0] * ranks or not (balanced or len(choices) > 1):
        return choices[0], None
    one_stage_per_rank = one_chunk()
    options = virtual_options(model, recompute, one_stage_per_rank, run, (schedule,), chunks)
    fastest = min(options, key=lambda o: o.step_time_s, default=None)
    chosen = fastest.chunks if fastest is not None else choices[0]
    if not balanced:
        return chosen, None
    counts = fastest.blocks if fastest is not None else even_counts(model.n_layer, chosen * ranks)
    return chosen, parts_of(one_stage_per_rank.recipes, counts)


def parts_of(recipes: Sequence[LayerRecipe], blocks: Sequence[int]) -> list[int]:
    """The layer boundaries of virtual stages holding `blocks` blocks each, in pipeline order (each one's first layer,
    then one past the last)."""
    return [s.start for s in stages_of_block_counts(recipes, list(blocks))] + [len(recipes)]


def _planned_per_rank(
    auto: AutoRecompute, layout: PipelineLayout, pricing: StagePricing, schedule: str
) -> PipelineLayout:
    """`layout`'s virtual stages with auto's plans per rank, its 1F1B schedule options priced for them."""
    planner = StagePlanner(pricing, auto, layout.timing.table)
    plans, budgets = plan_ranks(planner, layout.stages, schedule, layout.virtual_chunks, layout.virtual_slots)
    if any(b.choice is None for b in budgets):
        raise BudgetTooSmall(auto, budgets, [], where="rank")
    # The 1F1B pricing of the virtual stages that plan.json's per-stage entries read, under no budget (the rank's is
    # what auto fitted).
    plain = StagePlanner(pricing, NoRecompute(), layout.timing.table)
    chosen, options = choose_schedule(plain, layout.stages, plans, "1f1b", False)
    planned = [replace(p, early=own.early) for p, own in zip(chosen.plans, plans)]  # auto's early recompute, per chunk
    return replace(layout, plans=planned, schedule_options=options, rank_budgets=tuple(budgets))


def faster_virtual_schedule(
    model: GPTConfig,
    recompute: RecomputeConfig,
    one_chunk: PipelineLayout,
    run: RunShape,
    zero_stage: int,
    chunks: int | None = None,
) -> VirtualOption | None:
    """parallel.schedule=auto's choice beyond `one_chunk`'s (the fastest of 1f1b and zb-h1 on one stage per rank):
    the schedule with virtual stages, its chunks per rank (`chunks`: parallel.chunks, else each count the planner may
    choose) and its chunk boundaries, whose simulated step (on its own chunk boundaries, as the dry run prices it) is
    the shortest and shorter than `one_chunk`'s, among those the run can run (virtual_support.virtual_run_refusal:
    not fp16, ...), under +recompute=auto with each rank's chunks planned against the budget (early recompute where
    auto chooses it); None when none is."""
    if one_chunk.timing is None:
        return None
    ranks = run.topology.pipeline_stages
    runnable = [
        schedule
        for schedule in VIRTUAL_SCHEDULES
        if virtual_run_refusal(
            schedule, recompute, run.target.precision, zero_stage, run.micro_batches, ranks, model.n_layer, chunks
        )
        is None
    ]
    if not runnable:
        return None
    options = virtual_options(model, recompute, one_chunk, run, runnable, chunks)
    early = any(p.early for p in one_chunk.plans)
    chosen = next(o for o in one_chunk.schedule_options if o.schedule == one_chunk.schedule and o.early == early)
    fastest = min(options, key=lambda o: o.step_time_s, default=None)
    return fastest if fastest is not None and fastest.step_time_s < chosen.step_time_s else None


def virtual_plan(model: GPTConfig, layout: PipelineLayout, run: RunShape, schedule: str) -> VirtualPlan:
    """`layout`'s virtual stages (ranks x its chunks) priced for `run` (its pipeline ranks, not its virtual stages)."""
    ranks, chunks = run.topology.pipeline_stages, layout.virtual_chunks
    shape = Shape.of(model, run.micro_batch_size)
    pricing = StagePricing.of(layout.recipes, virtual_shape(run, chunks), shape, layout.timing)
    prices = [price_stage(pricing, stage, plan, "1f1b") for stage, plan in zip(layout.stages, layout.plans)]
    placement = placement_of(schedule, ranks, chunks)
    mine = [tuple(placement.virtual_stage(rank, chunk) for chunk in range(chunks)) for rank in range(ranks)]
    slots = layout.virtual_slots
    peaks = rank_peaks(layout.recipes, layout.stages, layout.plans, prices, schedule, mine, run, shape, slots)
    timeline = None
    if layout.timing is not None:
        programs = virtual_schedule(schedule, run.micro_batches, ranks, chunks, slots, early_stages(layout.plans))
        costs = [[prices[v].costs for v in stages] for stages in mine]
        timeline = simulate_virtual(programs, costs, clip_barrier=run.grad_clip > 0, tied_weights=shape.tied)
    return VirtualPlan(
        schedule,
        chunks,
        tuple(mine),
        peaks,
        tuple(sum(sum(prices[v].memory.states.values()) for v in stages) for stages in mine),
        timeline.step_time_s if timeline else None,
        layout.timing.source if layout.timing is not None else None,
        vars(layout.timing.table.source) if layout.timing is not None else None,
        timeline.rank_instruction_s if timeline else (),
        slots.text(),
    )


def with_virtual_plan(plan: RunPlan, virtual: VirtualPlan, run: RunShape) -> RunPlan:
    """The run plan of the virtual stages (plan_run's, one StageEstimate per virtual stage) as a plan of the run's
    ranks: its grid, the rank-level figures, and no 1F1B step over the virtual stages (the schedule's is `virtual`)."""
    topology = run.topology
    return replace(
        plan,
        pipeline_stages=topology.pipeline_stages,
        world_size=topology.world_size,
        step_time=None,
        virtual=virtual,
    )
