"""A run under a schedule with virtual stages, as start-up plans it (no process group): its layout of ranks x v
virtual stages (v chunks per rank: parallel.chunks, or the planner's choice), each rank's planned peak and simulated
step, parallel.schedule=auto's choice of one, and the start-up refusals (what the engine does not run, a resume that
would move layers to other ranks), each one line."""

import itertools
import math
from dataclasses import replace

import pytest

from model import BLOCK_CLASSES, GPTConfig
from parallel.planning.budget_refusal import BudgetTooSmall
from parallel.planning.chunk_candidates import chunk_side
from parallel.planning.config import AutoRecompute, FullRecompute, NoRecompute, SelectiveRecompute
from parallel.planning.layout import build_layout
from parallel.planning.run_plan import plan_run
from parallel.planning.shapes import GIB, RunShape, Shape, Target, Topology
from parallel.planning.stage_planner import StagePlanner
from parallel.planning.stage_price import StagePricing
from parallel.planning.virtual_auto import RankPeak
from parallel.planning.virtual_choice import virtual_options
from parallel.planning.virtual_layout import (
    faster_virtual_schedule,
    virtual_layout,
    virtual_plan,
    virtual_shape,
    with_virtual_plan,
)
from parallel.planning.virtual_memory import chunks_in_flight, rank_walks
from parallel.planning.virtual_plan import VirtualPlan
from parallel.planning.virtual_program import VIRTUAL_SCHEDULES
from parallel.planning.virtual_support import schedule_change_refusal, virtual_run_refusal

MODEL = GPTConfig(n_layer=8, n_head=4, n_embd=64, seq_len=32, vocab_size=256, dropout=0.1)
RUN = RunShape(Topology(2, 1), Target("cpu", "fp32"), 4, 2)
NO = (None, None, None)
"""virtual_layout's costs, rates and held parts: analytic prices, a fresh run."""


@pytest.mark.parametrize("schedule", VIRTUAL_SCHEDULES)
@pytest.mark.parametrize("method", ["balanced", "type:Block"])
def test_a_virtual_run_plans_ranks_times_two_virtual_stages_and_each_ranks_peak(schedule, method):
    layout = virtual_layout(MODEL, SelectiveRecompute(), RUN, method, 0, schedule, *NO, chunks=2)
    assert len(layout.stages) == 4 and layout.parts[0] == 0 and layout.parts[-1] == len(layout.recipes)
    assert all(any(layout.recipes[i].module_class in BLOCK_CLASSES for i in s.layers) for s in layout.stages)
    virtual = virtual_plan(MODEL, layout, RUN, schedule)
    placed = [[0, 2], [1, 3]] if schedule == "interleaved-1f1b" else [[0, 3], [1, 2]]
    assert [list(stages) for stages in virtual.virtual_stages_per_rank] == placed
    assert all(b > 0 for b in virtual.activation_bytes_per_rank) and virtual.predicted_step_time_s > 0
    plan = with_virtual_plan(plan_run(MODEL, SelectiveRecompute(), layout, virtual_shape(RUN)), virtual, RUN)
    assert (plan.pipeline_stages, plan.world_size, len(plan.stages)) == (2, 2, 4)
    assert plan.step_time is None  # 1F1B over the virtual stages is not the schedule's step
    assert VirtualPlan.from_json(plan.to_json()["virtual"]) == virtual
    assert len(virtual.lines()) == 3


def test_a_resumed_layout_keeps_the_checkpoints_chunk_boundaries_and_with_them_its_chunks_per_rank():
    held = [0, 3, 5, 6, 11]
    layout = virtual_layout(MODEL, NoRecompute(), RUN, "balanced", 0, "zb-v", None, None, held)
    assert layout.parts == held and layout.virtual_chunks == 2
    held = [0, 3, 4, 5, 6, 8, 11]
    layout = virtual_layout(MODEL, NoRecompute(), RUN, "balanced", 0, "interleaved-1f1b", None, None, held)
    assert layout.parts == held and layout.virtual_chunks == 3


def test_interleaved_1f1b_runs_the_chunks_per_rank_that_simulate_fastest_or_those_parallel_chunks_names():
    """parallel.chunks=null: of 2, 3 and 4 chunks per rank (8 blocks on 2 ranks allow 4), the count whose simulated
    step (each on its own chunk boundaries) is the shortest; the rank's chunks placed r, r + p, r + 2p, ...; a V holds
    2 whatever the blocks allow."""
    one_chunk = build_layout(MODEL, NoRecompute(), RUN, "balanced", 0)
    options = virtual_options(MODEL, NoRecompute(), one_chunk, RUN, ("interleaved-1f1b",))
    assert [o.chunks for o in options] == [2, 3, 4]
    assert all(len(o.blocks) == 2 * o.chunks and sum(o.blocks) == MODEL.n_layer for o in options)
    fastest = min(options, key=lambda o: o.step_time_s)
    for method in ("balanced", "type:Block"):
        layout = virtual_layout(MODEL, NoRecompute(), RUN, method, 0, "interleaved-1f1b", *NO)
        assert layout.virtual_chunks == fastest.chunks and len(layout.stages) == 2 * fastest.chunks
    named = virtual_layout(MODEL, NoRecompute(), RUN, "balanced", 0, "interleaved-1f1b", *NO, chunks=3)
    assert named.virtual_chunks == 3 and len(named.stages) == 6
    virtual = virtual_plan(MODEL, named, RUN, "interleaved-1f1b")
    assert [list(s) for s in virtual.virtual_stages_per_rank] == [[0, 2, 4], [1, 3, 5]]
    assert virtual.chunks == 3 and virtual.predicted_step_time_s == min(o.step_time_s for o in options if o.chunks == 3)
    assert [o.chunks for o in virtual_options(MODEL, NoRecompute(), one_chunk, RUN, ("zb-v", "v-half"))] == [2, 2]


def test_a_resume_may_change_the_schedule_only_where_the_layers_stay_on_their_ranks():
    assert schedule_change_refusal("1f1b", "zb-h1") is None
    assert schedule_change_refusal("zb-v", "v-half") is None
    assert schedule_change_refusal("auto", "1f1b") is None
    for saved, new in [("1f1b", "interleaved-1f1b"), ("zb-v", "interleaved-1f1b"), ("v-half", "1f1b")]:
        line = schedule_change_refusal(saved, new)
        assert line and "\n" not in line and f"parallel.schedule={new}" in line and saved in line


def test_what_train_py_does_not_run_under_a_virtual_schedule_is_refused_in_one_line():
    def refusal(schedule="zb-v", recompute=None, precision="fp32", micro_batches=4, ranks=2, blocks=8, chunks=None):
        return virtual_run_refusal(
            schedule, recompute or NoRecompute(), precision, 0, micro_batches, ranks, blocks, chunks
        )

    assert refusal() is None and refusal(schedule="interleaved-1f1b", micro_batches=4) is None
    assert refusal(recompute=AutoRecompute()) is None  # auto is planned per rank (parallel/planning/virtual_auto.py)
    assert refusal(precision="bf16") is None  # DeepSpeed's BF16_Optimizer, as its pipelines use it
    assert refusal(recompute=AutoRecompute(early=True)) is None  # auto per chunk recomputes early where asked
    refusals = {
        "train.precision=fp16": refusal(precision="fp16"),
        "model.n_layer=3": refusal(blocks=3),
        "train.micro_batches=5": refusal(schedule="interleaved-1f1b", micro_batches=5),
        "parallel.chunks=null": refusal(schedule="interleaved-1f1b", chunks=5),  # 10 chunks, 8 blocks
        "parallel.chunks=3": refusal(chunks=3),  # a V: under parallel.schedule=auto, its V shapes are left out
    }
    for option, line in refusals.items():
        assert line and "\n" not in line, option
    assert "model.n_layer=3" in refusals["model.n_layer=3"]
    assert "train.micro_batches=5" in refusals["train.micro_batches=5"]
    assert all(option in line for option, line in refusals.items() if option.startswith("parallel.chunks"))


GPT2_16 = GPTConfig(n_layer=16, n_head=12, n_embd=768, seq_len=1024, vocab_size=50304)


def _auto(model: GPTConfig, ranks: int, micro_batches: int, precision: str = "fp32", recompute=None, chunks=None):
    run = RunShape(Topology(ranks, 1), Target("cuda", precision), micro_batches, 1)
    one_chunk = build_layout(model, NoRecompute(), run, "balanced", 0, schedule="auto")
    chosen = faster_virtual_schedule(model, recompute or NoRecompute(), one_chunk, run, 0, chunks)
    return one_chunk, chosen and (chosen.schedule, chosen.chunks)


def test_auto_picks_a_virtual_schedule_only_where_it_simulates_faster_than_1f1b_and_zb_h1():
    """Analytic H100 costs, fp32, no recompute: 2 ranks x 2 micro-batches idle most of a 1F1B step, and ZB-V's V fills
    it; with 8 micro-batches the chunks' boundaries cost more than the bubble they save."""
    one_chunk, chosen = _auto(GPT2_16, 2, 2)
    assert chosen == ("zb-v", 2)
    steps = {o.schedule: o.step_time_s for o in one_chunk.schedule_options if not o.early}
    run = RunShape(Topology(2, 1), Target("cuda", "fp32"), 2, 1)
    virtual = {o.schedule: o.step_time_s for o in virtual_options(GPT2_16, NoRecompute(), one_chunk, run)}
    assert virtual["zb-v"] == min(virtual.values()) < min(steps.values())
    assert _auto(GPT2_16, 2, 8)[1] is None


def test_auto_leaves_out_the_virtual_schedules_where_the_run_cannot_run_them():
    assert _auto(GPT2_16, 2, 2, precision="fp16")[1] is None  # the virtual engine runs fp32 and bf16 only
    assert _auto(GPT2_16, 2, 2, precision="bf16")[1] == ("zb-v", 2)
    assert _auto(GPT2_16, 2, 2, recompute=AutoRecompute(early=True))[1] == ("zb-v", 2)  # early per chunk
    assert _auto(replace(GPT2_16, n_layer=3), 2, 2)[1] is None  # fewer blocks than chunks


def test_auto_with_parallel_chunks_weighs_interleaved_1f1b_at_that_many_chunks_and_no_v():
    """GPT-2 XL's width, 48 blocks on 4 ranks x 4 micro-batches, bf16 on analytic H100 prices: ZB-V simulates fastest,
    and with parallel.chunks=3 (no V holds 3) interleaved 1F1B at 3 chunks per rank, faster than 1F1B and zb-h1."""
    xl = GPTConfig(n_layer=48, n_head=25, n_embd=1600, seq_len=1024, vocab_size=50304)
    assert _auto(xl, 4, 4, "bf16")[1] == ("zb-v", 2)
    assert _auto(xl, 4, 4, "bf16", chunks=3)[1] == ("interleaved-1f1b", 3)


def test_a_resume_under_auto_keeps_the_checkpoints_placement():
    assert schedule_change_refusal("zb-v", "auto") is None and schedule_change_refusal("1f1b", "auto") is None


PLACEMENTS = [(schedule, 2) for schedule in VIRTUAL_SCHEDULES] + [("interleaved-1f1b", 3)]
"""Each schedule with virtual stages and its chunks per rank, for auto per chunk's brute-force checks."""


def _auto_layout(schedule: str, budget_bytes: float, chunks: int = 2):
    # without early recompute: what each candidate holds is then its classes' (early: tests/test_virtual_local.py)
    auto = AutoRecompute(budget_gb=budget_bytes / GIB, reserve_gb=0.0, early=False)
    return virtual_layout(MODEL, auto, RUN, "type:Block", 0, schedule, *NO, chunks=chunks), auto


def _rank_peaks(layout, auto: AutoRecompute, schedule: str) -> list[RankPeak]:
    """Each rank's RankPeak as virtual_auto.plan_ranks builds it for `layout`'s virtual stages."""
    shape = Shape.of(MODEL, RUN.micro_batch_size)
    chunks = layout.virtual_chunks
    pricing = StagePricing.of(layout.recipes, virtual_shape(RUN, chunks), shape, layout.timing)
    planner = StagePlanner(pricing, auto, layout.timing.table)
    walks = rank_walks(layout.recipes, layout.stages, schedule, chunks, RUN.micro_batches, shape, RUN.target)
    sides = [[chunk_side(planner, layout.stages[v], w.split) for v in w.virtual_stages] for w in walks]
    run = planner.pricing.run
    return [RankPeak(w, chunk_sides, run, auto.per_micro_batch) for w, chunk_sides in zip(walks, sides)]


@pytest.mark.parametrize("schedule, chunks", PLACEMENTS)
def test_auto_per_chunk_fits_each_ranks_peak_at_the_least_recompute_of_any_combination(schedule, chunks):
    """Between the largest rank floor and none's largest rank peak: every rank's walked peak within the budget, some
    chunk recomputing, no combination of the chunks' candidates (brute force) cheaper, and the planner's peak at
    least what the rank plan (virtual_plan) reports."""
    unbounded, _ = _auto_layout(schedule, 1e12, chunks)
    assert all(not (p.segments or p.selective) for p in unbounded.plans)
    floor = max(b.least_bytes for b in unbounded.rank_budgets)
    none = max(b.peak_bytes for b in unbounded.rank_budgets)
    budget = (floor + none) // 2
    layout, auto = _auto_layout(schedule, budget, chunks)
    assert any(p.segments or p.selective for p in layout.plans)
    assert all(b.peak_bytes <= budget for b in layout.rank_budgets)
    activations = virtual_plan(MODEL, layout, RUN, schedule).activation_bytes_per_rank
    for b, peak, planned in zip(layout.rank_budgets, _rank_peaks(layout, auto, schedule), activations):
        # the plan walks each backward's working set inside it; auto bounds it by the largest chunk's on top of the
        # walk between instructions
        walked = peak.activation_bytes(b.choice)
        assert walked < planned <= walked + max(side.work(c) for side, c in zip(peak.sides, b.choice))
        assert peak.bytes(b.choice) == b.peak_bytes
        assert sum(c.cost for c in b.choice) == _cheapest_fitting(peak, budget, (False,) * chunks)


@pytest.mark.parametrize("schedule, chunks", PLACEMENTS)
@pytest.mark.parametrize("early", [True, None])
def test_auto_per_chunk_recomputing_early_fits_at_the_least_recompute_of_any_combination(schedule, chunks, early):
    """recompute.early=true (every chunk that recomputes does it early, but the last virtual stage) and null (early
    where that costs no more): the chosen combination is the cheapest of every one that fits (brute force over
    RankPeak.bytes), though recomputed early a choice's backward holds more the less it keeps."""
    unbounded, _ = _auto_layout(schedule, 1e12, chunks)
    floor = max(b.least_bytes for b in unbounded.rank_budgets)
    none = max(b.peak_bytes for b in unbounded.rank_budgets)
    for budget in (int(floor + (none - floor) * f) for f in (0.3, 0.6, 0.9)):
        _check_cheapest_combinations(schedule, chunks, budget, early)


def _check_cheapest_combinations(schedule: str, chunks: int, budget: int, early: bool | None) -> None:
    auto = AutoRecompute(budget_gb=budget / GIB, reserve_gb=0.0, early=early)
    layout = virtual_layout(MODEL, auto, RUN, "type:Block", 0, schedule, *NO, chunks=chunks)
    for b, peak in zip(layout.rank_budgets, _rank_peaks(layout, auto, schedule)):
        flags = tuple(v < len(layout.stages) - 1 for v in peak.walk.virtual_stages)
        wanted = _cheapest_fitting(peak, budget, flags)
        if not early:
            wanted = min(wanted, _cheapest_fitting(peak, budget, (False,) * chunks))
        assert sum(c.cost for c in b.choice) == wanted and b.peak_bytes <= budget


def _cheapest_fitting(peak: RankPeak, budget: int, early: tuple[bool, ...]) -> float:
    """The least summed cost of any combination of the rank's chunks' choices (one each) whose RankPeak.bytes fits
    (brute force)."""
    combinations = itertools.product(*(side.choices for side in peak.sides))
    return min(
        (sum(c.cost for c in combo) for combo in combinations if peak.bytes(combo, early=early) <= budget),
        default=math.inf,
    )


@pytest.mark.parametrize("schedule", VIRTUAL_SCHEDULES)
def test_recomputing_for_one_micro_batch_counts_it_among_those_its_chunk_holds(schedule):
    """recompute.micro_batches=1 under a schedule with virtual stages: each chunk recomputes 1 of the micro-batches it
    holds at once (its walk's most, not a 1F1B stage's), so every rank's peak holds one recomputed micro-batch of each
    chunk that holds more than one, and falls below none's."""
    run = replace(RUN, micro_batches=8)
    once = FullRecompute(interval="1", micro_batches=1)
    layout = virtual_layout(MODEL, once, run, "type:Block", 0, schedule, *NO, chunks=2)
    none = virtual_layout(MODEL, NoRecompute(), run, "type:Block", 0, schedule, *NO, chunks=2)
    most = chunks_in_flight(schedule, 2, 2, run.micro_batches, layout.virtual_slots)
    assert [p.in_flight for p in layout.plans] == list(most) and max(most) > 1
    peaks = virtual_plan(MODEL, layout, run, schedule).activation_bytes_per_rank
    plain = virtual_plan(MODEL, none, run, schedule).activation_bytes_per_rank
    assert all(p < n for p, n in zip(peaks, plain)), (peaks, plain)


@pytest.mark.parametrize("schedule", VIRTUAL_SCHEDULES)
def test_the_dry_runs_figures_of_a_plan_for_some_micro_batches_are_those_of_the_layout_it_trains(schedule):
    """recompute.micro_batches=1: the schedule's option the dry run (and parallel.schedule=auto) prices counts the
    micro-batches each chunk recomputes as the trained layout does, from those the chunk holds at once: the same
    simulated step and rank peaks."""
    run = replace(RUN, micro_batches=8)
    once = FullRecompute(interval="1", micro_batches=1)
    one_chunk = build_layout(MODEL, once, run, "balanced", 0, None, None)
    (option,) = virtual_options(MODEL, once, one_chunk, run, (schedule,), chunks=2)
    layout = virtual_layout(MODEL, once, run, "balanced", 0, schedule, *NO, chunks=2)
    planned = virtual_plan(MODEL, layout, run, schedule)
    assert (option.step_time_s, option.activation_bytes) == (
        planned.predicted_step_time_s,
        planned.activation_bytes_per_rank,
    )


@pytest.mark.parametrize("schedule", VIRTUAL_SCHEDULES)
def test_auto_per_chunk_recomputing_for_some_micro_batches_fits_at_the_least_recompute_of_any_combination(schedule):
    """recompute.per_micro_batch=true: each chunk may also run a plan for k of its in-flight micro-batches (the others
    keep none's bytes). At four budgets the choice costs the least of every combination whose peak fits (brute force
    over RankPeak.bytes, each candidate's cost its share of the step), the plan the run trains (walked with each
    micro-batch's own bytes) fits, and where a chunk recomputes for some micro-batches the rank recomputes no more than
    without (less at some budget)."""
    unbounded, _ = _auto_layout(schedule, 1e12)
    floor = max(b.least_bytes for b in unbounded.rank_budgets)
    none = max(b.peak_bytes for b in unbounded.rank_budgets)
    some = []
    for budget in (int(floor + (none - floor) * f) for f in (0.2, 0.5, 0.8, 0.95)):
        auto = AutoRecompute(budget_gb=budget / GIB, reserve_gb=0.0, early=False, per_micro_batch=True)
        layout = virtual_layout(MODEL, auto, RUN, "type:Block", 0, schedule, *NO, chunks=2)
        planned = virtual_plan(MODEL, layout, RUN, schedule)
        for b, peak, activations, states in zip(
            layout.rank_budgets,
            _rank_peaks(layout, auto, schedule),
            planned.activation_bytes_per_rank,
            planned.state_bytes_per_rank,
        ):
            # every candidate, none left out as beaten (RankPeak.candidates leaves those out)
            most = peak.walk.moments.most_in_flight
            candidates = [
                s.candidates(False) + s.some_micro_batches(n, RUN.micro_batches) for s, n in zip(peak.sides, most)
            ]
            combinations = itertools.product(*(zip(c.choices, c.cost) for c in candidates))
            least = min(
                sum(cost for _, cost in combo) for combo in combinations if peak.bytes([c for c, _ in combo]) <= budget
            )
            chosen = {c: cost for cs in candidates for c, cost in zip(cs.choices, cs.cost)}
            assert math.isclose(sum(chosen[c] for c in b.choice), least) and b.peak_bytes <= budget
            assert activations + states <= b.peak_bytes
            for v, most in zip(peak.walk.virtual_stages, peak.walk.moments.most_in_flight):
                # the micro-batches it recomputes counted from as many as the chunk holds at once
                assert layout.plans[v].micro_batches is None or layout.plans[v].in_flight == most
            if any(c.micro_batches for c in b.choice):
                whole, _ = _auto_layout(schedule, budget)
                without = next(w for w in whole.rank_budgets if w.stage == b.stage)
                some.append((sum(chosen[c] for c in b.choice), sum(c.cost for c in without.choice)))
    assert some and all(a <= b for a, b in some) and any(a < b for a, b in some), some


@pytest.mark.parametrize("schedule", VIRTUAL_SCHEDULES)
def test_auto_per_chunks_rank_plan_fits_its_budget_under_the_schedules_own_backward(schedule):
    """The planned rank peak virtual_plan reports (activations walked with each backward's working set inside it, and
    the states) is within the budget auto fitted, at the tiny model's width, where a split backward's B holds
    much more than 1F1B's (each Linear's input and output gradient kept for its W)."""
    model = GPTConfig()
    unbounded = virtual_layout(model, AutoRecompute(budget_gb=1e3, early=False), RUN, "type:Block", 0, schedule, *NO)
    floor = max(b.least_bytes for b in unbounded.rank_budgets)
    none = max(b.peak_bytes for b in unbounded.rank_budgets)
    for budget in (floor + (none - floor) * f for f in (0.1, 0.5, 0.9)):
        auto = AutoRecompute(budget_gb=budget / GIB, reserve_gb=0.0, early=False)
        layout = virtual_layout(model, auto, RUN, "type:Block", 0, schedule, *NO)
        planned = virtual_plan(model, layout, RUN, schedule)
        for activations, states in zip(planned.activation_bytes_per_rank, planned.state_bytes_per_rank):
            assert activations + states <= budget


def test_auto_per_chunk_refuses_a_budget_below_a_ranks_floor_in_one_line():
    unbounded, _ = _auto_layout("zb-v", 1e12)
    floor = max(b.least_bytes for b in unbounded.rank_budgets)
    with pytest.raises(BudgetTooSmall) as refused:
        _auto_layout("zb-v", floor - 1024)
    line = str(refused.value)
    assert "\n" not in line and line.startswith("recompute.budget_gb=") and "does not fit rank" in line
    assert f"recompute.budget_gb={refused.value.smallest_gb:g}" in line
    layout, _ = _auto_layout("zb-v", refused.value.smallest_gb * GIB)  # the budget it names fits
    assert all(b.peak_bytes <= refused.value.smallest_gb * GIB for b in layout.rank_budgets)


def test_auto_under_auto_recompute_prices_the_virtual_schedules_with_each_ranks_chunks_planned():
    """parallel.schedule=auto with +recompute=auto: the virtual schedules are candidates, planned per rank; at a
    budget no plan needs to recompute under, the choice is none's."""
    assert _auto(GPT2_16, 2, 2, recompute=AutoRecompute())[1] == _auto(GPT2_16, 2, 2)[1] == ("zb-v", 2)


def test_the_dry_runs_figures_of_auto_per_chunk_are_those_of_the_layout_it_trains_early_recompute_included():
    """recompute.early=null: at GPT-2's shape on an H100 in fp32 (analytic prices) auto recomputes V-Half's first
    chunk early, which shortens the simulated step. The dry run's step and rank peaks (virtual_options, which
    `balanced` and parallel.schedule=auto read) price the programmes and plans the run trains (virtual_layout,
    virtual_plan)."""
    model = replace(GPT2_16, n_layer=12)
    run = RunShape(Topology(2, 1), Target("cuda", "fp32"), 8, 1)
    never = AutoRecompute(budget_gb=1e3, reserve_gb=0.0, early=False)
    unbounded = virtual_layout(model, never, run, "type:Block", 0, "v-half", None, None, None)
    floor = max(b.least_bytes for b in unbounded.rank_budgets)
    none = max(b.peak_bytes for b in unbounded.rank_budgets)
    auto = AutoRecompute(budget_gb=(floor + none) / 2 / GIB, reserve_gb=0.0, early=None)
    layout = virtual_layout(model, auto, run, "balanced", 0, "v-half", None, None, None)
    planned = virtual_plan(model, layout, run, "v-half")
    late = virtual_plan(model, replace(layout, plans=[replace(p, early=False) for p in layout.plans]), run, "v-half")
    assert planned.predicted_step_time_s < late.predicted_step_time_s  # early recompute matters here
    one_chunk = build_layout(model, NoRecompute(), run, "balanced", 0, None, None)
    (option,) = virtual_options(model, auto, one_chunk, run, ("v-half",))
    assert (option.step_time_s, option.activation_bytes) == (
        planned.predicted_step_time_s,
        planned.activation_bytes_per_rank,
    )
