"""The frontier of bench/pipeline_peers.py (`--frontier PNG`): at budgets from the memory floor (the smallest measured
peak of any configuration) to no recompute's peak (the largest), the fastest configuration of each system whose
largest rank's measured peak fits, and the picture of tokens/s against that peak, one staircase per system."""

import statistics
from pathlib import Path

from bench.peer_launch import Run

MIB = 2**20
SYSTEMS = ("DeepSpeed", "torch", "stagecheck")
"""Each configuration's system is the first word of its name (bench/pipeline_peers.py's names)."""


def system_of(name: str) -> str:
    return name.split()[0]


def _medians(runs: list[Run]) -> dict[str, tuple[int, float]]:
    """Each configuration's (largest measured peak, median tokens/s over its rounds)."""
    by_name: dict[str, list[Run]] = {}
    for run in runs:
        if not run.error:
            by_name.setdefault(run.name, []).append(run)
    return {
        name: (max(r.peak for r in ok), statistics.median(r.tokens_per_s for r in ok)) for name, ok in by_name.items()
    }


def sweep_budgets(runs: list[Run], count: int) -> list[int]:
    """`count` budgets in bytes, evenly from the smallest measured peak to the largest (both included)."""
    peaks = [peak for peak, _ in _medians(runs).values()]
    low, high = min(peaks), max(peaks)
    return [round(low + (high - low) * i / (count - 1)) for i in range(count)]


def fastest_within(runs: list[Run], budget: int) -> dict[str, tuple[str, float] | None]:
    """Per system, its fastest configuration whose largest peak fits `budget` (name, tokens/s), or None."""
    best: dict[str, tuple[str, float] | None] = dict.fromkeys(SYSTEMS)
    for name, (peak, tokens_per_s) in _medians(runs).items():
        system = system_of(name)
        if peak <= budget and (best.get(system) is None or tokens_per_s > best[system][1]):
            best[system] = (name, tokens_per_s)
    return best


def frontier_table(runs: list[Run], budgets: list[int]) -> list[str]:
    """The markdown table: per budget, each system's fastest fitting configuration and stagecheck's speed-up."""
    lines = [
        "## The frontier: the fastest configuration of each system that fits each budget\n",
        "| budget MiB | " + " | ".join(SYSTEMS) + " | stagecheck / best peer |",
        "|---:|" + "---|" * len(SYSTEMS) + "---:|",
    ]
    for budget in budgets:
        best = fastest_within(runs, budget)
        cells = [f"{b[1]:.0f} tok/s ({b[0]})" if b else "none fits" for b in (best[s] for s in SYSTEMS)]
        peers = [best[s][1] for s in SYSTEMS if s != "stagecheck" and best[s]]
        ratio = f"{best['stagecheck'][1] / max(peers):.2f}x" if best["stagecheck"] and peers else "-"
        lines.append(f"| {budget / MIB:.1f} | " + " | ".join(cells) + f" | {ratio} |")
    return lines


def draw_frontier(runs: list[Run], budgets: list[int], path: Path) -> None:
    """tokens/s of each system's fastest fitting configuration against the budget (a staircase per system), with
    every configuration as a point at its own peak."""
    import matplotlib  # only the frontier needs it: the benchmark's other output is text

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(8, 5))
    medians = _medians(runs)
    for system, colour in zip(SYSTEMS, ("tab:blue", "tab:orange", "tab:green")):
        points = [(peak / MIB, tps) for name, (peak, tps) in medians.items() if system_of(name) == system]
        if points:
            axes.scatter(*zip(*points), color=colour, alpha=0.4, s=18)
        stairs = [(b / MIB, best[1]) for b in budgets if (best := fastest_within(runs, b)[system])]
        if stairs:
            axes.step(*zip(*stairs), where="post", color=colour, label=system, marker="o")
    axes.set_xlabel("largest stage's measured peak (MiB)")
    axes.set_ylabel("tokens/s (median timed step)")
    axes.set_title("Fastest configuration that fits each budget")
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
