"""`python train.py ... dry_run=true`: plan the run without running it.

No launcher, no process group, no deepspeed.initialize: the model is only ever built on the meta device
(to count parameters), split into stages by the same partition routine training uses, and planned by
parallel/planner.py. Prints the per-stage table and writes plan.json to the run directory.
"""
import json
import os
from pathlib import Path

from parallel.dist_env import DistEnv
from schema.checks import Runtime, Topology
from schema.run import RunConfig


def dry_run_world_size(run: RunConfig, env: DistEnv) -> int:
    """Under a launcher, its world size; without one, parallel.pipeline_stages (default 1) ranks,
    i.e. one data-parallel replica."""
    if env.source != "single":
        return env.world_size
    return run.parallel.pipeline_stages or 1


def dry_run(run: RunConfig, run_dir: Path, env: DistEnv, topo: Topology, rt: Runtime) -> dict:
    # Only DeepSpeed's pure partition and schedule code is used: any accelerator will do.
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from parallel.layout import pipeline_layout
    from parallel.memory_model import Target
    from parallel.planner import RunShape, format_plan, plan_run

    layout = pipeline_layout(run.model, run.recompute, topo.pipeline_stages, run.parallel.partition_method, run.seed)
    t = run.train
    plan = plan_run(run.model, run.recompute, layout,
                    RunShape(t.micro_batches, t.micro_batch_size, topo.data_parallel_size, run.parallel.zero_stage,
                             Target(rt.device, rt.precision)))
    plan["model"] = vars(run.model)
    if env.rank == 0:
        for line in layout.describe() + format_plan(plan):
            print("stagecheck: " + line)
        path = run_dir / "plan.json"
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(plan, indent=2) + "\n")
        tmp.replace(path)
        print(f"stagecheck: dry run: wrote {path}", flush=True)
    return plan
