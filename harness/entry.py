"""From a composed Hydra config to a run: validate everything once, then train."""
import os
import sys
from pathlib import Path

import torch
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from harness import preemption
from harness.checkpoint import check_compatible, resume_point
from harness.dry_run import dry_run, dry_run_world_size
from harness.faults import check_output_dir, run_guarded
from harness.multirun import finished_earlier, guard_job, startup_failed
from harness.run_dir import check_run_dir, remove_if_empty
from parallel.dist_env import read_dist_env
from schema.checks import check_data, runtime, to_run_config, topology


def run_from_hydra(cfg: DictConfig) -> None:
    run_dir = Path(HydraConfig.get().runtime.output_dir)
    if finished_earlier(run_dir, cfg):  # a relaunched sweep: this job is done
        return
    try:
        env = read_dist_env()
        run = to_run_config(cfg)
        topo = topology(run, dry_run_world_size(run, env) if run.dry_run else env.world_size)
        # A dry run plans for CUDA (train.device=cuda or auto) whether or not this machine has a GPU.
        rt = runtime(run, torch.cuda.is_available() or run.dry_run)
        check_data(run)
        # DeepSpeed picks its accelerator when first imported (by the partition code): choose it first.
        # A dry run uses only DeepSpeed's pure partition and schedule code, whatever it plans for.
        os.environ.setdefault("DS_ACCELERATOR", "cpu" if run.dry_run else rt.device)
        from harness.plan import plan_layout

        layout, budgets = plan_layout(run, topo, rt)  # recompute=auto may not fit its budget
        point = resume_point(run.train, run_dir)  # train.resume: auto, false or a checkpoint path
        if point is not None:
            check_compatible(point, topo.world_size, topo.pipeline_stages)
        check_run_dir(run_dir, continuing=point is not None and point.inside(run_dir), overwrite=run.train.overwrite)
        if not run.dry_run:
            check_output_dir(run, run_dir, rt.precision, env.rank)  # read-only, full, too small for a checkpoint
    except ValueError as error:
        print(f"stagecheck: error: {error}", file=sys.stderr)
        if startup_failed(run_dir, f"stagecheck: error: {error}"):
            return  # a sweep job (-m): marked FAILED in its directory, the sweep goes on (harness/multirun.py)
        remove_if_empty(run_dir)
        sys.exit(2)

    if run.dry_run:
        dry_run(run, run_dir, env, topo, rt, layout, budgets)  # plan.json and the per-stage table; no process group
        return

    from harness.trainer import train

    # SIGTERM/SIGUSR1 from here on: checkpoint at the next step boundary, exit 75 (harness/faults.py).
    preemption.install(env.rank)
    # An exception ends this rank at once with `stagecheck: rank N failed: ...`, never a hang.
    # In a sweep (-m), guard_job marks a failed job and lets a non-finite stop go on to the next job.
    run_guarded(env.rank, guard_job(run_dir, env.rank,
                                    lambda: train(run, run_dir, env, topo, rt, OmegaConf.to_container(cfg, resolve=True),
                                                  layout, budgets)))
