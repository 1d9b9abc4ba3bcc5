"""report.png: per stage, peak activation memory and peak tensor memory (MiB) against throughput (tokens/s), one
marker per recompute mode and one colour per setting: the measurement (filled) at the measured tokens/s, the
planner's prediction (hollow) at the predicted tokens/s (tokens per step / predicted step time), a thin line joining
the two. A job without a predicted step time has its predicted memory drawn just beside its measurement, and the
legend says so. A job planned only (a dry-run sweep) stands at its predicted throughput, with its predictions
alone."""

from pathlib import Path

from parallel.planning.shapes import MIB
from sweep.report.loading import Job
from sweep.report.table import axis_label, varying_axes

MARKERS = {"none": "o", "full": "s", "selective": "^", "auto": "D"}
"""One marker per recompute mode (another mode gets "P")."""


def render_png(jobs: list[Job], path: Path) -> bool:
    """Memory per stage (MiB) against tokens/s: filled = measured, hollow = predicted; returns False when no
    job has both a throughput (measured, or predicted for a job planned only) and a memory figure."""
    # Imported here: the backend must be chosen before pyplot is imported, and a training process that imports
    # the multirun callback (and so this package) should not pay for matplotlib.
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    throughput = {j.num: j.tokens_per_s if j.status == "done" else j.predicted_tokens_per_s for j in jobs}
    done = [j for j in jobs if j.status in ("done", "planned") and throughput[j.num]]
    if not done:
        return False
    stages = max(len(j.measured_peak_activation() or j.predicted_peak_activation() or []) for j in done)
    if stages == 0:
        return False
    axes_keys = varying_axes(jobs)
    order = list(MARKERS)
    variants = sorted(
        {j.variant for j in done},
        key=lambda v: (order.index(v.split("/")[0]) if v.split("/")[0] in order else len(order), v),
    )
    colors = {v: plt.get_cmap("tab10")(i % 10) for i, v in enumerate(variants)}
    panels = [
        ("peak activation memory per stage (MiB)", Job.measured_peak_activation, Job.predicted_peak_activation),
        ("peak tensor memory per stage (MiB)", Job.measured_peak_tensors, Job.predicted_peak_memory),
    ]
    fig, grid = plt.subplots(
        len(panels), stages, figsize=(5.2 * stages + 3.4, 4.2 * len(panels)), squeeze=False, layout="constrained"
    )
    predicted_x = {j.num: j.predicted_tokens_per_s for j in done}
    beside = any(predicted_x[j.num] is None for j in done)
    xs = [throughput[j.num] for j in done] + [x for x in predicted_x.values() if x]
    span = (max(xs) - min(xs)) or max(xs) * 0.1
    for row, (title, measured_of, predicted_of) in enumerate(panels):
        for stage in range(stages):
            ax = grid[row][stage]
            for job in done:
                x = throughput[job.num]
                color, marker = colors[job.variant], MARKERS.get(job.mode, "P")
                m = (measured_of(job) or [None] * stages)[stage] if stage < len(measured_of(job) or []) else None
                p = (predicted_of(job) or [None] * stages)[stage] if stage < len(predicted_of(job) or []) else None
                dx = span * 0.012  # without a predicted throughput: the prediction just beside the measurement
                px = predicted_x[job.num] or x + dx
                mx = x if predicted_x[job.num] else x - dx
                if m is not None:
                    ax.plot(mx, m / MIB, marker=marker, color=color, markersize=8, linestyle="none")
                if p is not None:
                    ax.plot(
                        px,
                        p / MIB,
                        marker=marker,
                        markerfacecolor="none",
                        markeredgecolor=color,
                        markersize=9,
                        markeredgewidth=1.5,
                        linestyle="none",
                    )
                if m is not None and p is not None:
                    ax.plot([mx, px], [m / MIB, p / MIB], color=color, linewidth=0.8, alpha=0.6)
                label_at = m if m is not None else p  # a job planned only has its prediction alone
                if axes_keys and label_at is not None:
                    ax.annotate(
                        axis_label(job, axes_keys),
                        (x, label_at / MIB),
                        textcoords="offset points",
                        xytext=(6, 4),
                        fontsize=7,
                        color=color,
                    )
            ax.set_title(f"stage {stage}: {title.split(' per stage')[0]}", fontsize=10)
            ax.set_xlabel("throughput (tokens/s): measured (filled), predicted (hollow)")
            ax.set_ylabel(title.replace(" per stage", ""))
            ax.grid(True, alpha=0.3)
            top = max(ax.get_ylim()[1], 1e-3) * 1.12  # room above the highest marker
            ax.set_ylim(-0.025 * top, top)  # and below the lowest: nothing clipped at 0
            low, high = min(xs) - span * 0.15, max(xs) + span * 0.15
            ax.set_xlim(max(0.0, low), high)
    handles = [
        Line2D(
            [], [], marker=MARKERS.get(v.split("/")[0], "P"), color=colors[v], linestyle="none", markersize=8, label=v
        )
        for v in variants
    ]
    handles += [
        Line2D([], [], marker="o", color="0.3", linestyle="none", markersize=8, label="measured (filled)"),
        Line2D(
            [],
            [],
            marker="o",
            markerfacecolor="none",
            markeredgecolor="0.3",
            linestyle="none",
            markersize=9,
            label="predicted (hollow): at the predicted tokens/s"
            + ("; beside the measurement where no step time was predicted" if beside else ""),
        ),
    ]
    # "outside": constrained layout gives the legend its own column, so it never covers a panel.
    fig.legend(handles=handles, loc="outside right center", fontsize=9, frameon=True, title="mode / setting")
    fig.suptitle("Recompute: memory per stage against throughput", fontsize=12)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
