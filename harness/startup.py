"""From a composed Hydra config to a run: every input validated once, before any process group or file exists
(bad input exits 2 with one message naming the option), then a dry run or training."""

import gc
import sys
from pathlib import Path

import torch
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from harness import preemption
from harness.checkpoint import resume_point
from harness.compiled_blocks import with_compiled_blocks
from harness.config_errors import unknown_added_keys
from harness.context import RunContext
from harness.dry_run import dry_run
from harness.faults import EXIT_CONFIG, check_output_dir, run_guarded
from harness.hf.init_from import model_from_checkpoint, resolve_init_from
from harness.job import JobHooks
from harness.relaunch import launcher_words
from harness.resume_check import ResumeCommand, absolute_paths, check_partition, check_resume
from harness.run_dir import check_run_dir, remove_if_empty, starts_again
from harness.run_layout import layout_of
from model import gpt_layers, model_param_count
from parallel.planning.virtual_program import VIRTUAL_SCHEDULES
from parallel.planning.virtual_support import schedule_change_refusal, virtual_run_refusal
from parallel.runtime.accelerator import use_accelerator
from parallel.runtime.dist_env import DistEnv, read_dist_env
from parallel.runtime.threads import set_threads_per_rank
from schema.checks import check_cuda_device, check_data, run_shape, to_run_config
from schema.run import RunConfig


class RankError(ValueError):
    """Bad input that this rank alone may have (its device): printed by every rank that has it, where an error of
    the config, the same on every rank, is printed by rank 0 alone."""


def run_from_hydra(cfg: DictConfig, job: JobHooks) -> None:
    run_dir = Path(HydraConfig.get().runtime.output_dir)
    rank = 0
    try:
        env = read_dist_env()
        rank = env.rank
        if job.finished_earlier(run_dir, cfg, rank):  # a relaunched sweep: this job is done
            return
        ctx = validate(cfg, run_dir, env, job)
        if ctx.run.train.compile:  # the plan counts what a compiled block keeps, measured once per shape
            ctx, line = with_compiled_blocks(ctx)
            if rank == 0:
                print(f"stagecheck: {line}", flush=True)
        layout = layout_of(ctx)  # recompute=auto may not fit its budget
        check_partition(ctx.resume, layout.parts)
        if not ctx.run.dry_run:  # a dry run loads no DeepSpeed
            use_accelerator(ctx.target.device)
    except ValueError as error:
        message = f"stagecheck: error: {error}"
        if rank == 0 or isinstance(error, RankError):  # the others found the same in the same config
            print(message, file=sys.stderr)
        if job.startup_failed(run_dir, message, rank):
            return  # a sweep job: marked FAILED in its directory, the sweep goes on (sweep/job.py)
        remove_if_empty(run_dir)
        sys.exit(EXIT_CONFIG)

    if ctx.run.dry_run:
        dry_run(ctx, layout)  # plan.json and the per-stage table; no process group
        return
    threads = set_threads_per_rank(ctx.env)  # OMP_NUM_THREADS, else this rank's share of the node's cores
    if rank == 0:
        print(f"stagecheck: {threads}", flush=True)
    # SIGTERM/SIGUSR1 from here on: checkpoint at the next step boundary, exit 75 (harness/faults.py).
    preemption.install(rank)
    # Loads DeepSpeed, whose accelerator use_accelerator chose above: imported only here, after that choice.
    from harness.trainer import train

    # What the imports made lives as long as the process: out of the collector's sight (gc.freeze), the collections
    # and the tensor meters' heap walks of the run visit its own objects only (sweep/callback.py does the same).
    gc.collect()
    gc.freeze()
    # An exception ends this rank at once with `stagecheck: rank N failed: ...`, never a hang; the job's guard
    # decides what a sweep does with it.
    run_guarded(rank, job.guard(run_dir, rank, lambda: train(ctx, layout)))


def validate(cfg: DictConfig, run_dir: Path, env: DistEnv, job: JobHooks) -> RunContext:
    """Config values, topology, device, data, the checkpoint to resume and the run directory; raises
    ValueError. (The layout, planned next, checks recompute=auto's budget.)"""
    overrides = HydraConfig.get().overrides.task
    point = resume_point(cfg.train, run_dir)  # train.resume: auto, false or a checkpoint path
    # model.init_from sets the model's shape, unless this launch resumes: then the checkpoint's saved config does.
    if point is None or not model_from_checkpoint(cfg, point.meta.get("config"), overrides):
        resolve_init_from(cfg, overrides)
    unknown = unknown_added_keys(cfg)  # `+train.foo=1` passes Hydra: the typed config would drop it unread
    if unknown:
        raise ValueError("; ".join(unknown))
    run = to_run_config(cfg)
    world_size = dry_run_world_size(run, env) if run.dry_run else env.world_size
    # A dry run plans for CUDA (train.device=cuda or auto) whether or not this machine has a GPU.
    shape = run_shape(run, world_size, torch.cuda.is_available() or run.dry_run)
    if shape.target.device == "cuda" and not run.dry_run:
        # Read without making a CUDA context: the rank's device is set when its process group starts
        # (parallel/runtime/engine.py).
        visible, capability = torch.cuda.device_count(), torch.cuda.get_device_capability
        try:
            check_cuda_device(
                shape.target, run.train.precision, env.local_rank, env.local_world_size, visible, capability
            )
        except ValueError as error:
            raise RankError(str(error)) from None
    check_data(run)
    if run.parallel.schedule in VIRTUAL_SCHEDULES:  # what the virtual engine does not run yet, in one line
        refusal = virtual_run_refusal(
            run.parallel.schedule,
            run.recompute,
            shape.target.precision,
            run.parallel.zero_stage,
            run.train.micro_batches,
            shape.topology.pipeline_stages,
            run.model.n_layer,
            run.parallel.chunks,
        )
        if refusal:
            raise ValueError(refusal)
    resolved = absolute_paths(OmegaConf.to_container(cfg, resolve=True))  # recorded as the run used them
    command = typed_command(world_size)
    resume = None
    if point is not None:  # everything that shapes the weights, the tokens or the partition must match
        resume = check_resume(point, run, resolved, shape, run_dir, command)
        refusal = schedule_change_refusal(resume.saved_schedule, run.parallel.schedule)
        if refusal:
            raise ValueError(refusal)
    in_place = point is not None and point.inside(run_dir)
    again = starts_again(run.train.resume, run.train.overwrite, point is not None, run_dir)
    check_run_dir(run_dir, continuing=in_place or again, overwrite=run.train.overwrite)
    if not run.dry_run:  # read-only, full, too small for a checkpoint
        check_output_dir(
            run_dir,
            model_param_count(gpt_layers(run.model, run.seed)),
            shape.target.precision,
            run.train.keep_checkpoints,
            env.rank,
        )
    relaunch = command.relaunch(run_dir, named=run.train.run_name is not None)
    return RunContext(run, resolved, run_dir, env, shape, job, resume, relaunch)


def typed_command(world_size: int) -> ResumeCommand:
    """This launch's command as typed (launcher, script, options), for the commands a refused resume and a
    preemption print."""
    overrides = HydraConfig.get().overrides
    run_dir = [o for o in overrides.hydra if o.lstrip("+").startswith("hydra.run.dir=")]
    return ResumeCommand(
        launcher_words(sys.argv[0], world_size), list(overrides.task), run_dir[-1] if run_dir else None
    )


def dry_run_world_size(run: RunConfig, env: DistEnv) -> int:
    """Under a launcher, its world size; without one, parallel.pipeline_stages (default 1) x
    parallel.data_parallel_size (default 1) ranks."""
    if env.source != "single":
        return env.world_size
    return (run.parallel.pipeline_stages or 1) * (run.parallel.data_parallel_size or 1)
