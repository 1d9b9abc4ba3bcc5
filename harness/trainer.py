"""The training run: process group, pipeline engine, the step loop and its outputs."""

import signal
import time
import warnings
from dataclasses import asdict

import torch
from omegaconf import OmegaConf

from data import open_token_source, save_run_tokenizer
from harness import preemption
from harness.accounting import Accounting
from harness.context import RunContext
from harness.evaluation import Evaluator, val_summary
from harness.files import atomic_write_text
from harness.garbage_collection import GarbageCollection
from harness.hf.source import record_hf_source
from harness.metrics import MetricsLog, median_after_warmup
from harness.prediction_check import learn_residuals, prediction_record, prediction_warning
from harness.run_control import RunControl
from harness.run_dir import set_aside_earlier_attempt, starts_again
from harness.run_engine import build_run_engine
from harness.run_layout import check_same_layout, is_virtual, run_plan
from harness.run_summary import done_line, wandb_sync_command
from harness.timeline import publish_trace
from harness.virtual_accounting import RankAccounting
from harness.wandb_logger import open_wandb
from parallel.measurement.compile_counters import CompileWatch
from parallel.measurement.sdpa_backend import check_planned_backend, sdpa_backend
from parallel.measurement.trace import StepTracer
from parallel.planning.compression import lossy_note
from parallel.planning.layout import PipelineLayout
from parallel.planning.shapes import Shape
from parallel.runtime.dist_env import node_name
from parallel.runtime.engine import init_process_group
from schema.training import TrainConfig

# DeepSpeed's pipeline sends activations with c10d broadcasts inside autograd; torch warns once per
# rank that the op has no autograd kernel. DeepSpeed handles those gradients itself: noise.
warnings.filterwarnings("ignore", message="c10d::broadcast_: an autograd kernel was not registered")
# The fp32 non-finite guard replaces optimizer.step after DeepSpeed built the LR scheduler (harness/faults.py), on
# purpose: torch's scheduler warns once per rank that step() was overridden. The guard calls the scheduler's own.
warnings.filterwarnings("ignore", message="Seems like `optimizer.step\\(\\)` has been overridden")


def write_config(ctx: RunContext) -> None:
    """config.yaml: how the run was trained. A run continued in place keeps its own (each resume, with the options
    it changed, is in resumes.jsonl beside it)."""
    path = ctx.run_dir / "config.yaml"
    if ctx.resume is None or not ctx.resume.in_place or not path.exists():
        atomic_write_text(path, OmegaConf.to_yaml(ctx.resolved))


def traced_step(train: TrainConfig, start_step: int) -> int | None:
    """The step to trace: train.trace_step's; when a resume is past it, the one as far into this launch (so
    summary.json has the bubbles of the segment it trains), or None when nothing is left to train."""
    step = train.traced_step
    if step is None or step > start_step:
        return step
    return min(start_step + step, train.steps) if start_step < train.steps else None


def train(ctx: RunContext, layout: PipelineLayout) -> None:
    run, run_dir, rank, topology, target = ctx.run, ctx.run_dir, ctx.env.rank, ctx.topology, ctx.target
    if rank == 0:
        if starts_again(run.train.resume, run.train.overwrite, ctx.resume is not None, run_dir):
            aside = set_aside_earlier_attempt(run_dir)
            print(
                f"stagecheck: {run_dir} holds no complete checkpoint to resume (train.resume=auto): starting the run "
                f"again; the earlier attempt's files are in {aside}",
                flush=True,
            )
        write_config(ctx)
        print(
            f"stagecheck: {topology.world_size} ranks = {topology.pipeline_stages} stages x "
            f"{topology.data_parallel_size} data-parallel | recompute={run.recompute} | {target.device} "
            f"{target.precision} | run dir {run_dir}"
        )
        lossy = lossy_note(layout.plans)
        for line in layout.describe() + layout.empty_stage_warnings() + ([lossy] if lossy else []):
            print("stagecheck: " + line, flush=True)
        if run.train.compile:
            print("stagecheck: train.compile: each block compiled (inductor), after its plan", flush=True)
        if run.model.packed_dropout and run.model.dropout == 0:
            print("stagecheck: model.packed_dropout=true is a no-op: model.dropout is 0, so no masks are kept")

    init_process_group(ctx.env, target.device, run.train.collective_timeout_s)
    check_same_layout(layout)  # planned by every rank on its own, before the group existed
    # The SDPA kernel this device runs, refused unless it keeps what the plan counted (before any engine exists).
    backend = None
    if run.model.attention == "sdpa":
        one_micro_batch = Shape.of(run.model, run.train.micro_batch_size)
        backend = sdpa_backend(one_micro_batch, target, run.model.dropout)
        check_planned_backend(backend, one_micro_batch, target)
    if layout.budgeted and rank == 0:
        for line in layout.describe_budgets(run.recompute):
            print("stagecheck: " + line, flush=True)
    engine = build_run_engine(ctx, layout)  # the schedule's: DeepSpeed's PipelineEngine or the virtual engine
    # The rank's own stream, for whatever draws outside a training forward: dropout draws from states keyed by
    # (seed, replica, step, micro-batch, layer) instead (parallel/runtime/dropout_keys.py).
    torch.manual_seed(run.seed * 1009 + rank)
    # Resume (weights, optimizer, scheduler, RNG states) or start fresh; checkpoints, preemption, NaN policy.
    control = RunControl(ctx, engine)
    # Activation bytes (metered on train.measure_step only), in-flight micro-batches, FLOP/s, MFU, peak memory.
    plan = run_plan(ctx, layout)
    virtual = is_virtual(layout)
    accounting = (RankAccounting if virtual else Accounting)(ctx, plan, engine)
    # Per-instruction timings of train.trace_step on every rank (trace.json, timeline.png, bubbles per stage or rank).
    tracer = StepTracer(engine, traced_step(run.train, control.start_step), target.device)
    if virtual and rank == 0:
        for line in plan.virtual.lines():
            print("stagecheck: " + line, flush=True)

    dp_rank = engine.grid.get_data_parallel_rank()
    needs_data = engine.is_first_stage() or engine.is_last_stage()
    source = open_token_source(run.data, run.model.vocab_size) if needs_data else None
    if rank == 0:  # generate.py and export_hf.py find the tokenizer that trained the model here
        save_run_tokenizer(run.data, run_dir)
        record_hf_source(run.model.init_from, run.data, run_dir)  # what export_hf.py keeps of model.init_from
    evaluator = Evaluator(ctx, engine, source)  # train.eval_every: val loss on fixed batches
    holds_loss = engine.is_last_stage() and dp_rank == 0
    metrics = None
    if holds_loss:
        run_config = {
            **ctx.resolved,
            "layout": layout.as_dict(),
            "topology": topology.as_dict(),
            "runtime": {"device": target.device, "precision": target.precision},
        }
        wandb = open_wandb(
            run.logger,
            run_dir,
            run_config,
            job_type=run.recompute.mode,
            extra_tags=[f"model:{run.model.n_layer}L-{run.model.n_embd}h", f"stages:{topology.pipeline_stages}"],
            job=ctx.job,
            run_id=control.wandb_run_id,
        )
        metrics = MetricsLog(
            run_dir,
            run.train.steps,
            run.train.log_every,
            wandb,
            resume_step=control.start_step if control.resumed else None,
        )
    control.attach(metrics)

    synchronize = torch.cuda.synchronize if target.device == "cuda" else lambda: None
    t = run.train
    tokens_per_step = ctx.shape.tokens_per_step(run.model.seq_len)
    compiling = CompileWatch() if run.train.compile else None  # graphs, breaks and compile seconds of this process
    with GarbageCollection(t.gc_interval) as collector:  # restored after the loop: a sweep's next job trains here
        for step in range(control.start_step + 1, t.steps + 1):
            batches = None
            if source is not None:
                batches = iter(
                    [
                        source.batch(run.seed, step, dp_rank, micro, t.micro_batch_size, run.model.seq_len)
                        for micro in range(t.micro_batches)
                    ]
                )
            lr = engine.get_lr()[0]
            accounting.before_step(step)
            tracer.begin(step)  # on the traced step: a barrier, then every rank's clock starts
            synchronize()  # the device's queued work is not this step's
            start = time.perf_counter()
            loss = engine.train_batch(data_iter=batches)
            synchronize()  # the step's kernels have run, not only been queued
            step_time = time.perf_counter() - start
            tracer.end(step)
            accounting.after_step(step, step_time)
            # outside the step's time: every rank collects here, none mid-step
            collected = collector.after_step(step, accounting.metering_done)
            verdict = control.check_step(step, loss)  # collective: preemption request, non-finite loss/grads
            evaluated = evaluator.evaluate_if_due(step)  # collective when due; after the step's timing and metering
            if compiling and step == control.start_step + 1:  # what compiling cost: the first step and its evaluation
                line = compiling.first_step_done()
                if rank == 0:
                    print(f"stagecheck: {line} (stage 0; the training step took {step_time:.1f} s)", flush=True)
            if metrics:
                grad_norm = engine.get_global_grad_norm()
                metrics.log_step(
                    {
                        "step": step,
                        "loss": loss.item(),
                        "lr": lr,
                        "tokens_per_s": tokens_per_step / step_time,
                        "step_time_s": step_time,
                        "tokens": tokens_per_step * step,
                        **accounting.step_record(step_time),
                        **({"grad_norm": float(grad_norm)} if grad_norm is not None else {}),
                        **evaluated,
                        **collected,
                        **verdict.record,
                    }
                )
            control.finish_step(step, verdict)  # checkpoint when due; exits on preemption or a non-finite step

    # Every step is trained and the last saved: a preemption notice from now on (SLURM's warning USR1, a SIGTERM) has
    # nothing left to save, and must not kill this rank while it finishes (interpreter shutdown resets the Python
    # handlers to the default, death). Seen: a USR1 after the last step killed rank 0 at exit and failed the job.
    # Ctrl-C keeps its handler: a second one still quits at once.
    preemption.ignore_from_now((signal.SIGTERM, signal.SIGUSR1))

    # Every rank takes part; only the first and last stages hold a copy of the tied weight.
    gathered = [None] * topology.world_size  # (tied-weight digest, node name, compile counts) of every rank
    compiled = compiling.record() if compiling else None
    torch.distributed.all_gather_object(gathered, (engine.module.tied_weight_digest(), node_name(), compiled))
    digests = [digest for digest, _, _ in gathered]
    accounted = accounting.gather()  # collective too
    traced = tracer.gather()  # collective when a step was traced: every rank's trace to the loss rank
    if metrics:
        records = metrics.records
        summary = {
            "recompute": run.recompute.mode,
            "recompute_config": vars(run.recompute),
            "lossy": lossy_note(layout.plans),
            "layout": layout.as_dict(),  # under a virtual-stage schedule: its virtual stages
            "schedule": layout.virtual_schedule or layout.schedule,  # the schedule it ran (auto's choice)
            "virtual": asdict(plan.virtual) if virtual else None,  # each rank's chunks, planned peak and step
            **topology.as_dict(),
            "micro_batches": t.micro_batches,
            "micro_batch_size": t.micro_batch_size,
            "seq_len": run.model.seq_len,
            "steps": t.steps,
            "resumed_from_step": control.start_step if control.resumed else None,  # later fields: from this launch
            "device": target.device,
            "precision": target.precision,
            "sdpa_backend": backend,  # the kernel SDPA ran (parallel/measurement/sdpa_backend.py); None: attention=math
            "losses": [r["loss"] for r in records],
            **val_summary(records),
            "tokens_per_s": median_after_warmup([r["tokens_per_s"] for r in records]),
            "step_time_s": median_after_warmup([r["step_time_s"] for r in records]),
            "predicted_step_time_s": plan.predicted_step_time_s,  # parallel/planning/step_sim.py
            "step_time_costs": plan.prediction_costs,  # measured (a profile) or analytic
            "cost_source": plan.cost_source,  # the profile's path and date
            "tied_weight_sha256_per_rank": digests,
            "node_per_rank": [node for _, node, _ in gathered],  # SLURM node name (SLURMD_NODENAME), else host name
            "compile_per_rank": [counts for _, _, counts in gathered] if run.train.compile else None,
            **accounted,
            **publish_trace(traced, run_dir, metrics.wandb),  # trace.json, timeline.png, bubbles
        }
        if plan.predicted_step_time_s:  # the prediction against the measured step, per instruction on a traced step
            summary["prediction"] = prediction_record(plan, summary["step_time_s"], traced)
        if plan.cost_source and traced:  # the next plan at this shape learns from this run's residuals
            learnt = learn_residuals(summary["prediction"], plan.cost_source, plan.data_parallel_size)
            summary["prediction"]["residuals_file"] = str(learnt) if learnt else None
        metrics.write_summary(summary)
        sync_command = wandb_sync_command(metrics.wandb)
        metrics.close()
        missed = prediction_warning(summary["prediction"]) if plan.predicted_step_time_s else None
        if missed:
            print(missed, flush=True)
        print(done_line(summary, run_dir, sync_command), flush=True)  # the run's last line, after W&B's finish
