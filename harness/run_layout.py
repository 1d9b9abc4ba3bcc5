"""The layout a run trains with: partition and each stage's recompute plan, built at start-up with the costs
train.device_profile names (harness/device_costs.py)."""

from harness.context import RunContext
from harness.device_costs import run_costs
from parallel.planning.layout import PipelineLayout, build_layout
from parallel.planning.step_costs import analytic_rates


def layout_of(ctx: RunContext) -> PipelineLayout:
    """Priced by the device profile when there is one. Analytic step times charge at train.peak_tflops when set;
    else a CUDA target is planned as an H100 (the GPU is not queried at start-up: that would create a CUDA context on
    every rank before DeepSpeed picks each rank's device) and a CPU one as a nominal core. Rank 0 says which costs
    priced the plan."""
    run, target = ctx.run, ctx.target
    costs, line = run_costs(ctx)
    if ctx.env.rank == 0:
        print(f"stagecheck: {line}", flush=True)
    rates = analytic_rates(target.device, target.precision, run.train.peak_tflops)
    parallel = run.parallel
    return build_layout(
        run.model, run.recompute, ctx.shape, parallel.partition_method, run.seed, costs, rates, parallel.schedule
    )
