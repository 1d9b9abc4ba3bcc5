"""`python train.py ... dry_run=true`: plan the run without running it.

No launcher, no process group, no DeepSpeed (planning never loads it): the model is only ever built on the meta
device (to count parameters), split into stages by the same partition routine training uses, and planned by
parallel/planning/run_plan.py. Prints the per-stage table (with a warning for each stage that holds no block) and
the predicted step time, with the schedules with virtual stages priced beside the layout's
(parallel/planning/virtual_choice.py), and writes plan.json to the run directory.
"""

import os

from harness.context import RunContext
from harness.files import atomic_write_json
from harness.price_source import ranks_on_node, run_profile
from harness.run_layout import run_plan, run_rates
from parallel.planning.config import AutoRecompute
from parallel.planning.layout import PipelineLayout
from parallel.planning.plan_record import RunPlan
from parallel.planning.plan_verdict import GPU_MEMORY_GIB, Replanner, verdict_lines
from parallel.planning.shapes import GIB
from parallel.planning.virtual_choice import virtual_lines


def dry_run(ctx: RunContext, layout: PipelineLayout) -> RunPlan:
    run = ctx.run
    plan = run_plan(ctx, layout)
    lines = layout.describe() + layout.empty_stage_warnings() + plan.lines()
    if layout.budgeted:
        lines += layout.describe_budgets(run.recompute) + layout.describe_considered()
    if plan.virtual is not None:  # the layout's stages are virtual stages: each rank's chunks together
        lines += plan.virtual.lines()
    else:
        lines += virtual_lines(run.model, run.recompute, layout, ctx.shape, run.parallel.chunks)
    if ctx.env.rank == 0:
        memory_bytes, memory_name = memory_target(ctx)
        profile, _ = run_profile(ctx)
        replanner = Replanner(run.model, run.parallel.partition_method, run.seed, profile, run_rates(ctx))
        lines += verdict_lines(
            plan, memory_bytes, memory_name, replanner, run.recompute, ctx.shape, run.parallel.schedule
        )
        for line in lines:
            print("stagecheck: " + line)
        path = ctx.run_dir / "plan.json"
        atomic_write_json(path, plan.to_json())
        print(f"stagecheck: dry run: wrote {path}", flush=True)
    return plan


def memory_target(ctx: RunContext) -> tuple[int, str]:
    """(bytes, whose) the verdict measures each stage against: train.device_memory_gb (see its docstring)."""
    run = ctx.run
    if run.train.device_memory_gb is not None:
        return int(run.train.device_memory_gb * GIB), "train.device_memory_gb"
    if isinstance(run.recompute, AutoRecompute):
        return int(run.recompute.budget_gb * GIB), "recompute.budget_gb"
    if ctx.target.device == "cuda":
        return int(
            GPU_MEMORY_GIB * GIB
        ), "an 80 GB H100, the GPU this dry run plans on: train.device_memory_gb sets another"
    ranks = ranks_on_node(ctx)
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return memory // ranks, f"this machine's memory shared by {ranks} ranks: train.device_memory_gb sets another"
