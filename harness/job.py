"""What a run does differently when it is one job of a sweep. A plain run uses `JobHooks` as it is; the
sweep package (sweep/job.py) overrides it, and train.py picks which. harness/ never imports sweep/."""

import os
from collections.abc import Callable
from pathlib import Path

from omegaconf import DictConfig


class JobHooks:
    """A single run: nothing to skip, nothing to mark, its own W&B run (a W&B agent's group when under one)."""

    @property
    def holds_partition(self) -> bool:
        """Whether `partition_method=balanced` holds the boundaries it picks for +recompute=none whatever the
        recompute options (harness/run_layout.py): a sweep's jobs, compared with each other, do; so does a run
        under a W&B sweep agent."""
        return bool(os.environ.get("WANDB_SWEEP_ID"))

    def finished_earlier(self, run_dir: Path, cfg: DictConfig, rank: int) -> bool:
        """True when this job already finished in `run_dir` and must not run again."""
        return False

    def startup_failed(self, run_dir: Path, message: str, rank: int) -> bool:
        """Bad input was found at start-up. True when the failure was recorded and the caller should return
        (the sweep goes on); False when the run should exit with code 2."""
        return False

    def guard(self, run_dir: Path, rank: int, body: Callable[[], None]) -> Callable[[], None]:
        """`body` (the training), wrapped in what the job does when it ends badly."""
        return body

    def wandb_fields(self, run_dir: Path, group: str | None) -> dict:
        """Fields this job adds to wandb.init (group, name): under a W&B sweep agent, the run joins the group
        `wandb-sweep-<id>` unless logger.group is set."""
        sweep_id = os.environ.get("WANDB_SWEEP_ID")
        return {"group": group or f"wandb-sweep-{sweep_id}"} if sweep_id else {}
