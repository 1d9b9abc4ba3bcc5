"""The recompute report of a sweep directory: report.md (a table) and report.png (memory per stage against
throughput, one marker per mode, the planner's prediction beside the measurement), also logged to W&B.

Input: every job directory `<sweep>/<n>/` (Hydra's `${hydra.job.num}`; any subdirectory holding a job's files,
such as a second multirun's `auto_<n>/`) with `summary.json` (a trained job),
`plan.json` (the planner's, where a run wrote one: a dry-run sweep has only that) and `FAILED`
(harness/multirun.py). Predictions come from plan.json when present, else from the plan the trainer put
in summary.json (`planned_activation_bytes_per_stage`). Each mode is compared with the `none` job of the
same shape (model, sequence length, micro-batch size and count, stages, precision, device).

`python report.py SWEEP_DIR` runs this; a multirun writes it at its end.
"""
import json
import math
import os
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import yaml

from harness.multirun import FAILED

MIB = 1024 ** 2
MARKERS = {"none": "o", "full": "s", "selective": "^", "auto": "D"}
"""One marker per recompute mode in report.png (another mode gets "P")."""
SHAPE_KEYS = ("n_layer", "n_head", "n_embd", "vocab_size", "attention", "dropout", "seq_len", "micro_batch_size",
              "micro_batches", "pipeline_stages", "data_parallel_size", "precision", "device")
"""What must match for a job to be compared with a `none` job."""
AXIS_NAMES = {"seq_len": "s", "micro_batch_size": "b", "micro_batches": "m", "pipeline_stages": "stages",
              "n_layer": "L", "n_embd": "h", "attention": "attn", "dropout": "p", "precision": "", "device": ""}


@dataclass
class Job:
    num: str
    path: Path
    summary: Optional[dict] = None
    plan: Optional[dict] = None
    config: dict = field(default_factory=dict)
    failure: Optional[str] = None
    plan_source: str = "summary.json"
    """Where the predictions come from: plan.json, config.yaml (planned by this report) or summary.json."""

    @property
    def status(self) -> str:
        if self.failure is not None:
            return "failed"
        if self.summary is not None:
            return "done"
        if self.plan is not None:
            return "planned"
        return "incomplete"

    @property
    def recompute(self) -> dict:
        source = self.summary or self.plan or {}
        found = source.get("recompute_config") or source.get("recompute") or self.config.get("recompute")
        return found if isinstance(found, dict) else {"mode": found or "none"}

    @property
    def mode(self) -> str:
        return self.recompute.get("mode", "none")

    @property
    def setting(self) -> str:
        """interval (full) or modules (selective)."""
        r = self.recompute
        if self.mode == "full":
            return f"interval {r.get('interval')}"
        if self.mode == "selective":
            return "+".join(r.get("modules") or [])
        if self.mode == "auto":
            return f"budget {r.get('budget_gb')} GiB"
        return "-"

    @property
    def variant(self) -> str:
        r = self.recompute
        if self.mode == "full":
            return f"full/{r.get('interval')}"
        if self.mode == "selective":
            return "selective/" + "+".join(r.get("modules") or [])
        if self.mode == "auto":
            return f"auto/{r.get('budget_gb')}GiB"
        return self.mode

    def shape(self) -> dict:
        model = self.config.get("model") or (self.plan or {}).get("model") or {}
        s = self.summary or self.plan or {}
        out = {k: model.get(k) for k in ("n_layer", "n_head", "n_embd", "vocab_size", "attention", "dropout")}
        for k in ("seq_len", "micro_batch_size", "micro_batches", "pipeline_stages", "data_parallel_size"):
            out[k] = s.get(k)
        target = (self.plan or {}).get("target", {})
        out["precision"] = s.get("precision", target.get("precision"))
        out["device"] = s.get("device", target.get("device"))
        return out

    def key(self) -> tuple:
        shape = self.shape()
        return tuple(shape[k] for k in SHAPE_KEYS)

    # ---- per-stage figures (lists, one entry per stage; None where unknown) ----

    def measured_activation(self) -> Optional[list]:
        return (self.summary or {}).get("activation_bytes_per_stage")

    def measured_peak_activation(self) -> Optional[list]:
        return (self.summary or {}).get("peak_activation_bytes_per_stage")

    def measured_peak_memory(self) -> Optional[list]:
        return (self.summary or {}).get("peak_memory_bytes_per_stage")

    def predicted_activation(self) -> Optional[list]:
        if self.plan:
            return [s.get("activation_bytes_per_microbatch") for s in self.plan["stages"]]
        return (self.summary or {}).get("planned_activation_bytes_per_stage")

    def predicted_peak_activation(self) -> Optional[list]:
        if self.plan:
            return [s.get("peak_activation_bytes") for s in self.plan["stages"]]
        planned = self.predicted_activation()
        in_flight = (self.summary or {}).get("in_flight_microbatches_per_stage")
        if planned and in_flight and len(planned) == len(in_flight):
            return [None if p is None else p * n for p, n in zip(planned, in_flight)]
        return None

    def predicted_peak_memory(self) -> Optional[list]:
        if self.plan:
            return [s.get("predicted_peak_bytes") for s in self.plan["stages"]]
        return None

    @property
    def tokens_per_s(self) -> Optional[float]:
        return (self.summary or {}).get("tokens_per_s")

    @property
    def step_time_s(self) -> Optional[float]:
        return (self.summary or {}).get("step_time_s")


def _read_json(path: Path) -> Optional[dict]:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def plan_from_config(job: Job) -> Optional[dict]:
    """The planner's plan for a trained job without plan.json, from its config.yaml and summary.json (what
    `dry_run=true` would write). None when the planner cannot be run on it."""
    s, cfg = job.summary or {}, job.config
    try:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")  # only DeepSpeed's pure partition code is used
        from model import GPTConfig
        from parallel.auto_layout import layout_for
        from parallel.memory_model import Target
        from parallel.planner import RunShape, plan_run
        from schema.run import GROUP_SCHEMAS

        model = GPTConfig(**cfg["model"])
        recompute = GROUP_SCHEMAS["recompute"][job.mode](**job.recompute)
        shape = RunShape(s["micro_batches"], s["micro_batch_size"], s["data_parallel_size"],
                         cfg["parallel"]["zero_stage"], Target(s["device"], s["precision"]))
        # For auto, the analytic plan: a job planned with recompute.profile=true may have chosen otherwise.
        layout, _ = layout_for(model, recompute, s["pipeline_stages"], cfg["parallel"]["partition_method"],
                               cfg["seed"], shape)
        return plan_run(model, recompute, layout, shape)
    except Exception:  # noqa: BLE001 - an old or partial job: the report shows n/a for the plan
        return None


JOB_FILES = ("summary.json", "plan.json", "config.yaml", FAILED)


def _job_order(path: Path) -> tuple[str, int]:
    """Jobs of one multirun (`0`, `1`, ...) in number order; a second multirun into the same directory
    (`hydra.sweep.subdir=auto_${hydra.job.num}`) after them, in its own order."""
    prefix = path.name.rstrip("0123456789")
    suffix = path.name[len(prefix):]
    return prefix, int(suffix) if suffix else -1


def load_jobs(sweep_dir: Path, plan_missing: bool = True) -> list[Job]:
    """Every job directory of the sweep, in job order. `plan_missing`: plan trained jobs that wrote no
    plan.json from their config (their `plan_source` says which)."""
    jobs = []
    dirs = [p for p in sweep_dir.iterdir()
            if p.is_dir() and (p.name.isdigit() or any((p / name).exists() for name in JOB_FILES))]
    for path in sorted(dirs, key=_job_order):
        job = Job(path.name, path, _read_json(path / "summary.json"), _read_json(path / "plan.json"))
        try:
            job.config = yaml.safe_load((path / "config.yaml").read_text()) or {}
        except (OSError, yaml.YAMLError):
            pass
        if (path / FAILED).exists():
            job.failure = (path / FAILED).read_text().strip() or "failed"
        if job.plan is not None:
            job.plan_source = "plan.json"
        elif plan_missing and job.summary is not None:
            job.plan = plan_from_config(job)
            job.plan_source = "config.yaml" if job.plan is not None else "summary.json"
        jobs.append(job)
    return jobs


# ---- numbers ---------------------------------------------------------------------------------------------

def _ratio(a: Optional[float], b: Optional[float]) -> Optional[float]:
    if a is None or b is None or b == 0:
        return None
    return a / b


def baselines(jobs: list[Job]) -> dict[tuple, Job]:
    """The `none` job of each shape (the first, when a shape has several)."""
    out: dict[tuple, Job] = {}
    for job in jobs:
        if job.status == "done" and job.mode == "none":
            out.setdefault(job.key(), job)
    return out


def varying_axes(jobs: list[Job]) -> list[str]:
    """Shape entries that differ between the jobs (the sweep's axes besides the recompute mode)."""
    shapes = [j.shape() for j in jobs if j.status in ("done", "planned")]
    return [k for k in AXIS_NAMES if len({repr(s.get(k)) for s in shapes}) > 1]


def label(job: Job, axes: list[str]) -> str:
    shape = job.shape()
    parts = [job.variant] + [f"{AXIS_NAMES[k]}={shape[k]}" if AXIS_NAMES[k] else str(shape[k]) for k in axes]
    return " ".join(parts)


def rows(jobs: list[Job]) -> tuple[list[str], list[list[Any]]]:
    """The report table as plain values (bytes, ratios), one row per job: for W&B and the markdown."""
    base = baselines(jobs)
    axes = varying_axes(jobs)
    columns = ["job", "status", "mode", "interval/modules", *axes, "tokens_per_s", "time_overhead_vs_none",
               "activation_bytes_per_microbatch_per_stage", "predicted_activation_bytes_per_stage",
               "predicted_vs_measured_max_error", "peak_activation_bytes_per_stage", "saving_vs_none_per_stage",
               "peak_memory_bytes_per_stage", "predicted_peak_bytes_per_stage"]
    table = []
    for job in jobs:
        none = base.get(job.key())
        shape = job.shape()
        overhead = None
        if none is not None and job.step_time_s and none.step_time_s:
            overhead = job.step_time_s / none.step_time_s - 1.0
        measured, predicted = job.measured_activation(), job.predicted_activation()
        error = None
        if measured and predicted and len(measured) == len(predicted):
            errors = [abs(m / p - 1.0) for m, p in zip(measured, predicted) if m is not None and p]
            error = max(errors) if errors else None
        peak = job.measured_peak_activation()
        saving = None
        if none is not None and peak and none.measured_peak_activation():
            saving = [None if a is None or b in (None, 0) else 1.0 - a / b
                      for a, b in zip(peak, none.measured_peak_activation())]
        table.append([job.num, job.status, job.mode, job.setting, *[shape[k] for k in axes], job.tokens_per_s,
                      overhead, measured, predicted, error, peak, saving, job.measured_peak_memory(),
                      job.predicted_peak_memory()])
    return columns, table


# ---- markdown --------------------------------------------------------------------------------------------

def _mib(values: Optional[list]) -> str:
    if not values:
        return "n/a"

    def one(v: Optional[float]) -> str:
        if v is None:
            return "n/a"
        m = v / MIB
        return f"{m:,.0f}" if m >= 100 else f"{m:.3g}"

    return " / ".join(one(v) for v in values)


def _pct(value: Optional[float], signed: bool = True) -> str:
    if value is None:
        return "n/a"
    return f"{value * 100:+.1f}%" if signed else f"{value * 100:.1f}%"


def _pcts(values: Optional[list]) -> str:
    if not values:
        return "n/a"
    return " / ".join(_pct(v, signed=False) for v in values)


def render_markdown(sweep_dir: Path, jobs: list[Job]) -> str:
    columns, table = rows(jobs)
    axes = varying_axes(jobs)
    n_axes = len(axes)
    done = [j for j in jobs if j.status == "done"]
    kinds = sorted({(j.summary or {}).get("peak_memory_kind", "?") for j in done})
    lines = [f"# Recompute report: {sweep_dir.name}", "",
             f"{len(jobs)} jobs in `{sweep_dir}`: {sum(j.status == 'done' for j in jobs)} done, "
             f"{sum(j.status == 'failed' for j in jobs)} failed, {sum(j.status == 'planned' for j in jobs)} "
             f"planned only (dry run), {sum(j.status == 'incomplete' for j in jobs)} incomplete.", ""]
    if done:
        s = done[0].summary
        model = done[0].config.get("model", {})
        lines += [f"Shape: model {model.get('n_layer')} layers, h={model.get('n_embd')}, {model.get('n_head')} heads, "
                  f"attention {model.get('attention')}, dropout {model.get('dropout')}; {s.get('pipeline_stages')} "
                  f"stages x {s.get('data_parallel_size')} data-parallel; {s.get('device')} {s.get('precision')}"
                  + (f"; sweep axes: {', '.join(axes)}" if axes else "") + ".", ""]
    lines += [
        "Per-stage values are listed stage 0 / stage 1 / ...; memory in MiB (2^20 bytes). *act/mb*: bytes kept "
        "for backward per micro-batch (measured with saved-tensor hooks on one step); *pred.*: the planner's; "
        "*error*: largest |measured/predicted - 1| over stages. *peak act*: act/mb x micro-batches in flight "
        "under 1F1B; *saving*: 1 - peak act / peak act of `none` at the same shape; *overhead*: step time / "
        f"step time of `none` - 1. *peak mem*: measured ({', '.join(kinds) or 'n/a'}; on CPU the resident set "
        "includes the interpreter and libraries) and the planner's prediction (states + activations + buffers).",
        "",
    ]
    sources = {}
    for job in done:
        sources[job.plan_source] = sources.get(job.plan_source, 0) + 1
    if sources:
        names = {"plan.json": "the job's plan.json", "config.yaml": "planned here from the job's config.yaml",
                 "summary.json": "the plan in summary.json (no peak-memory prediction)"}
        lines += ["Predictions: " + "; ".join(f"{names[k]} ({n} jobs)" for k, n in sorted(sources.items())) + ".", ""]
    header = ["job", "mode", "interval/modules", *axes, "tokens/s", "overhead", "act/mb", "act/mb pred.", "error",
              "peak act", "saving", "peak mem", "peak mem pred."]
    lines.append("| " + " | ".join(header) + " |")
    lines.append("|" + "|".join("---:" if i >= 3 + n_axes or i == 0 else "---" for i in range(len(header))) + "|")
    for job, row in zip(jobs, table):
        if job.status == "failed":
            continue
        (num, _, mode, setting, *axis_values, tps, overhead, act, pred, error, peak, saving, mem, pred_mem) = row
        cells = [num, mode, setting, *[str(v) for v in axis_values],
                 "n/a" if tps is None else f"{tps:,.0f}", _pct(overhead), _mib(act), _mib(pred),
                 _pct(error, signed=False), _mib(peak), _pcts(saving), _mib(mem), _mib(pred_mem)]
        lines.append("| " + " | ".join(cells) + " |")
    failed = [j for j in jobs if j.status == "failed"]
    if failed:
        lines += ["", "## Failed jobs", ""]
        for job in failed:
            first = job.failure.splitlines()
            lines.append(f"- job {job.num} ({job.variant}): {first[0]}" + (f" (+{len(first) - 1} more lines in "
                                                                          f"`{job.num}/{FAILED}`)" if len(first) > 1 else ""))
    errors = [row[columns.index("predicted_vs_measured_max_error")] for row in table]
    errors = [e for e in errors if e is not None]
    if errors:
        lines += ["", f"Predicted vs measured activation bytes per micro-batch: largest error "
                      f"{max(errors) * 100:.2f}% over {len(errors)} jobs (median {statistics.median(errors) * 100:.2f}%)."]
    lines += ["", "![memory per stage against tokens/s](report.png)", ""]
    return "\n".join(lines)


# ---- figure ----------------------------------------------------------------------------------------------

def render_png(jobs: list[Job], path: Path) -> bool:
    """Memory per stage (MiB) against tokens/s: filled = measured, hollow = predicted; returns False when no
    job has both a throughput and a memory figure."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    done = [j for j in jobs if j.status == "done" and j.tokens_per_s]
    if not done:
        return False
    stages = max(len(j.measured_peak_activation() or j.measured_peak_memory() or []) for j in done)
    if stages == 0:
        return False
    axes_keys = varying_axes(jobs)
    order = list(MARKERS)
    variants = sorted({j.variant for j in done},
                      key=lambda v: (order.index(v.split("/")[0]) if v.split("/")[0] in order else len(order), v))
    colors = {v: plt.get_cmap("tab10")(i % 10) for i, v in enumerate(variants)}
    panels = [("peak activation memory per stage (MiB)", Job.measured_peak_activation, Job.predicted_peak_activation),
              ("peak memory per stage (MiB)", Job.measured_peak_memory, Job.predicted_peak_memory)]
    fig, grid = plt.subplots(len(panels), stages, figsize=(5.2 * stages + 3.4, 4.2 * len(panels)), squeeze=False,
                             layout="constrained")
    xs = [j.tokens_per_s for j in done]
    span = (max(xs) - min(xs)) or max(xs) * 0.1
    for row, (title, measured_of, predicted_of) in enumerate(panels):
        for stage in range(stages):
            ax = grid[row][stage]
            for job in done:
                x = job.tokens_per_s
                color, marker = colors[job.variant], MARKERS.get(job.mode, "P")
                m = (measured_of(job) or [None] * stages)[stage] if stage < len(measured_of(job) or []) else None
                p = (predicted_of(job) or [None] * stages)[stage] if stage < len(predicted_of(job) or []) else None
                dx = span * 0.012  # prediction just beside the measurement
                if m is not None:
                    ax.plot(x - dx, m / MIB, marker=marker, color=color, markersize=8, linestyle="none")
                if p is not None:
                    ax.plot(x + dx, p / MIB, marker=marker, markerfacecolor="none", markeredgecolor=color,
                            markersize=9, markeredgewidth=1.5, linestyle="none")
                if m is not None and p is not None:
                    ax.plot([x - dx, x + dx], [m / MIB, p / MIB], color=color, linewidth=0.8, alpha=0.6)
                if axes_keys and m is not None:
                    tag = " ".join(f"{AXIS_NAMES[k]}={job.shape()[k]}" if AXIS_NAMES[k] else str(job.shape()[k])
                                   for k in axes_keys)
                    ax.annotate(tag, (x, m / MIB), textcoords="offset points", xytext=(6, 4), fontsize=7,
                                color=color)
            ax.set_title(f"stage {stage}: {title.split(' per stage')[0]}", fontsize=10)
            ax.set_xlabel("throughput (tokens/s)")
            ax.set_ylabel(title.replace(" per stage", ""))
            ax.grid(True, alpha=0.3)
            top = max(ax.get_ylim()[1], 1e-3) * 1.12  # room above the highest marker
            ax.set_ylim(-0.025 * top, top)  # and below the lowest: nothing clipped at 0
            low, high = min(xs) - span * 0.15, max(xs) + span * 0.15
            ax.set_xlim(max(0.0, low), high)
    if any((j.summary or {}).get("peak_memory_kind") == "cpu_max_rss" for j in done):
        for stage in range(stages):
            grid[1][stage].set_ylabel("peak memory (MiB; CPU: resident set)")
    handles = [Line2D([], [], marker=MARKERS.get(v.split("/")[0], "P"), color=colors[v], linestyle="none",
                      markersize=8, label=v) for v in variants]
    handles += [Line2D([], [], marker="o", color="0.3", linestyle="none", markersize=8, label="measured (filled)"),
                Line2D([], [], marker="o", markerfacecolor="none", markeredgecolor="0.3", linestyle="none",
                       markersize=9, label="predicted (hollow)")]
    # "outside": constrained layout gives the legend its own column, so it never covers a panel.
    fig.legend(handles=handles, loc="outside right center", fontsize=9, frameon=True, title="mode / setting")
    fig.suptitle("Recompute: memory per stage against throughput", fontsize=12)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


# ---- W&B -------------------------------------------------------------------------------------------------

def _cell(value: Any) -> Any:
    """W&B Table cells: lists as text, floats rounded."""
    if isinstance(value, list):
        return " / ".join("" if v is None else (f"{v:.4g}" if isinstance(v, float) else str(v)) for v in value)
    if isinstance(value, float):
        return None if math.isnan(value) else float(value)
    return value


def log_to_wandb(sweep_dir: Path, jobs: list[Job], png: Optional[Path], logger: Any) -> Optional[Path]:
    """One W&B run (job_type `report`) in the sweep's group holding the table and the image. `logger` is
    the sweep's logger config (mapping); nothing is logged for logger=none or mode=disabled. Returns the
    run's local directory."""
    logger = dict(logger or {})
    if logger.get("name", "wandb") != "wandb" or logger.get("mode", "offline") == "disabled":
        return None
    os.environ.setdefault("WANDB_SILENT", "true")
    import wandb

    group = logger.get("group") or sweep_dir.name
    columns, table = rows(jobs)
    mode = logger.get("mode", "offline")
    kwargs = dict(project=logger.get("project") or "stagecheck", entity=logger.get("entity"), group=group,
                  job_type="report", name=f"{group}-report", dir=str(sweep_dir),
                  tags=list(logger.get("tags") or []) + ["report"], config={"sweep_dir": str(sweep_dir)})
    try:
        run = wandb.init(mode=mode, **kwargs)
    except Exception:  # noqa: BLE001 - online init failed: the report still goes to disk, and offline
        if mode != "online":
            raise
        run = wandb.init(mode="offline", **kwargs)
    record = {"report": wandb.Table(columns=columns, data=[[_cell(v) for v in row] for row in table])}
    if png is not None and png.exists():
        record["report_png"] = wandb.Image(str(png), caption="memory per stage against tokens/s")
    run.log(record)
    run.summary["jobs"] = len(jobs)
    run.summary["failed_jobs"] = sum(j.status == "failed" for j in jobs)
    local = Path(run.dir).parent
    run.finish()
    return local


def sweep_logger(sweep_dir: Path) -> Optional[dict]:
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
    markdown = render_markdown(sweep_dir, jobs)
    if not drawn:
        markdown = markdown.replace("![memory per stage against tokens/s](report.png)",
                                    "(no figure: no job has both a throughput and a memory figure)")
    (sweep_dir / "report.md").write_text(markdown)
    if logger is not None and not isinstance(logger, dict):
        from omegaconf import OmegaConf

        logger = OmegaConf.to_container(logger, resolve=False)
    wandb_dir = None
    if wandb:
        wandb_dir = log_to_wandb(sweep_dir, jobs, png if drawn else None,
                                 logger if logger is not None else sweep_logger(sweep_dir))
    print(f"stagecheck: sweep report: {sweep_dir / 'report.md'}" + (f", {png}" if drawn else "")
          + (f" (W&B: {wandb_dir})" if wandb_dir else ""), flush=True)
    return {"markdown": sweep_dir / "report.md", "png": png if drawn else None, "jobs": jobs, "wandb_dir": wandb_dir}
