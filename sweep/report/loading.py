"""A sweep's job directories as `Job`s: each job's summary.json, plan.json, config.yaml and FAILED, read back in
job order, with the planner's plan for trained jobs that wrote no plan.json.

Per-stage figures are lists, one entry per stage, None where unknown; bytes throughout.
"""

import json
from dataclasses import dataclass, field, fields, replace
from pathlib import Path

import yaml

from model import BLOCK_CLASSES, GPTConfig
from parallel.planning.config import AutoRecompute
from parallel.planning.layout import PipelineLayout, build_layout
from parallel.planning.plan_record import RunPlan
from parallel.planning.run_plan import plan_run
from parallel.planning.shapes import RunShape, Target, Topology
from parallel.planning.stage_plan import StagePlan
from schema.run import GROUP_SCHEMAS
from sweep.job import FAILED

JOB_FILES = ("summary.json", "plan.json", "config.yaml", FAILED)
MODEL_KEYS = ("n_layer", "n_head", "n_embd", "vocab_size", "attention", "dropout")
RUN_KEYS = ("seq_len", "micro_batch_size", "micro_batches", "pipeline_stages", "data_parallel_size")


@dataclass
class Job:
    num: str
    path: Path
    summary: dict | None = None
    plan: RunPlan | None = None
    config: dict = field(default_factory=dict)
    failure: str | None = None
    plan_source: str = "summary.json"
    """Where the predictions come from: plan.json, config.yaml (planned by this report) or summary.json."""
    sweep_partition_method: str | None = None
    """The sweep's parallel.partition_method (multirun.yaml), for a job without config.yaml (a dry run writes none)."""

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
        found = None
        if self.summary:
            found = self.summary.get("recompute_config") or self.summary.get("recompute")
        elif self.plan is not None:
            found = self.plan.recompute
        found = found or self.config.get("recompute")
        return found if isinstance(found, dict) else {"mode": found or "none"}

    @property
    def mode(self) -> str:
        return self.recompute.get("mode", "none")

    @property
    def setting(self) -> str:
        """interval (full) or modules (selective)."""
        r = self.recompute
        if self.mode == "full":
            return f"interval {r.get('interval')}" + (", nested" if r.get("nested") else "")
        if self.mode == "selective":
            return "+".join(r.get("modules") or [])
        if self.mode == "auto":
            return f"budget {r.get('budget_gb')} GiB"
        return "-"

    @property
    def variant(self) -> str:
        r = self.recompute
        if self.mode == "full":
            return f"full/{r.get('interval')}" + ("/nested" if r.get("nested") else "")
        if self.mode == "selective":
            return "selective/" + "+".join(r.get("modules") or [])
        if self.mode == "auto":
            return f"auto/{r.get('budget_gb')}GiB"
        return self.mode

    def shape(self) -> dict:
        """The model, batch, pipeline, precision and device of the job: the summary's where it has one, else the
        plan's."""
        plan = self.plan
        model = self.config.get("model") or (plan.model if plan is not None else None) or {}
        if self.summary:
            run = self.summary
        else:
            run = {k: getattr(plan, k) for k in RUN_KEYS} if plan is not None else {}
        out = {k: model.get(k) for k in MODEL_KEYS}
        out.update({k: run.get(k) for k in RUN_KEYS})
        out["precision"] = run.get("precision", plan.target.precision if plan is not None else None)
        out["device"] = run.get("device", plan.target.device if plan is not None else None)
        return out

    @property
    def round(self) -> int:
        """Which repetition of its setting the job is (the `round` option; 0 for jobs recorded before it)."""
        return int(self.config.get("round", 0) or 0)

    def partition(self) -> tuple | None:
        """Each stage's (first layer, one past the last): the trained layout's (summary.json), else the plan's."""
        layout = (self.summary or {}).get("layout")
        if layout:
            return tuple(tuple(stage.get("layers", ())) for stage in layout)
        if self.plan is not None:
            return tuple(tuple(s.layers) for s in self.plan.stages)
        return None

    def trained_plan(self) -> tuple | None:
        """What each stage recomputed (its blocks' choices and segments), as the run recorded it; None when not
        recorded. Two jobs with equal partitions and trained plans ran the same computation."""
        layout = (self.summary or {}).get("layout")
        if not layout:
            return None
        return tuple((tuple(s.get("choices", ())), tuple(map(tuple, s.get("segments", ())))) for s in layout)

    @property
    def predicted_tokens_per_step(self) -> int | None:
        shape = self.shape()
        keys = ("micro_batches", "micro_batch_size", "seq_len", "data_parallel_size")
        if any(shape.get(k) is None for k in keys):
            return None
        return shape["micro_batches"] * shape["micro_batch_size"] * shape["seq_len"] * shape["data_parallel_size"]

    def measured_activation(self) -> list | None:
        return (self.summary or {}).get("activation_bytes_per_stage")

    def measured_peak_activation(self) -> list | None:
        return (self.summary or {}).get("peak_activation_bytes_per_stage")

    def measured_peak_memory(self) -> list | None:
        return (self.summary or {}).get("peak_memory_bytes_per_stage")

    def predicted_activation(self) -> list | None:
        if self.plan is not None:
            return [s.activation_bytes_per_microbatch for s in self.plan.stages]
        return (self.summary or {}).get("planned_activation_bytes_per_stage")

    def predicted_peak_activation(self) -> list | None:
        if self.plan is not None:
            return [s.peak_activation_bytes for s in self.plan.stages]
        planned = self.predicted_activation()
        in_flight = (self.summary or {}).get("in_flight_microbatches_per_stage")
        if planned and in_flight and len(planned) == len(in_flight):
            return [None if p is None else p * n for p, n in zip(planned, in_flight)]
        return None

    def predicted_peak_memory(self) -> list | None:
        if self.plan is not None:
            return [s.predicted_peak_bytes for s in self.plan.stages]
        return None

    @property
    def val_loss(self) -> float | None:
        """The last held-out loss (train.eval_every); None for a job trained without evaluation."""
        return (self.summary or {}).get("val_loss")

    @property
    def tokens_per_s(self) -> float | None:
        return (self.summary or {}).get("tokens_per_s")

    @property
    def step_time_s(self) -> float | None:
        return (self.summary or {}).get("step_time_s")

    @property
    def predicted_step_time_s(self) -> float | None:
        """The step-time simulator's prediction for the job's plan, where the run recorded one: its summary.json's,
        else its own plan.json's (a dry-run job has only that)."""
        recorded = (self.summary or {}).get("predicted_step_time_s")
        if recorded is None and self.plan is not None and self.plan_source == "plan.json":
            return self.plan.predicted_step_time_s
        return recorded

    @property
    def predicted_tokens_per_s(self) -> float | None:
        """Tokens per predicted step (predicted_step_time_s): where report.png draws the job's predictions."""
        step, tokens = self.predicted_step_time_s, self.predicted_tokens_per_step
        if not step or not tokens:
            return None
        return tokens / step

    def blocks_per_stage(self) -> list[int] | None:
        """Transformer blocks on each stage: the plan's, else the trained layout's (summary.json)."""
        if self.plan is not None:
            return [s.blocks for s in self.plan.stages]
        layout = (self.summary or {}).get("layout")
        return [len(stage.get("choices", [])) for stage in layout] if layout else None

    @property
    def partition_method(self) -> str | None:
        return (self.config.get("parallel") or {}).get("partition_method", self.sweep_partition_method)

    def predicted_peak_tensors(self) -> list | None:
        """The planner's most live tensor bytes per stage, what measured_peak_tensors measures: the trained run's
        (summary.json), else the plan's."""
        s = self.summary or {}
        # Summaries written before the planner had one peak gave the one the allocator measures this key.
        recorded = s.get("predicted_peak_tensor_bytes_per_stage", s.get("predicted_peak_bytes_per_stage"))
        return recorded or self.predicted_peak_memory()

    def measured_peak_tensors(self) -> list | None:
        """The most live tensor bytes per stage on train.measure_step (the allocator's view, what the planner
        predicts); on CUDA without it, the allocator's peak. Never the CPU resident set: it holds the interpreter
        and its libraries, which no plan predicts."""
        s = self.summary or {}
        if s.get("measured_peak_tensor_bytes_per_stage"):
            return s["measured_peak_tensor_bytes_per_stage"]
        return s.get("peak_memory_bytes_per_stage") if s.get("peak_memory_kind") == "cuda_max_allocated" else None

    @property
    def bubble_fraction_per_stage(self) -> list | None:
        """Idle share of the traced step per stage (train.trace_step); None when no step was traced."""
        return (self.summary or {}).get("bubble_fraction_per_stage")

    @property
    def timeline(self) -> Path | None:
        """The traced step's timeline.png, when the job wrote one."""
        path = self.path / "timeline.png"
        return path if path.is_file() else None


def _read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _read_plan(path: Path) -> RunPlan | None:
    """plan.json as a RunPlan; None where it is missing, unreadable or not a plan."""
    data = _read_json(path)
    if data is None:
        return None
    try:
        return RunPlan.from_json(data)
    except (KeyError, TypeError, AttributeError, ValueError):  # another layout, or not an object
        return None


def plan_from_config(job: Job) -> RunPlan | None:
    """The planner's plan for a trained job without plan.json, from its config.yaml and summary.json (what
    `dry_run=true` would write). None when the planner cannot be run on it."""
    s, cfg = job.summary or {}, job.config
    try:
        model = GPTConfig(**cfg["model"])
        schema = GROUP_SCHEMAS["recompute"][job.mode]
        known = {f.name for f in fields(schema)}  # a job recorded before an option went (recompute.profile) still plans
        recompute = schema(**{k: v for k, v in job.recompute.items() if k in known})
        run = RunShape(
            Topology(s["pipeline_stages"], s["data_parallel_size"]),
            Target(s["device"], s["precision"]),
            s["micro_batches"],
            s["micro_batch_size"],
            cfg["parallel"]["zero_stage"],
        )
        # For auto, the analytic plan (no costs): a job planned with recompute.profile=true may have chosen otherwise.
        layout = build_layout(model, recompute, run, cfg["parallel"]["partition_method"], cfg["seed"])
        recorded = _recorded_plans(job, layout) if isinstance(recompute, AutoRecompute) else None
        if recorded is not None and recorded != layout.plans:
            layout = replace(layout, plans=recorded, budgets=None, schedule="1f1b")
        return plan_run(model, recompute, layout, run)
    except Exception:  # noqa: BLE001 - an old or partial job: the report shows n/a for the plan
        return None


def _recorded_plans(job: Job, layout: PipelineLayout) -> list[StagePlan] | None:
    """The plans a trained auto job ran, from its summary.json's layout (today's planner may choose otherwise at the
    same budget), under 1F1B (the summary records no schedule); None where they cannot be rebuilt on the planner's
    stages: another partition, full recompute without its recorded segments, or per-micro-batch plans."""
    record = (job.summary or {}).get("layout")
    if not record or len(record) != len(layout.stages) or job.recompute.get("per_micro_batch"):
        return None
    plans = []
    for entry, stage in zip(record, layout.stages):
        blocks = [
            local for local, flat in enumerate(stage.layers) if layout.recipes[flat].module_class in BLOCK_CLASSES
        ]
        choices = entry.get("choices", [])
        if list(entry.get("layers", [])) != [stage.start, stage.stop] or len(choices) != len(blocks):
            return None
        if ("full" in choices or "nested" in choices) and "segments" not in entry:
            return None
        selective = {
            local: tuple(choice.split(":", 1)[1].split("+"))
            for local, choice in zip(blocks, choices)
            if choice.startswith("selective:")
        }
        segments = tuple((a - stage.start, b - stage.start) for a, b in entry.get("segments", []))
        plans.append(StagePlan(segments=segments, nested="nested" in choices, selective=selective))
    return plans


def _job_order(path: Path) -> tuple[str, int]:
    """Jobs of one multirun (`0`, `1`, ...) in number order; a second multirun into the same directory
    (`hydra.sweep.subdir=auto_${hydra.job.num}`) after them, in its own order."""
    prefix = path.name.rstrip("0123456789")
    suffix = path.name[len(prefix) :]
    return prefix, int(suffix) if suffix else -1


def load_jobs(sweep_dir: Path, plan_missing: bool = True) -> list[Job]:
    """Every job directory of the sweep, in job order. `plan_missing`: plan trained jobs that wrote no
    plan.json from their config (their `plan_source` says which)."""
    jobs = []
    try:
        sweep_config = yaml.safe_load((sweep_dir / "multirun.yaml").read_text()) or {}
    except (OSError, yaml.YAMLError):
        sweep_config = {}
    sweep_partition = ((sweep_config if isinstance(sweep_config, dict) else {}).get("parallel") or {}).get(
        "partition_method"
    )
    dirs = [
        p
        for p in sweep_dir.iterdir()
        if p.is_dir() and (p.name.isdigit() or any((p / name).exists() for name in JOB_FILES))
    ]
    for path in sorted(dirs, key=_job_order):
        job = Job(path.name, path, _read_json(path / "summary.json"), _read_plan(path / "plan.json"))
        job.sweep_partition_method = sweep_partition
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
