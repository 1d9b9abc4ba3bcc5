"""The report's numbers: which jobs share a shape, each shape's `none` job, the sweep's axes, and the table
(one row per job, plain values: bytes, ratios) that the markdown, the figure and W&B show."""

from typing import Any

from sweep.report.loading import Job

SHAPE_KEYS = (
    "n_layer",
    "n_head",
    "n_embd",
    "vocab_size",
    "attention",
    "dropout",
    "seq_len",
    "micro_batch_size",
    "micro_batches",
    "pipeline_stages",
    "data_parallel_size",
    "precision",
    "device",
)
"""What must match for a job to be compared with a `none` job."""
AXIS_NAMES = {
    "seq_len": "s",
    "micro_batch_size": "b",
    "micro_batches": "m",
    "pipeline_stages": "stages",
    "n_layer": "L",
    "n_embd": "h",
    "attention": "attn",
    "dropout": "p",
    "precision": "",
    "device": "",
}
"""Shape entries that can be a sweep axis, with their short names in labels ("": the value alone)."""


def shape_key(job: Job) -> tuple:
    shape = job.shape()
    return tuple(shape[k] for k in SHAPE_KEYS)


def baselines(jobs: list[Job]) -> dict[tuple, Job]:
    """The `none` job of each shape and round (the first, when several), and of each shape alone (its first round):
    a job is compared with the `none` of its own round where there is one (the rounds ran one after another, so a
    machine's load drifts between them, not within)."""
    out: dict[tuple, Job] = {}
    for job in jobs:
        if job.status == "done" and job.mode == "none":
            out.setdefault((shape_key(job), job.round), job)
            out.setdefault((shape_key(job), None), job)
    return out


def baseline_of(job: Job, base: dict[tuple, Job]) -> Job | None:
    return base.get((shape_key(job), job.round)) or base.get((shape_key(job), None))


def same_plan(job: Job, none: Job | None) -> bool:
    """Whether the job trained exactly what its `none` job did (an `auto` budget that needed no recompute): then
    any difference between them is noise."""
    if none is None or job is none or job.trained_plan() is None:
        return False
    return job.partition() == none.partition() and job.trained_plan() == none.trained_plan()


def varying_axes(jobs: list[Job]) -> list[str]:
    """Shape entries that differ between the jobs (the sweep's axes besides the recompute mode)."""
    shapes = [j.shape() for j in jobs if j.status in ("done", "planned")]
    return [k for k in AXIS_NAMES if len({repr(s.get(k)) for s in shapes}) > 1]


def axis_label(job: Job, axes: list[str]) -> str:
    """The job's values on `axes`, e.g. `s=256 b=2 fp32`."""
    shape = job.shape()
    return " ".join(f"{AXIS_NAMES[k]}={shape[k]}" if AXIS_NAMES[k] else str(shape[k]) for k in axes)


def partition_varies(jobs: list[Job]) -> bool:
    """Whether the report shows the blocks per stage: a `balanced` partition (the planner's boundaries, which a
    sweep's jobs share but a single run of each mode may not: harness/run_layout.py) or blocks that differ between
    jobs."""
    blocks = {repr(j.blocks_per_stage()) for j in jobs if j.status in ("done", "planned")}
    return len(blocks) > 1 or any(j.partition_method == "balanced" for j in jobs)


def rows(jobs: list[Job]) -> tuple[list[str], list[list[Any]]]:
    """The report table as plain values (bytes, ratios), one row per job: for W&B and the markdown."""
    base = baselines(jobs)
    axes = varying_axes(jobs)
    columns = [
        "job",
        "status",
        "mode",
        "interval/modules",
        "round",
        *axes,
        "tokens_per_s",
        "time_overhead_vs_none",
        "activation_bytes_per_microbatch_per_stage",
        "predicted_activation_bytes_per_stage",
        "predicted_vs_measured_max_error",
        "peak_activation_bytes_per_stage",
        "saving_vs_none_per_stage",
        "measured_peak_tensor_bytes_per_stage",
        "predicted_peak_tensor_bytes_per_stage",
        "val_loss",
        "step_time_s",
        "predicted_step_time_s",
        "bubble_fraction_per_stage",
        "blocks_per_stage",
    ]
    table = []
    for job in jobs:
        none = baseline_of(job, base)
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
        # Per stage, only against a `none` of the same stage boundaries: another partition's stage is another stage.
        if none is not None and peak and none.measured_peak_activation() and job.partition() == none.partition():
            saving = [
                None if a is None or b in (None, 0) else 1.0 - a / b
                for a, b in zip(peak, none.measured_peak_activation())
            ]
        table.append(
            [
                job.num,
                job.status,
                job.mode,
                job.setting,
                job.round,
                *[shape[k] for k in axes],
                job.tokens_per_s,
                overhead,
                measured,
                predicted,
                error,
                peak,
                saving,
                job.measured_peak_tensors(),
                job.predicted_peak_tensors(),
                job.val_loss,
                job.step_time_s,
                job.predicted_step_time_s,
                job.bubble_fraction_per_stage,
                job.blocks_per_stage(),
            ]
        )
    return columns, table
