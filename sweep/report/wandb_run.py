"""The sweep's W&B report run (job_type `report`, in the sweep's group): the report table as a W&B Table,
report.png and each traced job's timeline.png as Images."""

import math
from pathlib import Path
from typing import Any

from harness.wandb_logger import init_wandb_run
from sweep.report.loading import Job
from sweep.report.table import rows


def _cell(value: Any) -> Any:
    """W&B Table cells: lists as text, floats rounded."""
    if isinstance(value, list):
        return " / ".join("" if v is None else (f"{v:.4g}" if isinstance(v, float) else str(v)) for v in value)
    if isinstance(value, float):
        return None if math.isnan(value) else float(value)
    return value


def log_to_wandb(sweep_dir: Path, jobs: list[Job], png: Path | None, logger: Any) -> Path | None:
    """One W&B run (job_type `report`) in the sweep's group holding the table and the image. `logger` is
    the sweep's logger config (mapping); nothing is logged for logger=none or mode=disabled. Returns the
    run's local directory."""
    logger = dict(logger or {})
    mode = logger.get("mode", "offline")
    if logger.get("name", "wandb") != "wandb" or mode == "disabled":
        return None
    group = logger.get("group") or sweep_dir.name
    run = init_wandb_run(
        mode,
        logger.get("init_timeout_s", 30.0),
        project=logger.get("project") or "stagecheck",
        entity=logger.get("entity"),
        group=group,
        job_type="report",
        name=f"{group}-report",
        dir=str(sweep_dir),
        tags=list(logger.get("tags") or []) + ["report"],
        config={"sweep_dir": str(sweep_dir)},
    )
    import wandb  # here, not on top: the multirun callback imports this package, and only a report that logs needs it

    columns, table = rows(jobs)
    record = {"report": wandb.Table(columns=columns, data=[[_cell(v) for v in row] for row in table])}
    if png is not None and png.exists():
        record["report_png"] = wandb.Image(str(png), caption="memory per stage against tokens/s")
    for job in jobs:
        if job.timeline is not None:
            record[f"timeline/{job.num}"] = wandb.Image(str(job.timeline), caption=f"job {job.num} ({job.variant})")
    run.log(record)
    run.summary["jobs"] = len(jobs)
    run.summary["failed_jobs"] = sum(j.status == "failed" for j in jobs)
    local = Path(run.dir).parent
    run.finish()
    return local
