"""What happens around each step so nothing is lost and nothing hangs: resume, the per-step agreement
of all ranks (preemption request, non-finite loss or gradients), checkpoint cadence, and clean exits.

The trainer calls, on every rank:

    control = RunControl(ctx, engine)              # after building the engine
    control.attach(metrics)                        # the loss rank's MetricsLog, or None
    for step in range(control.start_step + 1, steps + 1):
        loss = engine.train_batch(...)
        verdict = control.check_step(step, loss)   # one all-reduce: every rank gets the same verdict
        ... log the step's record, with verdict.record merged in ...
        control.finish_step(step, verdict)         # save when due; may end the process (exit 3 or 75)

Logging comes before saving, so a checkpoint at step k always has step k in metrics.jsonl.
"""

import json
import os
import shutil
import signal
import socket
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from harness import faults, preemption
from harness.checkpoint import (
    CHECKPOINTS,
    LATEST,
    Checkpointer,
    checkpoints_dir,
    new_wandb_run_id,
    resume_point,
)
from harness.context import Resume, RunContext
from harness.files import atomic_write_text

RESUMES = "resumes.jsonl"
"""Beside config.yaml (which keeps how the run was first launched): one line per resume."""
# What `train.overwrite=true` deletes before a fresh start (config.yaml is rewritten anyway).
PREVIOUS_OUTPUTS = ("metrics.jsonl", "summary.json", CHECKPOINTS, RESUMES)


@dataclass
class StepVerdict:
    nonfinite: bool
    preempt_signal: int
    """The signal number that asked for preemption (0: none)."""
    preempt_rank: int
    """A rank that received it (-1: none)."""
    record: dict = field(default_factory=dict)
    """Extra fields for the step's metrics record."""


def step_is_nonfinite(loss: float, grad_norm, step_applied: bool, fp16: bool) -> bool:
    """Whether a finished step is a fault (train.nan_policy): a non-finite loss, a non-finite gradient norm, or a
    skipped update. Under fp16 DeepSpeed skips a step whose scaled gradients overflowed, reporting an inf gradient
    norm, while its loss scale settles: normal, not a fault (a non-finite loss still is one)."""
    if fp16 and not step_applied:
        return not faults.is_finite(loss)
    return not (faults.is_finite(loss) and faults.is_finite(grad_norm) and step_applied)


class RunControl:
    def __init__(self, ctx: RunContext, engine):
        self.train = ctx.run.train
        self.run_dir = run_dir = ctx.run_dir
        self.relaunch = ctx.relaunch
        self.rank = ctx.env.rank
        self.engine = engine
        self.fp16 = ctx.target.precision == "fp16"
        self.device = (
            torch.device("cuda", torch.cuda.current_device()) if ctx.target.device == "cuda" else torch.device("cpu")
        )
        self.metrics = None
        self.skipped = 0

        # Start-up checked train.resume already (harness/resume_check.py); the files have not changed since.
        point = resume_point(self.train, run_dir)
        in_place = point is not None and point.inside(run_dir)
        dist.barrier()  # every rank has read the run directory before rank 0 changes it
        if self.rank == 0:
            if not in_place and self.train.overwrite:
                _remove_previous_outputs(run_dir)
            elif in_place and _latest_tag(run_dir) != point.path.name:
                # An explicit older checkpoint of this run: it becomes the latest, so the saves that follow
                # (which may reuse newer tags) never overwrite what `latest` names.
                atomic_write_text(checkpoints_dir(run_dir) / LATEST, point.path.name + "\n")
            if ctx.resume is not None:
                record_resume(run_dir, ctx.resume)
        # Same W&B run when continuing in place; a new one for a fresh start or a fork of another run.
        wandb_run_id = point.meta.get("wandb_run_id") if in_place else None
        if self.rank == 0 and wandb_run_id is None:
            wandb_run_id = new_wandb_run_id()
        # One exchange, which is also the barrier after rank 0's file changes: rank 0's W&B id, and every
        # rank's (host, pid), so a rank whose peer dies can name it.
        gathered = [None] * ctx.topology.world_size
        dist.all_gather_object(gathered, (socket.gethostname(), os.getpid(), wandb_run_id))
        faults.register_peers([(host, pid) for host, pid, _ in gathered])
        self.wandb_run_id: str = gathered[0][2]

        self.checkpointer = Checkpointer(ctx, engine, self.wandb_run_id)
        self.resumed_from = point
        self.start_step = self.checkpointer.load(point) if point is not None else 0
        self.last_saved: int | None = self.start_step if in_place else None
        if self.rank == 0 and point is not None:
            print(resuming_line(point.path, self.start_step, self.wandb_run_id, ctx.run.logger.name), flush=True)
            if ctx.resume is not None and ctx.resume.changed:
                changes = ", ".join(f"{k} {old!r} -> {new!r}" for k, (old, new) in ctx.resume.changed.items())
                print(f"stagecheck: options changed on resume (recorded in {RESUMES}): {changes}", flush=True)
            if self.start_step >= self.train.steps:
                print(
                    f"stagecheck: the checkpoint is at step {self.start_step} >= train.steps={self.train.steps}: "
                    f"nothing left to train",
                    flush=True,
                )

        faults.install_nonfinite_guard(engine)
        faults.install_nan_injection(engine, list(self.train.inject_nan_at_steps))

    @property
    def resumed(self) -> bool:
        return self.resumed_from is not None

    def attach(self, metrics) -> None:
        """The loss rank's MetricsLog: closed (W&B finished with the exit code) however the run ends."""
        self.metrics = metrics
        if metrics is not None:
            faults.on_failure(lambda: metrics.close(exit_code=faults.EXIT_FAILED))

    def check_step(self, step: int, loss) -> StepVerdict:
        """Collective: every rank reports its preemption request and whether it saw a non-finite loss,
        gradient norm, or a skipped update; one all-reduce (MAX) gives all ranks the same verdict."""
        faults.maybe_fail_for_test(self.rank, step)
        loss_value = float(loss.item()) if loss is not None else 0.0
        nonfinite = step_is_nonfinite(
            loss_value, self.engine.get_global_grad_norm(), self.engine.was_step_applied(), self.fp16
        )
        signum = preemption.requested() or 0
        flags = torch.tensor(
            [float(signum), float(self.rank + 1 if signum else 0), float(nonfinite)],
            dtype=torch.float64,
            device=self.device,
        )
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        verdict = StepVerdict(
            nonfinite=bool(flags[2].item()), preempt_signal=int(flags[0].item()), preempt_rank=int(flags[1].item()) - 1
        )
        if verdict.nonfinite and self.train.nan_policy == "skip":
            self.skipped += 1
            verdict.record["skipped"] = True
        self._loss = loss_value
        return verdict

    def finish_step(self, step: int, verdict: StepVerdict) -> None:
        """Collective: stop on a non-finite step (never saving it), save when due, exit when preempted."""
        t = self.train
        if verdict.nonfinite and (t.nan_policy == "stop" or self.skipped > t.nan_skip_limit):
            self._exit(faults.EXIT_NONFINITE, self._nonfinite_message(step))
        if verdict.nonfinite and self.rank == 0:
            print(
                f"stagecheck: step {step}: non-finite loss or gradients, update skipped "
                f"({self.skipped}/{t.nan_skip_limit}, train.nan_policy=skip)",
                file=sys.stderr,
                flush=True,
            )
        if step == t.steps or (t.save_every and step % t.save_every == 0) or verdict.preempt_signal:
            self.checkpointer.save(step)
            self.last_saved = step
        if verdict.preempt_signal:
            name = signal.Signals(verdict.preempt_signal).name
            self._exit(
                faults.EXIT_PREEMPTED,
                f"stagecheck: preempted ({name} on rank {verdict.preempt_rank}): checkpoint of step {step} "
                f"saved in {checkpoints_dir(self.run_dir)}; exiting {faults.EXIT_PREEMPTED}. To continue, relaunch "
                f"(train.resume=auto): {self.relaunch}",
            )

    def _nonfinite_message(self, step: int) -> str:
        what = "loss" if not faults.is_finite(self._loss) else "gradients"
        why = (
            "train.nan_policy=stop"
            if self.train.nan_policy == "stop"
            else f"{self.skipped} skipped steps > train.nan_skip_limit={self.train.nan_skip_limit}"
        )
        if self.last_saved is None:
            kept = "no checkpoint of this run was saved yet"
        else:
            kept = (
                f"nothing was saved after it; the last good checkpoint is "
                f"{checkpoints_dir(self.run_dir) / f'step_{self.last_saved:08d}'} (step {self.last_saved})"
            )
        return (
            f"stagecheck: non-finite {what} at step {step} (loss={self._loss}): stopping ({why}); {kept}. "
            f"Exit code {faults.EXIT_NONFINITE}."
        )

    def _exit(self, code: int, message: str) -> None:
        if self.rank == 0:
            print(message, file=sys.stderr, flush=True)
        if self.metrics is not None:
            try:  # a W&B failure must not turn a clean stop (the checkpoint is saved) into exit code 1
                if code == faults.EXIT_PREEMPTED and self.metrics.wandb is not None:
                    self.metrics.wandb.mark_preempting()
                self.metrics.close(exit_code=code)
            except Exception as error:  # noqa: BLE001
                print(f"stagecheck: warning: closing the metrics/W&B run failed: {error}", file=sys.stderr, flush=True)
        # Outputs are finished on every rank before any exits: the launcher (or srun -K) kills the rest's
        # process trees, the W&B service included, as soon as one rank has exited.
        dist.barrier()
        preemption.ignore_from_now()  # srun -K's SIGTERM must not turn this exit code into 143 (preemption.py)
        raise SystemExit(code)


def record_resume(run_dir: Path, resume: Resume) -> None:
    """One line of resumes.jsonl per launch that continued from a checkpoint: when, from which checkpoint and step,
    the options it changed ([saved, new]) and the learning-rate decay it follows."""
    record = {
        "resumed_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "checkpoint": str(resume.checkpoint),
        "from_step": resume.step,
        "in_place": resume.in_place,
        "changed": resume.changed,
        "lr_schedule": asdict(resume.lr_segment) if resume.lr_segment else None,
    }
    with open(run_dir / RESUMES, "a") as handle:
        handle.write(json.dumps(record) + "\n")


def _latest_tag(run_dir: Path) -> str | None:
    pointer = checkpoints_dir(run_dir) / LATEST
    return pointer.read_text().strip() if pointer.is_file() else None


def _remove_previous_outputs(run_dir: Path) -> None:
    for name in PREVIOUS_OUTPUTS:
        path = run_dir / name
        if path.is_dir():
            shutil.rmtree(path)
        elif path.exists():
            path.unlink()


def resuming_line(checkpoint: Path, step: int, wandb_run_id: str, logger: str) -> str:
    """The start-up line of a resumed launch: the W&B run it logs to only where it logs to W&B (logger.name)."""
    run = f" (W&B run {wandb_run_id})" if logger == "wandb" else ""
    return f"stagecheck: resuming from {checkpoint} after step {step}{run}"
