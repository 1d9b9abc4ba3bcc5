"""The layout a run trains with: partition and each stage's recompute plan, built at start-up with the costs
train.device_profile names (harness/device_costs.py)."""

from harness.context import RunContext
from harness.device_costs import run_costs, run_profile
from parallel.planning.layout import PipelineLayout, build_layout
from parallel.planning.step_costs import DeviceRates, analytic_rates


def layout_of(ctx: RunContext) -> PipelineLayout:
    """Priced by the device profile when there is one. Analytic step times charge at train.peak_tflops when set;
    else a CUDA target is planned as an H100 (the GPU is not queried at start-up: that would create a CUDA context on
    every rank before DeepSpeed picks each rank's device) and a CPU one as a nominal core. Rank 0 says which costs
    priced the plan."""
    run = ctx.run
    profile, line = run_profile(ctx)
    if ctx.env.rank == 0:
        print(f"stagecheck: {line}", flush=True)
    parallel = run.parallel
    return build_layout(
        run.model,
        run.recompute,
        ctx.shape,
        parallel.partition_method,
        run.seed,
        run_costs(profile, ctx),
        run_rates(ctx),
        parallel.schedule,
    )


def run_rates(ctx: RunContext) -> DeviceRates:
    """What analytic costs charge at (see layout_of)."""
    return analytic_rates(ctx.target.device, ctx.target.precision, ctx.run.train.peak_tflops)
