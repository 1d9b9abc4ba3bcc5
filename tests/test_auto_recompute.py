"""Stage-aware automatic recompute: the optimiser on hand-made cost tables, budget boundaries, the
message when nothing fits, and plans on real shapes."""

import itertools
import math
import time

import pytest

from model import GPTConfig
from parallel.planning.auto_recompute import choose_stage, least_stage_bytes
from parallel.planning.block_prices import BlockOption, BlockPrices, analytic_prices
from parallel.planning.config import AutoRecompute, SelectiveRecompute
from parallel.planning.layout import build_layout
from parallel.planning.shapes import GIB, RunShape, Shape, Target, Topology
from parallel.planning.working_set import StageWorking
from tests.runs import TINY as RUN_TINY
from tests.runs import summary
from tests.shared_runs import case

TABLE = BlockPrices(
    options=(
        BlockOption("none", (), 100, 0.0, working_bytes=30),
        BlockOption("selective:core_attn", ("core_attn",), 40, 3.0, working_bytes=90),  # remakes what it saves
        BlockOption("selective:mlp", ("mlp",), 70, 5.0, working_bytes=60),
    ),  # dominated by core_attn on bytes and cost, not on the working set
    segment_input_bytes=10,
    block_bytes=100,
    full_block_cost=10.0,
    segment_discount=1.0,
)
NOTHING_ELSE = StageWorking(block_offset=0)
LAST_STAGE = StageWorking(block_offset=-20, fixed=150)  # the loss's backward, and what the head freed
FIRST_STAGE = StageWorking(block_offset=0, embedding=400)  # the embedding's backward once the blocks are freed


def brute_force(n: int, table: BlockPrices, in_flight: int, budget: float, working: StageWorking):
    """Every assignment of choices to n blocks, with full blocks grouped into any number of segments, nested or not,
    the working set being the largest block's (a segment's: none's with what it remakes; nested, its blocks' inputs
    and one block's interior, for one more forward of each of its blocks but the last)."""
    best = None
    names = [o.choice for o in table.options] + ["full"]
    for assignment in itertools.product(names, repeat=n):
        m = assignment.count("full")
        rest = [o for name in assignment if name != "full" for o in table.options if o.choice == name]
        for k, nested in itertools.product([0] if m == 0 else range(1, m + 1), (False, True)):
            size = math.ceil(m / k) if m else 0
            if nested and size < 2:  # nothing to nest
                continue
            kept = sum(o.kept_bytes for o in rest) + k * table.segment_input_bytes
            remade = size * table.block_bytes - table.segment_input_bytes if m else -math.inf
            cost = sum(o.cost for o in rest) + m * table.full_block_cost - k * table.segment_discount
            if nested:
                remade = table.block_bytes + (size - 2) * table.segment_input_bytes
                cost += (m - k) * table.full_block_cost - (m - k) * table.segment_discount
            moment = max([o.working_bytes for o in rest] + [table.options[0].working_bytes + remade])
            if working.bytes(kept, in_flight, moment) <= budget and (best is None or cost < best):
                best = cost
    return best


@pytest.mark.parametrize("n, in_flight", [(3, 1), (4, 2), (5, 4)])
@pytest.mark.parametrize("working", [NOTHING_ELSE, LAST_STAGE, FIRST_STAGE])
def test_the_known_optimum_is_found_at_every_budget(n, in_flight, working):
    for budget in range(0, in_flight * n * 100 + 600, 37):
        choice = choose_stage(n, TABLE, in_flight, budget, working)
        expected = brute_force(n, TABLE, in_flight, budget, working)
        assert (choice.cost if choice else None) == expected, budget
        if choice:
            assert working.bytes(choice.kept_bytes, in_flight, choice.working_bytes) <= budget


def test_none_is_chosen_when_it_fits():
    choice = choose_stage(4, TABLE, 2, 4 * 100 * 2 + 30, NOTHING_ELSE)
    assert choice.choices == ("none",) * 4 and choice.cost == 0


def test_budget_boundaries_just_fit_and_just_do_not():
    least, unnested, exact, today = least_stage_bytes(4, TABLE, 3, NOTHING_ELSE)
    assert unnested > least  # the floor needs a nested segment
    assert (exact, today) == (least, unnested)  # no stash in the table: compression was not allowed
    assert choose_stage(4, TABLE, 3, least, NOTHING_ELSE).nested
    assert not choose_stage(4, TABLE, 3, unnested, NOTHING_ELSE).nested
    assert choose_stage(4, TABLE, 3, least - 1, NOTHING_ELSE) is None
    # One block moved to core_attn: the budget for exactly that (with core_attn's working set) fits, a byte less not.
    exact = 3 * (3 * 100 + 40) + 90
    assert choose_stage(4, TABLE, 3, exact, NOTHING_ELSE).choices.count("selective:core_attn") == 1
    assert choose_stage(4, TABLE, 3, exact - 1, NOTHING_ELSE).cost > 3.0


def test_the_block_of_the_largest_working_set_comes_last_and_segments_cover_the_full_blocks():
    for budget in range(200, 2000, 23):
        choice = choose_stage(5, TABLE, 4, budget, NOTHING_ELSE)
        if choice is None:
            continue
        segment_choice = "nested" if choice.nested else "full"
        full = [i for i, c in enumerate(choice.choices) if c == segment_choice]
        assert [i for a, b in choice.segments for i in range(a, b)] == full
        working = {o.choice: o.working_bytes for o in TABLE.options}
        others = [working[c] for c in choice.choices if c != segment_choice]
        if others and choice.working_bytes == max(others):
            assert choice.choices[-1] != segment_choice and working[choice.choices[-1]] == choice.working_bytes
        elif full:
            longest = max(b - a for a, b in choice.segments)
            assert full[-1] == 4 and choice.segments[-1][1] - choice.segments[-1][0] == longest


def _tiny_run(stages: int, micro_batches: int) -> RunShape:
    return RunShape(Topology(stages), Target("cpu", "fp32"), micro_batches=micro_batches, micro_batch_size=2)


def _budgets(model: GPTConfig, recompute, run: RunShape):
    return build_layout(model, recompute, run, "type:Block", 0).budgets


TINY = GPTConfig(n_layer=8, n_head=4, n_embd=64, seq_len=64, vocab_size=256, dropout=0.1, attention="math")


def test_tight_budget_recomputes_more_on_the_first_stage_than_on_the_last():
    run = _tiny_run(4, 8)
    loose = _budgets(TINY, AutoRecompute(budget_gb=1.0, reserve_gb=0.0), run)
    least = max(b.least_bytes for b in loose)
    tight = _budgets(TINY, AutoRecompute(budget_gb=1.3 * least / GIB, reserve_gb=0.0), run)
    assert [b.in_flight for b in tight] == [4, 3, 2, 1]
    assert tight[0].choice.cost > tight[-1].choice.cost
    assert all(b.predicted_peak_bytes <= 1.3 * least for b in tight)


def test_when_none_fits_auto_chooses_no_recompute():
    budgets = _budgets(TINY, AutoRecompute(budget_gb=1.0, reserve_gb=0.0), _tiny_run(2, 6))
    assert all(set(b.choice.choices) == {"none"} for b in budgets)


def _refusal(run: RunShape) -> tuple[float, dict[str, float]]:
    """The smallest budget a too-small one's refusal names, and each setting it says helps, with its figure."""
    with pytest.raises(ValueError) as error:
        _budgets(TINY, AutoRecompute(budget_gb=0.001, reserve_gb=0.0), run)
    message = str(error.value)
    assert "recompute.budget_gb=0.001 does not fit stage 0" in message
    smallest = float(message.split("the smallest budget that fits every stage is recompute.budget_gb=")[1].split()[0])
    helps = message.split("the smallest budget the planner finds with it): ")[1].split(", ")
    return smallest, {setting: float(gb) for setting, gb in (h.split(" fits at ") for h in helps)}


def test_nothing_fits_names_the_smallest_budget_and_each_setting_that_lowers_it_priced_by_the_planner():
    run = _tiny_run(2, 6)
    smallest, helps = _refusal(run)
    _budgets(TINY, AutoRecompute(budget_gb=smallest, reserve_gb=0.0), run)
    # bf16 is left out: on CPU the planner counts more for its optimizer step (one flat fp32 copy of the stage's
    # parameters, stepped at once) than its activations save at this size
    assert list(helps) == [
        "parallel.pipeline_stages=4",
        "train.micro_batch_size=1",
        "parallel.zero_stage=1 with parallel.data_parallel_size=2",
        "recompute.compress=fp8 (lossy)",
    ]
    assert all(gb < smallest for gb in helps.values())
    lossy = AutoRecompute(budget_gb=helps["recompute.compress=fp8 (lossy)"], reserve_gb=0.0, compress="fp8")
    assert any(b.choice.compress == "fp8" for b in _budgets(TINY, lossy, run))
    more_stages = RunShape(Topology(4), run.target, run.micro_batches, run.micro_batch_size)
    _budgets(TINY, AutoRecompute(budget_gb=helps["parallel.pipeline_stages=4"], reserve_gb=0.0), more_stages)
    with pytest.raises(ValueError):
        less = helps["parallel.pipeline_stages=4"] - 0.0001
        _budgets(TINY, AutoRecompute(budget_gb=less, reserve_gb=0.0), more_stages)


def test_the_refusal_leaves_out_what_is_already_set():
    bf16 = RunShape(Topology(2), Target("cpu", "bf16"), micro_batches=6, micro_batch_size=1)
    _, helps = _refusal(bf16)
    # bf16's optimizer already shards over data-parallel ranks: more of them help, ZeRO-1 would change nothing
    assert list(helps) == ["parallel.pipeline_stages=4", "parallel.data_parallel_size=2"]


def test_uniform_modes_keep_their_own_layout():
    layout = build_layout(TINY, SelectiveRecompute(), _tiny_run(2, 6), "type:Block", 0)
    assert layout.budgets is None and layout.plans[0].selective


def test_gpt3_175b_on_16_stages_plans_in_seconds():
    gpt3 = GPTConfig(n_layer=96, n_head=96, n_embd=12288, seq_len=2048, vocab_size=50257, dropout=0.1, attention="math")
    run = RunShape(Topology(16, 64), Target("cuda", "bf16"), micro_batches=32, micro_batch_size=1, zero_stage=1)
    start = time.process_time()  # CPU seconds: load stretches the wall time, not the planner's work
    # 82 GiB: the first stage's working set alone is ~4.5 GiB (math attention's softmax backward in fp32 at s=2048)
    budgets = _budgets(gpt3, AutoRecompute(budget_gb=82.0), run)
    assert time.process_time() - start < 10
    assert all(b.predicted_peak_bytes <= 80 * GIB for b in budgets)

    assert budgets[0].choice.cost >= budgets[-1].choice.cost


def test_analytic_costs_rank_choices_sensibly():
    table = analytic_prices(Shape.of(TINY, 2), Target("cpu", "fp32"))
    by_name = {o.choice: o for o in table.options}
    assert by_name["none"].cost == 0
    assert by_name["selective:core_attn"].kept_bytes < by_name["none"].kept_bytes
    assert 0 < by_name["selective:core_attn"].cost < table.full_block_cost


AUTO_RUN = [*RUN_TINY, "model.attention=math", "model.dropout=0.1", "train.micro_batches=6", "train.steps=2"]
AUTO_RUN += ["train.trace_step=0", "logger=none"]
# Between what uniform full and uniform selective need on stage 0 (dry runs of this shape).
AUTO_ARGS = ["+recompute=auto", "recompute.budget_gb=0.0135", "recompute.reserve_gb=0"]
CASES = {
    "auto": case(*AUTO_RUN, *AUTO_ARGS),
    "none": case(*AUTO_RUN),
}


@pytest.mark.multiproc
def test_auto_run_applies_a_per_stage_plan_exact_against_none(case_runs, shared_runs):
    none = summary(case_runs["none"])
    output = shared_runs.case_output()
    # the test session caches no device profile (tests/conftest.py): the plan says it is analytic
    assert "stagecheck: costs: analytic: no device profile of this device at " in output
    auto = summary(case_runs["auto"])
    assert auto["step_time_costs"] == "analytic" and auto["cost_source"]["kind"] == "analytic"
    choices = [stage["choices"] for stage in auto["layout"]]
    assert choices[0] != choices[1] and any(c != "none" for c in choices[0])
    assert auto["losses"] == none["losses"]
    # exact: the meter counts the bytes each saved tensor holds, the plan the same tensors (it was within 5%)
    assert auto["activation_bytes_per_stage"] == auto["planned_activation_bytes_per_stage"]
    assert all(peak <= 0.0135 * GIB for peak in auto["predicted_peak_bytes_per_stage"])
    assert auto["predicted_step_time_s"] > 0  # the simulated step of the plan, beside the measured one
