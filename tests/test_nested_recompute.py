"""Nested checkpoints (`recompute.nested`): each block checkpointed again inside its segment. The planner's peak
against the allocator's for a nested stage, under 1F1B and under zb-h1 with early recompute (the stage replay:
parallel/measurement/stage_replay.py); `auto`, which nests a stage only where nothing cheaper fits its budget; and
its floor with and without nesting, in the refusal and in the budget lines of the start-up print and the dry run.
(Bit-exactness: tests/test_recompute_exact.py, tests/test_zero_bubble.py; kept bytes per micro-batch:
tests/test_activation_planner.py.)"""

import pytest

from bench.nested_compress_bench import FLOOR_RUNS
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
LLAMA = GPTConfig(
    arch="llama", activation="silu", bias=False, dropout=0.0, tie_embeddings=False,
    n_layer=6, n_head=4, n_kv_head=2, n_embd=64, intermediate_size=224, seq_len=64, vocab_size=128,
)  # fmt: skip
"""The Llama family's proportions (MLP 3.5 x the width, grouped-query attention 4:2), where a stage's peak is inside
the SwiGLU backward (working_set.block_backward_bytes)."""


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


def test_a_nested_llama_stages_planned_activation_bytes_are_its_measured_within_5_percent():
    # The figure: activation bytes, the peak less the parameters, gradients and optimizer state. Measured
    # 4.0% over the plan here (the checkpoints' CPU RNG states, 5056 bytes each, which on CUDA are host memory and
    # which the planner leaves out); 22.6% over before the SwiGLU backward was counted.
    layout = build_layout(LLAMA, FullRecompute(interval="stage", nested=True), RUN, "type:Block", 0)
    stage = plan_run(LLAMA, FullRecompute(interval="stage", nested=True), layout, RUN).stages[0]
    assert layout.plans[0].nested and layout.plans[0].segments == ((1, 4),)
    measured = StageReplay(layout, 0, RUN).measure_peak()
    states = stage.param_bytes + stage.grad_bytes + stage.optimizer_bytes
    assert measured.unaccounted_bytes == 0 and measured.peak_op == "aten::mul"  # the SwiGLU backward's last multiply
    assert abs((measured.peak_bytes - states) / (stage.predicted_peak_bytes - states) - 1) <= 0.05


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


@pytest.mark.parametrize("name", FLOOR_RUNS)
def test_the_budget_lines_give_the_floor_today_with_nesting_and_with_compression_allowed(name):
    """gpt2 on 4 stages and llama3-8b on 4 x 2 at 8192 tokens (the issue's floor figure): the lines the dry run and
    the start-up print give under +recompute=auto recompute.compress=fp8. llama3-8b's stage 0 cannot go below its
    optimizer step's (BF16_Optimizer's fp32 copy of its gradient partition, after every backward): nesting and
    stashes lower its activations, not that."""
    model, run = FLOOR_RUNS[name]
    auto = AutoRecompute(budget_gb=1e6, reserve_gb=0.0, compress="fp8")
    layout = build_layout(model, auto, run, "type:Block", 0)
    first = layout.budgets[0]
    least, exact, today = (b / GIB for b in (first.least_bytes, first.least_bytes_exact, first.least_bytes_today))
    stage = plan_run(model, auto, layout, run).stages[0]
    if model.arch == "llama":
        copy = 4 * -(-stage.params // run.topology.data_parallel_size)  # fp32, of the partition BF16_Optimizer steps
        assert first.least_bytes == first.least_bytes_exact == first.least_bytes_today
        assert first.least_bytes >= stage.param_bytes + stage.grad_bytes + stage.optimizer_bytes + copy
        assert layout.describe_budgets(auto)[1].endswith(f"floor {least:.4f} GiB")
        return
    assert least < exact < today and first.least_bytes_unnested < first.least_bytes_today
    floors = f"floor {least:.4f} ({exact:.4f} without fp8 stashes, {today:.4f} without nesting or fp8 stashes) GiB"
    assert layout.describe_budgets(auto)[1].endswith(floors)
    states = (stage.param_bytes + stage.grad_bytes + stage.optimizer_bytes) / GIB
    nesting, compressed = ((floor - states) / (today - states) for floor in (exact, least))
    assert compressed < nesting < 0.90  # the activation part
