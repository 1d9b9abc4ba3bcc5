"""bench/peer_frontier.py, the frontier of `bench.pipeline_peers --frontier`, on runs with known figures: the budgets
span the floor to no recompute's peak, each system's fastest configuration that fits, and the picture."""

from bench.peer_frontier import draw_frontier, fastest_within, frontier_table, sweep_budgets
from bench.peer_launch import Run

MIB = 2**20


def run(name: str, peak_mib: int, step_s: float) -> Run:
    """A 2-rank run of 4 micro-batches of 100 tokens: 400 / step_s tokens/s, its largest rank at peak_mib."""
    return Run(name, 0, 4, 100, [step_s], [peak_mib * MIB // 2, peak_mib * MIB])


RUNS = [
    run("DeepSpeed interval=0", 40, 1.0),
    run("DeepSpeed interval=1", 20, 2.0),
    run("torch 1f1b + ckpt", 25, 1.6),
    run("stagecheck auto @ 0.02 GiB", 21, 1.25),
    run("stagecheck full(stage) 1f1b", 10, 2.5),
    Run("torch zbv", 0, 4, 100, error="failed"),  # a failed launch prices nothing
]


def test_the_budgets_span_the_floor_to_no_recomputes_peak():
    assert sweep_budgets(RUNS, 4) == [10 * MIB, 20 * MIB, 30 * MIB, 40 * MIB]


def test_each_system_runs_its_fastest_configuration_that_fits():
    assert fastest_within(RUNS, 10 * MIB) == {
        "DeepSpeed": None,
        "torch": None,
        "stagecheck": ("stagecheck full(stage) 1f1b", 160.0),
    }
    assert fastest_within(RUNS, 21 * MIB) == {
        "DeepSpeed": ("DeepSpeed interval=1", 200.0),
        "torch": None,
        "stagecheck": ("stagecheck auto @ 0.02 GiB", 320.0),
    }
    table = frontier_table(RUNS, [21 * MIB, 40 * MIB])
    assert table[3] == (
        "| 21.0 | 200 tok/s (DeepSpeed interval=1) | none fits | 320 tok/s (stagecheck auto @ 0.02 GiB) | 1.60x |"
    )
    assert table[4].endswith("| 0.80x |")  # at no recompute's peak DeepSpeed interval=0 wins here


def test_the_frontier_is_drawn(tmp_path):
    path = tmp_path / "frontier.png"
    draw_frontier(RUNS, sweep_budgets(RUNS, 6), path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
