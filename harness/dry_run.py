"""`python train.py ... dry_run=true`: plan the run without running it.

No launcher, no process group, no deepspeed.initialize: the model is only ever built on the meta device
(to count parameters), split into stages by the same partition routine training uses, and planned by
parallel/planner.py. Prints the per-stage table and writes plan.json to the run directory.
"""
import json
from pathlib import Path
from typing import Optional

from harness.plan import budget_lines, budget_record, run_shape
from parallel.auto_recompute import StageBudget
from parallel.layout import PipelineLayout
from parallel.planner import format_plan, plan_run

from parallel.dist_env import DistEnv
from schema.checks import Runtime, Topology
from schema.run import RunConfig


def dry_run_world_size(run: RunConfig, env: DistEnv) -> int:
    """Under a launcher, its world size; without one, parallel.pipeline_stages (default 1) x
    parallel.data_parallel_size (default 1) ranks."""
    if env.source != "single":
        return env.world_size
    return (run.parallel.pipeline_stages or 1) * (run.parallel.data_parallel_size or 1)


def dry_run(run: RunConfig, run_dir: Path, env: DistEnv, topo: Topology, rt: Runtime, layout: PipelineLayout,
            budgets: Optional[list[StageBudget]]) -> dict:
    plan = plan_run(run.model, run.recompute, layout, run_shape(run, topo, rt))
    plan["model"] = vars(run.model)
    lines = layout.describe() + format_plan(plan)
    if budgets is not None:
        for stage, budget in zip(plan["stages"], budgets):
            stage.update(budget_record(run.recompute, budget))
        lines += budget_lines(run.recompute, budgets)
    if env.rank == 0:
        for line in lines:
            print("stagecheck: " + line)
        path = run_dir / "plan.json"
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(plan, indent=2) + "\n")
        tmp.replace(path)
        print(f"stagecheck: dry run: wrote {path}", flush=True)
    return plan
