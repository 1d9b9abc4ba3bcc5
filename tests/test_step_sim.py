"""The step-time simulator replays DeepSpeed's own TrainSchedule (and parallel/planning/schedules.py's ZB-H1 and
early recompute): checked against a timeline worked out by hand, for every instruction's presence and order on
bigger shapes, and against a traced run's own costs (the per-stage costs it is fed: tests/test_instruction_seconds.py);
and the lower bound no schedule beats."""

import dataclasses
import json

import pytest

from harness.bubbles import stage_times
from harness.timeline import COLOURS, chrome_trace, render_timeline, schedule_name
from model import GPTConfig
from parallel.measurement.trace import Interval as TraceInterval
from parallel.measurement.trace import RankTrace, StepTrace
from parallel.planning.config import AutoRecompute, FullRecompute, NoRecompute, SelectiveRecompute
from parallel.planning.layout import build_layout
from parallel.planning.schedules import SCHEDULES
from parallel.planning.shapes import RunShape, Shape, Target, Topology
from parallel.planning.step_sim import (
    COMPUTE,
    PER_STEP,
    StageCosts,
    instructions,
    lower_bound_s,
    simulate,
    simulate_stages,
)
from parallel.planning.weight_grad_bytes import stage_weight_grad_bytes
from tests.runs import TINY, python_run
from tests.shared_runs import case
from tests.test_instruction_seconds import layout_costs

# Synthetic seconds: stage 0 is the slow one (forward 2, backward 3), stage 1 forward 1, backward 2.
COSTS = {
    0: {"ForwardPass": 2.0, "BackwardPass": 3.0, "OptimizerStep": 1.0},
    1: {"ForwardPass": 1.0, "BackwardPass": 2.0, "OptimizerStep": 0.5},
}
SHARED = {
    "LoadMicroBatch": 0.25,
    "SendActivation": 0.5,
    "RecvActivation": 0.5,
    "SendGrad": 0.5,
    "RecvGrad": 0.5,
    "ReduceTiedGrads": 0.25,
    "ReduceGrads": 0.125,
}


def synthetic(ins) -> float:
    return COSTS[ins.stage].get(ins.name, SHARED.get(ins.name))


# Worked out by hand from DeepSpeed's 2-stage, 3-micro-batch TrainSchedule: (instruction, micro-batch,
# posted, start, end). A send and its recv start together when the later side arrives; stage 0 sends
# micro-batch 1's activation only after it has received micro-batch 0's gradient (DeepSpeed's order).
STAGE_0 = [
    ("LoadMicroBatch", 0, 0.0, 0.0, 0.25),
    ("ForwardPass", 0, 0.25, 0.25, 2.25),
    ("SendActivation", 0, 2.25, 2.25, 2.75),
    ("LoadMicroBatch", 1, 2.75, 2.75, 3.0),
    ("ForwardPass", 1, 3.0, 3.0, 5.0),
    ("RecvGrad", 0, 5.0, 6.0, 6.5),  # stage 1 sends it at 6.0, after its backward of micro-batch 0
    ("SendActivation", 1, 6.5, 6.5, 7.0),
    ("BackwardPass", 0, 7.0, 7.0, 10.0),
    ("LoadMicroBatch", 2, 10.0, 10.0, 10.25),
    ("ForwardPass", 2, 10.25, 10.25, 12.25),
    ("RecvGrad", 1, 12.25, 12.25, 12.75),
    ("SendActivation", 2, 12.75, 12.75, 13.25),
    ("BackwardPass", 1, 13.25, 13.25, 16.25),
    ("RecvGrad", 2, 16.25, 16.5, 17.0),
    ("BackwardPass", 2, 17.0, 17.0, 20.0),
    ("ReduceTiedGrads", None, 20.0, 20.0, 20.25),
    ("ReduceGrads", None, 20.25, 20.25, 20.375),
    ("OptimizerStep", None, 20.375, 20.375, 21.375),
]
STAGE_1 = [
    ("RecvActivation", 0, 0.0, 2.25, 2.75),
    ("LoadMicroBatch", 0, 2.75, 2.75, 3.0),
    ("ForwardPass", 0, 3.0, 3.0, 4.0),
    ("BackwardPass", 0, 4.0, 4.0, 6.0),
    ("SendGrad", 0, 6.0, 6.0, 6.5),
    ("RecvActivation", 1, 6.5, 6.5, 7.0),
    ("LoadMicroBatch", 1, 7.0, 7.0, 7.25),
    ("ForwardPass", 1, 7.25, 7.25, 8.25),
    ("BackwardPass", 1, 8.25, 8.25, 10.25),
    ("SendGrad", 1, 10.25, 12.25, 12.75),  # stage 0 is busy with its forward of micro-batch 2 until 12.25
    ("RecvActivation", 2, 12.75, 12.75, 13.25),
    ("LoadMicroBatch", 2, 13.25, 13.25, 13.5),
    ("ForwardPass", 2, 13.5, 13.5, 14.5),
    ("BackwardPass", 2, 14.5, 14.5, 16.5),
    ("SendGrad", 2, 16.5, 16.5, 17.0),
    ("ReduceTiedGrads", None, 17.0, 20.0, 20.25),  # waits for stage 0's last backward
    ("ReduceGrads", None, 20.25, 20.25, 20.375),
    ("OptimizerStep", None, 20.375, 20.375, 20.875),
]


def test_two_stage_1f1b_matches_the_hand_computed_timeline_exactly():
    timeline = simulate(micro_batches=3, stages=2, cost=synthetic)
    for stage, expected in [(0, STAGE_0), (1, STAGE_1)]:
        got = [
            (i.instruction.name, i.instruction.micro_batch, i.posted_s, i.start_s, i.end_s)
            for i in timeline.of_stage(stage)
        ]
        assert got == expected, f"stage {stage}"
    assert timeline.step_time_s == 21.375
    # Busy (as a traced run counts it): loads 0.75, forward, backward, optimizer; transfers and reduces idle.
    assert timeline.busy_s(0) == 0.75 + 6 + 9 + 1
    assert timeline.busy_s(1) == 0.75 + 3 + 6 + 0.5
    assert timeline.idle_s(0) == 4.625 and timeline.idle_s(1) == 11.125


def test_an_untied_lm_heads_reduce_tied_grads_meets_no_one():
    """Without tied weights (an untied LM head, Llama's) ReduceTiedGrads is no collective: stage 1 runs it at 17.0,
    where it waited for stage 0's last backward until 20.0 when tied."""
    timeline = simulate(micro_batches=3, stages=2, cost=synthetic, tied=False)
    reduce = next(i for i in timeline.of_stage(1) if i.instruction.name == "ReduceTiedGrads")
    assert (reduce.start_s, reduce.end_s) == (17.0, 17.25)
    assert timeline.step_time_s == 21.375  # stage 0's own end still sets the step


def test_one_stage_is_the_sum_of_its_costs():
    timeline = simulate(micro_batches=4, stages=1, cost=lambda ins: 1.0 + (ins.micro_batch or 0))
    expected = sum(1.0 + (i.micro_batch or 0) for i in instructions(4, 1, 0))
    communication = sum(1.0 + (i.micro_batch or 0) for i in instructions(4, 1, 0) if i.name not in COMPUTE)
    assert timeline.step_time_s == expected and timeline.idle_s(0) == communication == 2.0  # the two reduces


@pytest.mark.parametrize("stages, micro_batches", [(4, 8), (8, 4), (8, 16), (3, 1)])
def test_every_instruction_runs_once_in_schedule_order_without_overlap(stages, micro_batches):
    timeline = simulate(micro_batches, stages, cost=lambda ins: 1.0 + 0.1 * ins.stage)
    for stage in range(stages):
        intervals = timeline.of_stage(stage)
        assert tuple(i.instruction for i in intervals) == instructions(micro_batches, stages, stage)
        # A stage reaches each instruction when the previous one ends; a rendezvous may start later.
        assert all(a.end_s == b.posted_s <= b.start_s <= b.end_s for a, b in zip(intervals, intervals[1:]))
        counts = {name: sum(i.instruction.name == name for i in intervals) for name in ("ForwardPass", "BackwardPass")}
        assert counts == {"ForwardPass": micro_batches, "BackwardPass": micro_batches}
        assert sum(i.instruction.name in PER_STEP for i in intervals) == len(PER_STEP)


def test_a_slower_stage_lengthens_the_step_and_idles_the_others():
    def slow_stage(stage):
        return lambda ins: (3.0 if ins.stage == stage else 1.0) if ins.name in ("ForwardPass", "BackwardPass") else 0.0

    base = simulate(8, 4, lambda ins: 1.0 if ins.name in ("ForwardPass", "BackwardPass") else 0.0)
    slowed = simulate(8, 4, slow_stage(2))
    assert slowed.step_time_s > base.step_time_s
    assert slowed.idle_s(2) < min(slowed.idle_s(s) for s in (0, 1, 3))


CASES = {"traced": case(*TINY, "train.steps=3", "train.micro_batches=4", "train.trace_step=3", "logger=none")}


@pytest.mark.multiproc
def test_replaying_a_traced_runs_own_costs_runs_every_instruction_within_its_traced_step(case_runs):
    """The simulator's dependencies are the engine's: fed the traced step's own measured instructions, it replays each
    rank's in the traced order, no shorter than that rank's compute and no longer than the step the engine took. How
    close the replay comes to the step is a figure of bench.step_time_bench (the trace replay), not a test: on a shared
    machine a descheduled rank loses time that no instruction holds."""
    trace = json.loads((case_runs["traced"] / "trace.json").read_text())
    events = [e for e in trace["traceEvents"] if e["ph"] == "X" and e["name"] != "Recompute"]
    # A blocking send or recv's measured seconds include its wait: the simulator takes the shorter side of each
    # rendezvous, so it ends the step no later than the engine (5%: the trace's own bookkeeping).
    measured = {(e["pid"], e["name"], e["args"].get("micro_batch")): e["dur"] / 1e6 for e in events}
    assert len(measured) == len(events)  # one rank per stage: every instruction once
    micro_batches = trace["otherData"]["micro_batches"]
    timeline = simulate(micro_batches, 2, lambda i: measured[(i.stage, i.name, i.micro_batch)])
    for rank in (0, 1):
        traced = sorted((e for e in events if e["pid"] == rank), key=lambda e: e["ts"])
        replayed = [(i.instruction.name, i.instruction.micro_batch) for i in timeline.of_stage(rank)]
        assert replayed == [(e["name"], e["args"].get("micro_batch")) for e in traced]
    compute_s = max(
        sum(s for (stage, name, _), s in measured.items() if stage == rank and name in COMPUTE) for rank in (0, 1)
    )
    step_s = trace["otherData"]["step_time_s"]
    assert compute_s <= timeline.step_time_s <= 1.05 * step_s + trace["otherData"]["clock_skew_s"]


def unit_stage(recompute: float = 0.0) -> StageCosts:
    """Forward 1, backward 2 of which W is 1, free transfers and step work."""
    return StageCosts(1.0, 2.0, recompute, 0.0, 0.0, 0.0, 0.0, 0.0, weight_grad=1.0)


@pytest.mark.parametrize("schedule, early", [(s, e) for s in SCHEDULES for e in (False, True)])
@pytest.mark.parametrize("stages, micro_batches", [(2, 1), (2, 4), (4, 8), (3, 5)])
def test_every_schedule_does_the_same_work_and_none_beats_the_lower_bound(schedule, early, stages, micro_batches):
    costs = [unit_stage(0.25 * s) for s in range(stages)]
    timeline = simulate_stages(costs, micro_batches, schedule, early)
    reference = simulate_stages(costs, micro_batches)
    for s in range(stages):
        assert timeline.busy_s(s) == pytest.approx(reference.busy_s(s))  # B + W = backward; early moves recompute
    assert timeline.step_time_s >= lower_bound_s(costs, micro_batches, early) - 1e-9


def test_early_recompute_leaves_the_backward_of_every_stage_but_the_last():
    seconds = [unit_stage(0.5).by_instruction(early) for early in (False, True)]
    assert seconds[0]["BackwardPass"] == seconds[0]["BackwardInput"] + seconds[0]["BackwardWeight"] == 2.5
    assert seconds[1]["BackwardPass"] == 2.0 and seconds[1]["RecomputeEarly"] == 0.5
    timeline = simulate_stages([unit_stage(0.5)] * 2, 4, "1f1b", early=True)
    last = [i.instruction.name for i in timeline.of_stage(1)]
    assert "RecomputeEarly" not in last
    assert {i.end_s - i.start_s for i in timeline.of_stage(1) if i.instruction.name == "BackwardPass"} == {2.5}


def test_clipping_makes_every_stage_wait_for_the_slowest_before_its_optimizer_step():
    """DeepSpeed clips inside its optimizer step, after an all-reduce of the norm over every stage: with clipping the
    stages step together, once the last has reached its step, each for its own time; without, an early stage steps
    early."""
    costs = [dataclasses.replace(unit_stage(), optimizer=step) for step in (0.5, 2.0, 1.0, 0.5)]
    free, clipped = (simulate_stages(costs, 8, clip_barrier=clip) for clip in (False, True))

    def steps(timeline):
        return [i for s in range(4) for i in timeline.of_stage(s) if i.instruction.name == "OptimizerStep"]

    arrivals = [i.start_s for i in steps(free)]
    assert len(set(arrivals)) > 1  # the stages reach their steps at different times
    assert [i.posted_s for i in steps(clipped)] == arrivals
    assert {i.start_s for i in steps(clipped)} == {max(arrivals)}
    assert [i.end_s - i.start_s for i in steps(clipped)] == [0.5, 2.0, 1.0, 0.5]
    # stage 1 has the longest step and, without clipping, started it before the end stages finished their backward
    assert clipped.step_time_s == max(arrivals) + 2.0 > free.step_time_s


def test_zb_h1_reaches_the_lower_bound_on_two_even_stages():
    """F = B = W = 1: 1F1B's bubble is one F + B + W; ZB-H1's deferred W's leave only stage 1's late start."""
    costs = [unit_stage()] * 2
    assert simulate_stages(costs, 4).step_time_s == 15.0
    assert simulate_stages(costs, 4, "zb-h1").step_time_s == lower_bound_s(costs, 4) == 13.0


def test_the_issues_benchmark_shape_predicts_zb_h1_with_early_recompute_within_5_percent_of_the_bound():
    """2 stages, 8 blocks at n_embd 256 and seq 512, 4 micro-batches, full(stage) recompute (analytic costs):
    the issue's figures, as the planner predicts them."""
    model = GPTConfig(n_layer=8, n_head=8, n_embd=256, seq_len=512, vocab_size=256, dropout=0.1, attention="math")
    run = RunShape(Topology(2), Target("cpu", "fp32"), micro_batches=4, micro_batch_size=1)
    layout = build_layout(model, FullRecompute(interval="stage"), run, "type:Block", 0)
    costs = layout_costs(layout, model, run)
    baseline = simulate_stages(costs, 4).step_time_s
    step = {(s, e): simulate_stages(costs, 4, s, e).step_time_s for s in SCHEDULES for e in (False, True)}
    assert step[("zb-h1", True)] < min(step[("zb-h1", False)], step[("1f1b", True)]) < baseline
    assert baseline / step[("zb-h1", True)] >= 1.10
    assert step[("zb-h1", True)] <= 1.05 * lower_bound_s(costs, 4)


BENCH_CFG = GPTConfig(n_layer=8, n_head=8, n_embd=256, seq_len=512, vocab_size=256, dropout=0.1, attention="math")
BENCH_RUN = RunShape(Topology(2), Target("cpu", "fp32"), micro_batches=4, micro_batch_size=1)


@pytest.mark.parametrize("recompute", [NoRecompute(), SelectiveRecompute(), FullRecompute(interval="stage")])
def test_zb_h1_defers_only_as_many_ws_as_the_fullest_1f1b_stage_holds(recompute):
    layout = build_layout(BENCH_CFG, recompute, BENCH_RUN, "type:Block", 0, schedule="zb-h1")
    assert layout.schedule == "zb-h1" and layout.plans[0].deferred_weights == 0  # stage 0 is the fullest
    options = {(o.schedule, o.early): o for o in layout.schedule_options}
    shape, target = Shape.of(BENCH_CFG, BENCH_RUN.micro_batch_size), BENCH_RUN.target
    held_for_w = max(stage_weight_grad_bytes(layout.recipes, st.layers, shape, target) for st in layout.stages)
    for early in {o.early for o in options.values()}:
        zb, base = options[("zb-h1", early)], options[("1f1b", early)]
        # A stage that defers W's stays within the fullest stage's 1F1B peak; one that defers none still keeps, in
        # its B, what one micro-batch's W's need (each Linear's input and output gradient), which 1F1B frees there.
        for plan, peak in zip(zb.plans, zb.peak_bytes):
            assert plan.deferred_weights == 0 or peak <= max(base.peak_bytes)
        assert max(zb.peak_bytes) <= max(base.peak_bytes) + held_for_w
        assert zb.step_time_s <= base.step_time_s * (1 + 1e-12) and zb.lower_bound_s == base.lower_bound_s
    # A W-pending micro-batch holds each Linear's input and output gradient whatever the plan recomputes: beside
    # 1F1B's light recomputed micro-batches, and the last stage's backward remaking what they saved, there is no room.
    plain = isinstance(recompute, NoRecompute)
    assert options[("zb-h1", False)].plans[1].deferred_weights == (1 if plain else 0)
    assert (("1f1b", True) in options) == (not isinstance(recompute, NoRecompute))


def test_auto_chooses_the_fastest_schedule_that_fits_and_refuses_an_early_recompute_that_does_not():
    auto = AutoRecompute(budget_gb=0.3, reserve_gb=0.0)
    layout = build_layout(BENCH_CFG, auto, BENCH_RUN, "type:Block", 0, schedule="auto")
    fitting = [o for o in layout.schedule_options if o.fits]
    best = min(fitting, key=lambda o: o.step_time_s)
    assert (layout.schedule, any(p.early for p in layout.plans)) == (best.schedule, best.early)
    assert all(o.allowed for o in layout.schedule_options) and len(fitting) < len(layout.schedule_options)
    with pytest.raises(ValueError, match="recompute.early=true does not fit recompute.budget_gb"):
        build_layout(BENCH_CFG, AutoRecompute(budget_gb=0.3, reserve_gb=0.0, early=True), BENCH_RUN, "type:Block", 0)


def test_the_dry_run_prices_every_schedule_and_early_setting(tmp_path):
    run_dir = tmp_path / "plan"
    overrides = (
        "model=tiny",
        "data=synthetic",
        "train.prices=curves",
        "train.device=cpu",
        "parallel.pipeline_stages=2",
    )
    result = python_run(
        run_dir, *overrides, "+recompute=full", "parallel.schedule=zb-h1", "recompute.early=true", "dry_run=true"
    )
    plan = json.loads((run_dir / "plan.json").read_text())
    assert (plan["schedule"], plan["early_stages"]) == ("zb-h1", [0])
    assert set(plan["by_schedule"]) == {"1f1b", "zb-h1", "1f1b+early", "zb-h1+early"}
    assert [name for name, o in plan["by_schedule"].items() if o["chosen"]] == ["zb-h1+early"]
    chosen = plan["by_schedule"]["zb-h1+early"]
    assert chosen["step_time_s"] == pytest.approx(plan["predicted_step_time_s"])
    assert chosen["stage_peak_bytes"] == [s["predicted_peak_bytes"] for s in plan["stages"]]
    assert plan["lower_bound_s"] <= plan["predicted_step_time_s"]
    assert "schedule zb-h1 | early recompute on stages: 0" in result.stdout and "zb-h1+early" in result.stdout


def simulated_trace(timeline) -> StepTrace:
    """A simulated step as a traced one: one rank per stage, the same intervals, a recompute inside each
    early recompute and each backward of the last stage (which never recomputes early)."""
    ranks = []
    for stage in range(timeline.stages):
        rank = RankTrace(rank=stage, stage=stage, dp_rank=0, end_s=timeline.step_time_s)
        for i in timeline.of_stage(stage):
            ins = i.instruction
            rank.instructions.append(TraceInterval(ins.name, i.start_s, i.end_s, None, ins.micro_batch))
            if ins.name == "RecomputeEarly" or ins.name == "BackwardInput" and stage == timeline.stages - 1:
                rank.recomputes.append(TraceInterval("Recompute", i.start_s, i.start_s + 0.5, None, ins.micro_batch))
        ranks.append(rank)
    return StepTrace(1, timeline.micro_batches, timeline.stages, ranks)


def test_a_zb_h1_step_with_early_recompute_is_drawn_and_counted_busy_in_its_own_colours(tmp_path):
    import matplotlib.image

    timeline = simulate_stages([unit_stage(0.5)] * 2, 4, "zb-h1", early=True)
    trace = simulated_trace(timeline)
    times = stage_times(trace)
    assert times["stage_busy_s"] == pytest.approx([timeline.busy_s(s) for s in range(2)])  # B, W, early: busy
    assert times["trace_costs"][0]["backward_weight_s"] == 1.0 and times["trace_costs"][0]["early_recompute_s"] == 0.5
    cats = {e["cat"] for e in chrome_trace(trace)["traceEvents"] if e["ph"] == "X"}
    assert {"backward B", "backward W", "early recompute", "recompute"} <= cats and "backward" not in cats
    assert schedule_name(trace) == "ZB-H1 + early recompute"
    render_timeline(trace, tmp_path / "timeline.png")
    pixels = {
        tuple(p)
        for p in (matplotlib.image.imread(tmp_path / "timeline.png")[..., :3] * 255).round().astype(int).reshape(-1, 3)
    }
    assert len(set(COLOURS.values())) == len(COLOURS)
    for category in ("backward B", "backward W", "early recompute", "recompute", "forward"):
        rgb = tuple(int(COLOURS[category][k : k + 2], 16) for k in (1, 3, 5))
        assert rgb in pixels, f"{category} is not drawn"
