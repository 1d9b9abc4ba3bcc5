"""The layout a run trains with: partition and each stage's recompute plan, built at start-up and again when
`recompute.profile=true` replaces the analytic costs with measured ones."""

from harness.context import RunContext
from parallel.auto_recompute import CostTable
from parallel.layout import PipelineLayout, build_layout


def layout_of(ctx: RunContext, costs: CostTable | None = None) -> PipelineLayout:
    run = ctx.run
    return build_layout(run.model, run.recompute, ctx.shape, run.parallel.partition_method, run.seed, costs)
