"""`python train.py ... dry_run=true`: plan the run without running it.

No launcher, no process group, no DeepSpeed (planning never loads it): the model is only ever built on the meta
device (to count parameters), split into stages by the same partition routine training uses, and planned by
parallel/planning/run_plan.py. Prints the per-stage table (with a warning for each stage that holds no block) and
the predicted step time, and writes plan.json to the run directory.
"""

from harness.context import RunContext
from harness.files import atomic_write_json
from parallel.planning.layout import PipelineLayout
from parallel.planning.plan_record import RunPlan
from parallel.planning.run_plan import plan_run


def dry_run(ctx: RunContext, layout: PipelineLayout) -> RunPlan:
    run = ctx.run
    plan = plan_run(run.model, run.recompute, layout, ctx.shape)
    lines = layout.describe() + layout.empty_stage_warnings() + plan.lines()
    if layout.budgets is not None:
        lines += layout.describe_budgets(run.recompute)
    if ctx.env.rank == 0:
        for line in lines:
            print("stagecheck: " + line)
        path = ctx.run_dir / "plan.json"
        atomic_write_json(path, plan.to_json())
        print(f"stagecheck: dry run: wrote {path}", flush=True)
    return plan
