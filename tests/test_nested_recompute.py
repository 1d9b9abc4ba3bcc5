"""Nested checkpoints (`recompute.nested`): each block checkpointed again inside its segment. The planner's peak
against the allocator's for a nested stage, under 1F1B and under zb-h1 with early recompute (the stage replay:
parallel/measurement/stage_replay.py); `auto`, which nests a stage only where nothing cheaper fits its budget; and
its floor with and without nesting, in the refusal and in the budget lines of the start-up print and the dry run.
(Bit-exactness: tests/test_recompute_exact.py, tests/test_zero_bubble.py; kept bytes per micro-batch:
tests/test_activation_planner.py.)"""

import pytest

from model import GPTConfig
from parallel.measurement.stage_replay import StageReplay
from parallel.planning.budget_refusal import BudgetTooSmall
from parallel.planning.config import AutoRecompute, FullRecompute
from parallel.planning.layout import build_layout
from parallel.planning.run_plan import plan_run
from parallel.planning.shapes import GIB, RunShape, Target, Topology

MODEL = GPTConfig(n_layer=6, n_head=4, n_embd=64, seq_len=64, vocab_size=128, dropout=0.1, attention="math")
RUN = RunShape(Topology(2), Target("cpu", "fp32"), micro_batches=4, micro_batch_size=2)
TOLERANCE = 0.02
"""Measured 1.0% over (1f1b) and 1.0% under (zb-h1, early) the planned peak on this shape."""


def _planned(recompute, schedule: str = "1f1b"):
    layout = build_layout(MODEL, recompute, RUN, "type:Block", 0, schedule=schedule)
    return layout, plan_run(MODEL, recompute, layout, RUN)


@pytest.mark.parametrize(
    "recompute, schedule",
    [
        (FullRecompute(interval="stage", nested=True), "1f1b"),
        (FullRecompute(interval="stage", nested=True, early=True), "zb-h1"),
    ],
    ids=["1f1b", "zb-h1 early"],
)
def test_a_nested_stages_planned_peak_is_its_measured_peak(recompute, schedule):
    layout, plan = _planned(recompute, schedule)
    assert layout.plans[0].nested and layout.plans[0].segments == ((2, 5),)  # 3 blocks nested in one segment
    measured = StageReplay(layout, 0, RUN).measure_peak()
    assert measured.unaccounted_bytes == 0
    assert abs(measured.peak_bytes / plan.stages[0].predicted_peak_bytes - 1) <= TOLERANCE


def test_nesting_lowers_full_stages_peak_below_full_1s_for_the_same_kept_bytes():
    _, stage = _planned(FullRecompute(interval="stage"))
    _, nested = _planned(FullRecompute(interval="stage", nested=True))
    _, one = _planned(FullRecompute(interval="1"))
    assert nested.stages[0].choices == ("nested",) * 3
    assert nested.stages[0].activation_bytes_per_microbatch == stage.stages[0].activation_bytes_per_microbatch
    assert nested.stages[0].predicted_peak_bytes < one.stages[0].predicted_peak_bytes
    assert nested.stages[0].predicted_peak_bytes < stage.stages[0].predicted_peak_bytes


def test_auto_nests_a_stage_only_where_nothing_cheaper_fits_and_counts_its_peak_as_the_plan_does():
    _, nested = _planned(FullRecompute(interval="stage", nested=True))
    _, one = _planned(FullRecompute(interval="1"))
    tight, loose = nested.stages[0].predicted_peak_bytes, one.stages[0].predicted_peak_bytes
    for budget, nests in ((tight, True), (loose, False)):
        auto = AutoRecompute(budget_gb=budget / GIB, reserve_gb=0.0)
        layout = build_layout(MODEL, auto, RUN, "type:Block", 0)
        peaks = [s.predicted_peak_bytes for s in plan_run(MODEL, auto, layout, RUN).stages]
        assert layout.plans[0].nested == nests and not layout.plans[1].nested
        assert peaks == [b.predicted_peak_bytes for b in layout.budgets] and max(peaks) <= budget


def test_the_refusal_and_the_budget_lines_give_the_floor_with_and_without_nesting():
    with pytest.raises(BudgetTooSmall) as refused:
        build_layout(MODEL, AutoRecompute(budget_gb=1e-6, reserve_gb=0.0), RUN, "type:Block", 0)
    message = str(refused.value)
    assert "reached with nested checkpoints on stage 0 (auto nests a stage where nothing else fits" in message
    unnested = float(message.split("without nesting the smallest budget is ")[1].split(")")[0])
    assert unnested > refused.value.smallest_gb
    auto = AutoRecompute(budget_gb=1.0, reserve_gb=0.0)
    layout = build_layout(MODEL, auto, RUN, "type:Block", 0)
    first, last = layout.budgets
    assert first.least_bytes < first.least_bytes_unnested and last.least_bytes == last.least_bytes_unnested
    floor = f"floor {first.least_bytes / GIB:.4f} ({first.least_bytes_unnested / GIB:.4f} without nesting) GiB"
    assert layout.describe_budgets(auto)[1].endswith(floor)
    assert layout.describe_budgets(auto)[2].endswith(f"floor {last.least_bytes / GIB:.4f} GiB")
