"""The layout a run trains with: partition and each stage's recompute plan, built at start-up and again when
`recompute.profile=true` replaces the analytic costs with measured ones."""

from harness.context import RunContext
from parallel.planning.auto_recompute import CostTable
from parallel.planning.layout import PipelineLayout, build_layout
from parallel.planning.step_costs import analytic_rates


def layout_of(ctx: RunContext, costs: CostTable | None = None) -> PipelineLayout:
    """Analytic step times charge at train.peak_tflops when set; else a CUDA target is planned as an H100
    (the GPU is not queried at start-up: that would create a CUDA context on every rank before DeepSpeed
    picks each rank's device) and a CPU one as a nominal core."""
    run, target = ctx.run, ctx.target
    rates = analytic_rates(target.device, target.precision, run.train.peak_tflops)
    parallel = run.parallel
    return build_layout(
        run.model, run.recompute, ctx.shape, parallel.partition_method, run.seed, costs, rates, parallel.schedule
    )


def replans_with_profile(ctx: RunContext, layout: PipelineLayout) -> bool:
    """recompute=auto with recompute.profile=true: planned again with measured costs once the process group exists."""
    return layout.budgets is not None and ctx.run.recompute.profile
