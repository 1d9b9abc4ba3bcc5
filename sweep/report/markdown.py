"""report.md: the jobs' counts and shape, what the columns mean, where the predictions come from, the table
(one row per job that did not fail; memory in MiB, per stage as `stage 0 / stage 1 / ...`), the failed jobs'
messages, the planner's largest error, and the figure."""

import statistics
from pathlib import Path

from parallel.planning.shapes import MIB
from sweep.job import FAILED
from sweep.report.loading import Job
from sweep.report.rounds import setting_rounds
from sweep.report.table import baseline_of, baselines, partition_varies, rows, same_plan, varying_axes

FIGURE = "![memory per stage against tokens/s](report.png)"
NO_FIGURE = "(no figure: no job has both a throughput and a memory figure)"


def _mib(values: list | None) -> str:
    if not values:
        return "n/a"

    def one(v: float | None) -> str:
        if v is None:
            return "n/a"
        m = v / MIB
        return f"{m:,.0f}" if m >= 100 else f"{m:.3g}"

    return " / ".join(one(v) for v in values)


def _pct(value: float | None, signed: bool = True) -> str:
    if value is None:
        return "n/a"
    return f"{value * 100:+.1f}%" if signed else f"{value * 100:.1f}%"


def _pcts(values: list | None) -> str:
    if not values:
        return "n/a"
    return " / ".join(_pct(v, signed=False) for v in values)


def _ms(seconds: float | None) -> str:
    return "n/a" if seconds is None else f"{seconds * 1e3:,.1f}"


def render_markdown(sweep_dir: Path, jobs: list[Job], figure: bool = True) -> str:
    """report.md's text; `figure`: report.png was drawn (else a line says why there is none)."""
    columns, table = rows(jobs)
    axes = varying_axes(jobs)
    blocks_column = ["blocks/stage"] if partition_varies(jobs) else []
    round_column = ["round"] if any(j.round for j in jobs) else []
    n_axes = len(axes) + len(blocks_column) + len(round_column)
    base = baselines(jobs)
    done = [j for j in jobs if j.status == "done"]
    lines = [
        f"# Recompute report: {sweep_dir.name}",
        "",
        f"{len(jobs)} jobs in `{sweep_dir}`: {sum(j.status == 'done' for j in jobs)} done, "
        f"{sum(j.status == 'failed' for j in jobs)} failed, {sum(j.status == 'planned' for j in jobs)} "
        f"planned only (dry run), {sum(j.status == 'incomplete' for j in jobs)} incomplete.",
        "",
    ]
    if done:
        s = done[0].summary
        model = done[0].config.get("model", {})
        lines += [
            f"Shape: model {model.get('n_layer')} layers, h={model.get('n_embd')}, {model.get('n_head')} heads, "
            f"attention {model.get('attention')}, dropout {model.get('dropout')}; {s.get('pipeline_stages')} "
            f"stages x {s.get('data_parallel_size')} data-parallel; {s.get('device')} {s.get('precision')}"
            + (f"; sweep axes: {', '.join(axes)}" if axes else "")
            + ".",
            "",
        ]
    lines += [
        "Per-stage values are listed stage 0 / stage 1 / ...; memory in MiB (2^20 bytes). *act/mb*: bytes kept "
        "for backward per micro-batch (measured with saved-tensor hooks on one step); *pred.*: the planner's; "
        "*error*: largest |measured/predicted - 1| over stages. *peak act*: act/mb x micro-batches in flight "
        "under 1F1B; *saving*: 1 - peak act / peak act of `none` at the same shape and the same stage boundaries "
        "(n/a against another partition: its stages hold other layers); *overhead*: step time / step time of "
        "`none` (of the same round) - 1, a single measurement (see the rounds below). *peak tensors*: the most live "
        "tensor bytes at once on train.measure_step (the allocator's view; never the resident set, which holds the "
        "interpreter) beside the planner's prediction of the same (states + activations + buffers + the "
        "backward's working set). "
        "*val loss*: the last held-out loss (n/a: trained without train.eval_every). *step time*: median after "
        "warm-up, in ms; *pred.*: the step-time simulator's; *bubble*: idle share of the traced step per stage "
        "(train.trace_step; timelines below)."
        + (
            " *blocks/stage*: transformer blocks on stage 0 / 1 / ... (the partition differs between jobs)."
            if blocks_column
            else ""
        ),
        "",
    ]
    sources = {}
    for job in done:
        sources[job.plan_source] = sources.get(job.plan_source, 0) + 1
    if sources:
        names = {
            "plan.json": "the job's plan.json",
            "config.yaml": "planned here from the job's config.yaml",
            "summary.json": "the plan in summary.json (no peak-memory prediction)",
        }
        lines += ["Predictions: " + "; ".join(f"{names[k]} ({n} jobs)" for k, n in sorted(sources.items())) + ".", ""]
    header = [
        "job",
        "mode",
        "interval/modules",
        *round_column,
        *axes,
        *blocks_column,
        "tokens/s",
        "overhead",
        "act/mb",
        "act/mb pred.",
        "error",
        "peak act",
        "saving",
        "peak tensors",
        "peak tensors pred.",
        "val loss",
        "step time",
        "step time pred.",
        "bubble",
    ]
    lines.append("| " + " | ".join(header) + " |")
    lines.append("|" + "|".join("---:" if i >= 3 + n_axes or i == 0 else "---" for i in range(len(header))) + "|")
    for job, row in zip(jobs, table):
        if job.status == "failed":
            continue
        *row, step_time, predicted_time, bubbles, blocks = row
        num, _, mode, setting, rnd, *axis_values, tps, overhead, act, pred, error, peak, saving, mem, pred_mem, val = (
            row
        )
        alike = " (same plan as none: noise)" if same_plan(job, baseline_of(job, base)) else ""
        cells = [
            num,
            mode,
            setting,
            *([str(rnd)] if round_column else []),
            *[str(v) for v in axis_values],
            *(["n/a" if blocks is None else "/".join(map(str, blocks))] if blocks_column else []),
            "n/a" if tps is None else f"{tps:,.0f}",
            _pct(overhead) + alike,
            _mib(act),
            _mib(pred),
            _pct(error, signed=False),
            _mib(peak),
            _pcts(saving),
            _mib(mem),
            _mib(pred_mem),
            "n/a" if val is None else f"{val:.4f}",
            _ms(step_time),
            _ms(predicted_time),
            _pcts(bubbles),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    failed = [j for j in jobs if j.status == "failed"]
    if failed:
        lines += ["", "## Failed jobs", ""]
        for job in failed:
            first, *more = job.failure.splitlines()
            lines.append(
                f"- job {job.num} ({job.variant}): {first}"
                + (f" (+{len(more)} more lines in `{job.num}/{FAILED}`)" if more else "")
            )
    errors = [row[columns.index("predicted_vs_measured_max_error")] for row in table]
    errors = [e for e in errors if e is not None]
    if errors:
        lines += [
            "",
            f"Predicted vs measured activation bytes per micro-batch: largest error {max(errors) * 100:.2f}% "
            f"over {len(errors)} jobs (median {statistics.median(errors) * 100:.2f}%).",
        ]
    lines += _tensor_peak_lines(done)
    lines += _rounds_lines(jobs)
    lines += ["", FIGURE if figure else NO_FIGURE, ""]
    traced = [j for j in jobs if j.timeline is not None]
    if traced:
        lines += ["## Timelines of the traced steps", ""]
        for job in traced:
            folder = job.path.relative_to(sweep_dir).as_posix()
            lines += [f"Job {job.num} ({job.variant}), [trace.json]({folder}/trace.json):", ""]
            lines += [f"![timeline of job {job.num}]({folder}/timeline.png)", ""]
    return "\n".join(lines)


def _rounds_lines(jobs: list[Job]) -> list[str]:
    """Each setting's throughput over its rounds, the overhead's median and range against each round's `none`, and
    whether it is beyond the spread; with one round, a warning that no spread is known."""
    settings = setting_rounds(jobs)
    if not settings:
        return []
    lines = [
        "",
        "## Throughput over rounds",
        "",
        "| setting | rounds | tokens/s (median) | spread | overhead (median) | overhead range | verdict |",
        "|---|---:|---:|---:|---:|---:|---|",
    ]
    for s in settings:
        spread = "n/a" if s.spread is None else f"{s.spread:.1%}"
        span = f"{min(s.overheads):+.1%} .. {max(s.overheads):+.1%}" if len(s.overheads) > 1 else "n/a"
        lines.append(
            f"| {s.variant} | {len(s.jobs)} | {s.median_tokens_per_s:,.0f} | {spread} | {_pct(s.median_overhead)} | "
            f"{span} | {s.verdict} |"
        )
    if all(len(s.jobs) < 2 for s in settings):
        lines += [
            "",
            "Warning: each setting ran once, so no spread is known, and on a shared or busy machine a difference of "
            "tens of percent can be noise. Repeat the settings in rounds, `round` first among the options so that "
            "the rounds run one after another: `-m round=0,1,2 +recompute=none,full,selective`.",
        ]
    return lines


def _tensor_peak_lines(done: list[Job]) -> list[str]:
    """Measured peak tensor bytes (parallel/measurement/tensor_peak.py, the allocator's view) against the planner's
    predicted
    peak, per job: MiB per stage and the largest error."""
    cells, errors = [], []
    for job in done:
        s = job.summary or {}
        measured = s.get("measured_peak_tensor_bytes_per_stage")
        # Summaries written before the planner had one peak gave the one the allocator measures this key.
        predicted = s.get("predicted_peak_tensor_bytes_per_stage", s.get("predicted_peak_bytes_per_stage"))
        if not measured or not predicted or None in measured or None in predicted:
            continue
        errors += [abs(m / p - 1.0) for m, p in zip(measured, predicted)]
        cells.append(f"job {job.num} {_mib(measured)} vs {_mib(predicted)}")
    if not errors:
        return []
    return [
        "",
        f"Peak tensor memory (live tensors at once on train.measure_step, the allocator's view) measured vs "
        f"predicted, MiB per stage: {'; '.join(cells)}; largest error {max(errors) * 100:.2f}%.",
    ]
