"""bench/peer_report.py's issue-34 rows on runs with known figures: against torch's interleaved 1F1B and ZBV,
stagecheck's fastest schedule with virtual stages whose peak is within the peer's, per round, and its target line."""

from bench.peer_launch import Run
from bench.peer_report import report

MIB = 2**20


def run(name: str, peak_mib: int, step_s: float, round_: int = 0) -> Run:
    """A 2-rank run of 4 micro-batches of 100 tokens: 400 / step_s tokens/s, its largest rank at peak_mib."""
    return Run(name, round_, 4, 100, [step_s], [peak_mib * MIB // 2, peak_mib * MIB], loss=5.0)


RUNS = [
    run("torch interleaved", 30, 1.0),
    run("torch zbv", 20, 1.0),
    run("stagecheck interleaved-1f1b none", 32, 0.5),  # the fastest, but over both peers' peaks
    run("stagecheck zb-v none", 25, 0.9),  # within torch interleaved's peak only
    run("stagecheck v-half none", 15, 0.96),
    Run("stagecheck zb-v selective", 0, 4, 100, error="failed"),  # a failed launch prices nothing
]


def test_the_fastest_virtual_stage_schedule_within_each_torch_peers_peak_is_set_against_it(capsys):
    figures = report(RUNS, ["torch interleaved", "torch zbv"], {}, 1)
    out = capsys.readouterr().out
    interleaved, zbv = figures["virtual vs torch interleaved"], figures["virtual vs torch zbv"]
    assert interleaved["run"] == "stagecheck zb-v none" and interleaved["ratios"] == [1.0 / 0.9]
    assert zbv["run"] == "stagecheck v-half none" and zbv["ratios"] == [1.0 / 0.96]
    assert "/ torch interleaved: median 1.111x" in out and "-> target >= 1.03x met" in out
    assert "/ torch zbv: median 1.042x" in out
