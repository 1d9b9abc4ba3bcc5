"""A traced step as files: trace.json (Chrome trace event format: opens in Perfetto and chrome://tracing)
and timeline.png (one row per stage, one colour per kind of instruction, idle time as gaps)."""

import json
from pathlib import Path

from harness.bubbles import CATEGORY, stage_times
from harness.files import atomic_write, atomic_write_text
from parallel.measurement.trace import StepTrace

COLOURS = {
    "load": "#2ca02c",
    "forward": "#1f77b4",
    "backward": "#ff7f0e",
    "backward B": "#ffbb78",
    "backward W": "#17becf",
    "early recompute": "#e377c2",
    "recompute": "#9467bd",
    "p2p": "#b0b0b0",
    "reduce": "#8c564b",
    "optimizer": "#d62728",
}
"""One colour per CATEGORY, in legend order."""

TRACE_JSON, TIMELINE_PNG = "trace.json", "timeline.png"


def _us(seconds: float) -> float:
    return round(seconds * 1e6, 3)


def row_names(trace: StepTrace) -> list[str]:
    """Each stage's name, or under a virtual-stage schedule each pipeline rank's, with the virtual stages it ran."""
    if trace.schedule is None:
        return [f"stage {stage}" for stage in range(trace.stages)]
    held = [set() for _ in range(trace.stages)]
    for rank in trace.ranks:
        held[rank.stage] |= {i.virtual_stage for i in rank.instructions if i.virtual_stage is not None}
    return [f"rank {r} (virtual stages {', '.join(map(str, sorted(stages)))})" for r, stages in enumerate(held)]


def chrome_trace(trace: StepTrace) -> dict:
    """One process per stage ("stage N", or a virtual-stage schedule's pipeline rank), one thread per data-parallel
    rank, one complete ("X") event per instruction; a recompute is an event nested inside its backward pass (or its
    early recompute) on the same thread."""
    events = []
    for stage, name in enumerate(row_names(trace)):
        events.append({"ph": "M", "name": "process_name", "pid": stage, "args": {"name": name}})
        events.append({"ph": "M", "name": "process_sort_index", "pid": stage, "args": {"sort_index": stage}})
    for rank in trace.ranks:
        events.append(
            {
                "ph": "M",
                "name": "thread_name",
                "pid": rank.stage,
                "tid": rank.dp_rank,
                "args": {"name": f"dp rank {rank.dp_rank} (rank {rank.rank})"},
            }
        )
        for interval in rank.instructions + rank.recomputes:
            args = {"rank": rank.rank}
            if interval.buffer_id is not None:
                args["buffer_id"] = interval.buffer_id
            if interval.micro_batch is not None:
                args["micro_batch"] = interval.micro_batch
            if interval.virtual_stage is not None:
                args["virtual_stage"] = interval.virtual_stage
            events.append(
                {
                    "name": interval.name,
                    "cat": CATEGORY[interval.name],
                    "ph": "X",
                    "ts": _us(interval.start_s),
                    "dur": _us(interval.duration_s),
                    "pid": rank.stage,
                    "tid": rank.dp_rank,
                    "args": args,
                }
            )
    return {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "otherData": {
            "step": trace.step,
            "step_time_s": trace.step_time_s,
            "micro_batches": trace.micro_batches,
            "clock_skew_s": trace.clock_skew_s,
        },
    }


def render_timeline(trace: StepTrace, path: Path) -> None:
    """timeline.png: stage 0 on top; each stage's data-parallel ranks share its row as lanes."""
    # Imported here: the backend must be chosen before pyplot is imported, and only the loss rank of a traced
    # run pays for matplotlib.
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    bubbles = stage_times(trace)["bubble_fraction_per_stage"]
    lanes = max(r.dp_rank for r in trace.ranks) + 1
    fig, ax = plt.subplots(figsize=(12, 1.0 + 0.9 * trace.stages), layout="constrained")
    for rank in trace.ranks:
        height = 0.8 / lanes
        bottom = rank.stage - 0.4 + rank.dp_rank * height
        for category in COLOURS:
            if category == "recompute":
                continue
            bars = [(i.start_s * 1e3, i.duration_s * 1e3) for i in rank.instructions if CATEGORY[i.name] == category]
            ax.broken_barh(bars, (bottom, height), facecolors=COLOURS[category], edgecolor="white", linewidth=0.4)
        # Recompute over the middle of its backward (or early recompute) bar, so the bar around it stays visible.
        bars = [(i.start_s * 1e3, i.duration_s * 1e3) for i in rank.recomputes]
        ax.broken_barh(bars, (bottom + height * 0.2, height * 0.6), facecolors=COLOURS["recompute"])
    ax.set_ylim(trace.stages - 0.5, -0.5)  # stage 0 on top
    ax.set_yticks(range(trace.stages), [f"{n}\nbubble {b:.0%}" for n, b in zip(row_names(trace), bubbles)])
    ax.set_xlim(0, trace.step_time_s * 1e3)
    ax.set_xlabel("time since the step's barrier (ms)")
    ax.grid(True, axis="x", alpha=0.3)
    handles = [Patch(facecolor=colour, label=category) for category, colour in COLOURS.items()]
    handles.append(Patch(facecolor="white", edgecolor="0.5", label="idle"))
    fig.legend(handles=handles, loc="outside right center", fontsize=9, frameon=True)
    ax.set_title(
        f"step {trace.step}: {trace.step_time_s * 1e3:.1f} ms, {trace.micro_batches} micro-batches, "
        f"{trace.stages} {'ranks' if trace.schedule else 'stages'} ({schedule_name(trace)})",
        fontsize=11,
    )
    atomic_write(path, lambda handle: fig.savefig(handle, format="png", dpi=110), binary=True)
    plt.close(fig)


def schedule_name(trace: StepTrace) -> str:
    """What the trace shows it ran: a virtual-stage schedule by its name; else ZB-H1 splits the backward into B and
    W, and early recompute has its own instruction."""
    if trace.schedule is not None:
        return trace.schedule
    names = {i.name for r in trace.ranks for i in r.instructions}
    name = "ZB-H1" if "BackwardInput" in names else "1F1B"
    return name + (" + early recompute" if "RecomputeEarly" in names else "")


def write_timeline(trace: StepTrace, run_dir: Path) -> list[Path]:
    """Writes trace.json and timeline.png into the run directory; returns their paths."""
    json_path, png_path = run_dir / TRACE_JSON, run_dir / TIMELINE_PNG
    atomic_write_text(json_path, json.dumps(chrome_trace(trace)))
    render_timeline(trace, png_path)
    return [json_path, png_path]


def publish_trace(trace: StepTrace | None, run_dir: Path, wandb) -> dict:
    """On the loss rank: the files, attached to the W&B run when there is one, and the summary.json entries
    ({} when no step was traced)."""
    if trace is None:
        return {}
    paths = write_timeline(trace, run_dir)
    if wandb is not None:
        wandb.save_files(paths, run_dir)
    entries = stage_times(trace)
    bubbles = ", ".join(f"{b:.0%}" for b in entries["bubble_fraction_per_stage"])
    print(
        f"stagecheck: traced step {trace.step} ({trace.step_time_s * 1e3:.1f} ms; clock skew "
        f"{trace.clock_skew_s * 1e6:.0f} us): bubble per stage {bubbles}; {TRACE_JSON}, {TIMELINE_PNG} in {run_dir}",
        flush=True,
    )
    return entries
