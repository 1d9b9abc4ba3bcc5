"""Weights & Biases logging that never blocks or slows training.

Offline by default: records go to <run dir>/wandb/offline-run-*/run-<id>.wandb and `wandb sync`
uploads them later. Online runs that cannot reach the server within `init_timeout_s` fall back to
offline; after init, wandb.log hands records to a background service and returns at once.
"""

import os
import sys
from pathlib import Path

from harness.job import JobHooks
from schema.logger import WandbLoggerConfig


def init_wandb_run(mode: str, timeout_s: float, **kwargs):
    """`wandb.init`, falling back to offline when an online init fails: a network or server failure must
    never stop training, nor a sweep's report."""
    os.environ.setdefault("WANDB_SILENT", "true")
    import wandb  # only the process that logs pays for the import

    try:
        return wandb.init(mode=mode, settings=wandb.Settings(init_timeout=timeout_s), **kwargs)
    except Exception as error:  # noqa: BLE001 - any failure of the online service
        if mode != "online":
            raise
        print(f"stagecheck: W&B online init failed ({error}); logging offline instead", file=sys.stderr)
        return wandb.init(mode="offline", **kwargs)


class WandbLogger:
    """The W&B run of the rank that holds the loss. A failure of W&B's service under the run (SLURM's `scancel
    --signal` reaches the service with the ranks, and it dies of SIGUSR1) is said once and ends the W&B record; the
    run goes on: logging never fails training."""

    def __init__(self, run):
        self.run = run
        self.lost: str | None = None
        """Why W&B stopped taking records, or None."""

    def _send(self, what: str, call) -> None:
        if self.lost is not None:
            return
        try:
            call()
        except Exception as error:  # noqa: BLE001 - whatever W&B's client raises when its service is gone
            self.lost = f"{type(error).__name__}: {error}"
            print(
                f"stagecheck: warning: W&B {what} failed ({self.lost}): the run goes on, its W&B record ends here",
                file=sys.stderr,
                flush=True,
            )

    def log(self, record: dict, step: int) -> None:
        self._send("log", lambda: self.run.log(record, step=step))

    def update_summary(self, values: dict) -> None:
        self._send("summary", lambda: self.run.summary.update(values))

    def save_files(self, paths: list[Path], base: Path) -> None:
        """Attach files to the run under their path below `base` (offline: copied into the run's files/ at
        once, uploaded by `wandb sync`)."""
        for path in paths:
            self._send("save", lambda path=path: self.run.save(str(path), base_path=str(base), policy="now"))

    def mark_preempting(self) -> None:
        self._send("mark_preempting", self.run.mark_preempting)

    def finish(self, exit_code: int = 0) -> None:
        self._send("finish", lambda: self.run.finish(exit_code=exit_code))


def open_wandb(
    config,
    run_dir: Path,
    run_config: dict,
    job_type: str,
    extra_tags: list[str],
    job: JobHooks,
    run_id: str | None = None,
) -> WandbLogger | None:
    """None for logger=none or logger.mode=disabled. `job` adds its fields (a sweep job's group and name);
    `run_id`: the W&B run a resumed run continues."""
    if not isinstance(config, WandbLoggerConfig) or config.mode == "disabled":
        return None
    kwargs = dict(
        project=config.project,
        entity=config.entity,
        dir=str(run_dir),
        config=run_config,
        group=config.group,
        job_type=job_type,
        tags=list(config.tags) + extra_tags,
        name=run_dir.name,
    )
    kwargs.update(job.wandb_fields(run_dir, config.group))
    if run_id is not None:
        # A resumed run continues the same W&B run. Offline, wandb writes a new offline-run-* directory
        # per launch (its _step restarting at 0): records carry explicit steps, `wandb sync` each piece.
        kwargs.update(id=run_id, resume="allow")
    return WandbLogger(init_wandb_run(config.mode, config.init_timeout_s, **kwargs))
