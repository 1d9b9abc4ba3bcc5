"""The layout a run trains with (partition and each stage's recompute plan, built at start-up with the prices
train.prices and train.device_profile name: harness/price_source.py; checked to be every rank's once the process group
exists) and the run plan of that layout."""

import torch.distributed as dist

from harness.context import RunContext
from harness.price_source import run_prices
from parallel.planning.block_prices import BlockPrices
from parallel.planning.config import NoRecompute
from parallel.planning.instruction_seconds import DeviceRates, analytic_rates
from parallel.planning.layout import PipelineLayout, build_layout
from parallel.planning.plan_record import RunPlan
from parallel.planning.run_plan import plan_run
from parallel.planning.virtual_layout import (
    faster_virtual_schedule,
    parts_of,
    virtual_layout,
    virtual_plan,
    virtual_shape,
    with_virtual_plan,
)
from parallel.planning.virtual_program import VIRTUAL_SCHEDULES

CONSIDERED = 8
"""How many of the plans +recompute=auto weighed a dry run lists (plan.json's `considered`), fastest first."""


def layout_of(ctx: RunContext) -> PipelineLayout:
    """Priced by the device profile when there is one. Analytic step times charge at train.peak_tflops when set;
    else a CUDA target is planned as an H100 (the GPU is not queried at start-up: that would create a CUDA context on
    every rank before DeepSpeed picks each rank's device) and a CPU one as a nominal core. Rank 0 says which costs
    priced the plan."""
    run = ctx.run
    costs, line = run_prices(ctx)
    if ctx.env.rank == 0:
        print(f"stagecheck: {line}", flush=True)
    parallel = run.parallel
    virtual = resumed_or_named_virtual(ctx)
    if virtual is None:
        layout = build_layout(
            run.model,
            run.recompute,
            ctx.shape,
            parallel.partition_method,
            run.seed,
            costs,
            run_rates(ctx),
            parallel.schedule,
            held_parts=held_parts(ctx, costs),
            considered=CONSIDERED if run.dry_run else 0,
        )
        if parallel.schedule != "auto" or ctx.resume is not None:  # a resume keeps its checkpoint's placement
            return layout
        # parallel.schedule=auto: a schedule with virtual stages where one simulates faster and the run can run it
        faster = faster_virtual_schedule(
            run.model, run.recompute, layout, ctx.shape, parallel.zero_stage, parallel.chunks
        )
        if faster is None:
            return layout
        # its chunks, and under `balanced` the chunk boundaries it was priced on
        virtual, chunks = faster.schedule, faster.chunks
        held = parts_of(layout.recipes, faster.blocks) if parallel.partition_method == "balanced" else None
    else:
        chunks = parallel.chunks
        held = None  # ranks x chunks virtual stages (parallel/planning/virtual_layout.py): a resume's, else chosen
        resume = ctx.resume
        if resume is not None and "parallel.partition_method" not in resume.changed:
            held = resume.saved_partition
    return virtual_layout(
        run.model,
        run.recompute,
        ctx.shape,
        parallel.partition_method,
        run.seed,
        virtual,
        costs,
        run_rates(ctx),
        held,
        chunks,
    )


def resumed_or_named_virtual(ctx: RunContext) -> str | None:
    """The schedule with virtual stages the run names (parallel.schedule), or under `auto` the one its checkpoint was
    trained with (a resume keeps the layers on their ranks); None: one stage per rank, or auto's choice."""
    schedule = ctx.run.parallel.schedule
    if schedule in VIRTUAL_SCHEDULES:
        return schedule
    saved = ctx.resume.saved_schedule if ctx.resume is not None else None
    return saved if schedule == "auto" and saved in VIRTUAL_SCHEDULES else None


def held_parts(ctx: RunContext, costs: BlockPrices | None) -> list[int] | None:
    """Stage boundaries this launch keeps instead of choosing (None: partition_method chooses them).

    - A resume keeps its checkpoint's: DeepSpeed saves the optimizer per stage, and under `balanced` the boundaries
      depend on the recompute plan and the costs, which a resume may change. A launch that changes
      parallel.partition_method asks for another partition: it is planned, and resume_check.check_partition refuses
      it if a boundary moved.
    - A sweep job under `balanced` takes the boundaries `balanced` chooses for +recompute=none with the same costs:
      they depend on nothing a recompute option sets, so jobs that differ only in recompute options hold one
      partition (like with like, bit-identical losses), with no file shared between jobs that may run at once. A job
      sweeping parallel.partition_method itself gets each method's own boundaries."""
    resume = ctx.resume
    if resume is not None and resume.saved_partition and "parallel.partition_method" not in resume.changed:
        return resume.saved_partition
    if ctx.job.holds_partition and ctx.run.parallel.partition_method == "balanced":
        reference = build_layout(
            ctx.run.model, NoRecompute(), ctx.shape, "balanced", ctx.run.seed, costs, run_rates(ctx)
        )
        return reference.parts
    return None


def run_rates(ctx: RunContext) -> DeviceRates:
    """What analytic costs charge at (see layout_of)."""
    return analytic_rates(ctx.target.device, ctx.target.precision, ctx.run.train.peak_tflops)


def check_same_layout(layout: PipelineLayout) -> None:
    """Once the process group exists: every rank planned the same layout, or the run ends here with one message. Ranks
    plan before the group exists, each on its own, from prices that must be one set (harness/price_source.py); ranks
    whose plans differed would otherwise wait for each other's mismatched sends forever."""
    mine = repr((layout.parts, layout.plans, layout.schedule, layout.virtual_schedule, layout.virtual_chunks))
    every: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    others = [rank for rank, theirs in enumerate(every) if theirs != every[0]]
    if others:
        raise RuntimeError(
            f"ranks {others} planned another layout than rank 0 (their prices differed: the start-up line `costs: ...` "
            f"says which each used); train.prices=curves or analytic plans every rank alike"
        )


def is_virtual(layout: PipelineLayout) -> bool:
    """The layout's stages are the virtual stages of a schedule with virtual stages."""
    return layout.virtual_schedule is not None


def run_plan(ctx: RunContext, layout: PipelineLayout) -> RunPlan:
    """The plan of the run (plan.json, summary.json's planned figures): under a virtual-stage schedule, one estimate
    per virtual stage and each rank's peak and simulated step (parallel/planning/virtual_layout.py)."""
    run = ctx.run
    if not is_virtual(layout):
        return plan_run(run.model, run.recompute, layout, ctx.shape)
    plan = plan_run(run.model, run.recompute, layout, virtual_shape(ctx.shape, layout.virtual_chunks))
    virtual = virtual_plan(run.model, layout, ctx.shape, layout.virtual_schedule)
    return with_virtual_plan(plan, virtual, ctx.shape)
