"""The recompute report of a sweep directory: report.md (a table) and report.png (memory per stage against
throughput, one marker per mode, the planner's prediction beside the measurement), also logged to W&B.

Input: every job directory `<sweep>/<n>/` (Hydra's `${hydra.job.num}`; any subdirectory holding a job's files,
such as a second multirun's `auto_<n>/`) with `summary.json` (a trained job),
`plan.json` (the planner's, where a run wrote one: a dry-run sweep has only that) and `FAILED`
(sweep/job.py). Predictions come from plan.json when present, else from the plan the trainer put
in summary.json (`planned_activation_bytes_per_stage`). Each mode is compared with the `none` job of the
same shape (model, sequence length, micro-batch size and count, stages, precision, device).

`loading` reads the job directories, `table` computes the numbers, `markdown`, `figure` and `wandb_run` show
them. `python report.py SWEEP_DIR` runs this; a multirun writes it at its end (sweep/callback.py).
"""

from pathlib import Path
from typing import Any

import yaml
from omegaconf import OmegaConf

from sweep.report.figure import render_png
from sweep.report.loading import load_jobs
from sweep.report.markdown import render_markdown
from sweep.report.wandb_run import log_to_wandb


def sweep_logger(sweep_dir: Path) -> dict | None:
    """The logger config of the sweep, from the multirun.yaml Hydra writes into the sweep directory."""
    try:
        config = yaml.safe_load((sweep_dir / "multirun.yaml").read_text()) or {}
    except (OSError, yaml.YAMLError):
        return None
    logger = config.get("logger")
    return logger if isinstance(logger, dict) else None


def write_report(sweep_dir: Path, logger: Any = None, wandb: bool = True) -> dict:
    """report.md and report.png in `sweep_dir`, and (with `wandb`) the W&B report run. `logger`: the sweep's
    logger config; None reads it from multirun.yaml (and falls back to W&B offline)."""
    sweep_dir = Path(sweep_dir)
    jobs = load_jobs(sweep_dir)
    if not jobs:
        raise ValueError(f"{sweep_dir} holds no job directories (0/, 1/, ...): is it a sweep directory?")
    png = sweep_dir / "report.png"
    drawn = render_png(jobs, png)
    (sweep_dir / "report.md").write_text(render_markdown(sweep_dir, jobs, figure=drawn))
    if logger is not None and not isinstance(logger, dict):  # the multirun callback's DictConfig
        logger = OmegaConf.to_container(logger, resolve=False)
    wandb_dir = None
    if wandb:
        wandb_dir = log_to_wandb(
            sweep_dir, jobs, png if drawn else None, logger if logger is not None else sweep_logger(sweep_dir)
        )
    print(
        f"stagecheck: sweep report: {sweep_dir / 'report.md'}"
        + (f", {png}" if drawn else "")
        + (f" (W&B: {wandb_dir})" if wandb_dir else ""),
        flush=True,
    )
    return {"markdown": sweep_dir / "report.md", "png": png if drawn else None, "jobs": jobs, "wandb_dir": wandb_dir}
