"""The step-time simulator replays DeepSpeed's own TrainSchedule: checked against a timeline worked out by
hand, for every instruction's presence and order on bigger shapes, and against a traced run's own costs;
and the per-stage costs it is fed (parallel/step_costs.py), measured and analytic."""

import pytest

from model import GPTConfig
from parallel.auto_recompute import measured_costs
from parallel.config import FullRecompute, SelectiveRecompute
from parallel.layout import build_layout
from parallel.run_plan import plan_run
from parallel.shapes import RunShape, Shape, Target, Topology
from parallel.step_costs import analytic_rates
from parallel.step_sim import COMPUTE, PER_STEP, instructions, simulate

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


@pytest.mark.multiproc
def test_replaying_a_traced_runs_own_costs_predicts_its_traced_step_within_5_percent(tmp_path):
    import json

    from tests.runs import TINY, launch

    run_dir = tmp_path / "run"
    launch(run_dir, *TINY, "train.steps=3", "train.micro_batches=4", "train.trace_step=3", "logger=none")
    trace = json.loads((run_dir / "trace.json").read_text())
    events = [e for e in trace["traceEvents"] if e["ph"] == "X" and e["name"] != "Recompute"]
    # The measured seconds of each instruction of the traced step (a blocking send or recv includes its wait:
    # the simulator takes the shorter side of each rendezvous).
    measured = {(e["pid"], e["name"], e["args"].get("micro_batch")): e["dur"] / 1e6 for e in events}
    assert len(measured) == len(events)  # one rank per stage: every instruction once
    timeline = simulate(trace["otherData"]["micro_batches"], 2, lambda i: measured[(i.stage, i.name, i.micro_batch)])
    assert timeline.step_time_s == pytest.approx(trace["otherData"]["step_time_s"], rel=0.05)


TINY_CFG = GPTConfig(n_layer=4, n_head=4, n_embd=128, seq_len=128, vocab_size=256, dropout=0.1, attention="math")
RUN = RunShape(Topology(2), Target("cpu", "fp32"), micro_batches=4, micro_batch_size=2)
PROFILE = {
    "block": 0.004,
    "core_attn": 0.002,
    "mlp": 0.001,
    "mlp_act": 0.0001,
    "layernorm": 0.0002,
    "block_forward": 0.005,
    "block_backward": 0.009,
    "embedding_forward": 0.0003,
    "embedding_backward": 0.0004,
    "head_forward": 0.002,
    "head_backward": 0.003,
    "optimizer_per_param": 1e-8,
}


def test_measured_costs_price_each_stage_from_the_profile():
    table = measured_costs(Shape.of(TINY_CFG, 2), RUN.target, PROFILE)
    layout = build_layout(TINY_CFG, FullRecompute(), RUN, "type:Block", 0, table)
    plan = plan_run(TINY_CFG, FullRecompute(), layout, RUN)
    assert plan.step_time.costs == "measured" and layout.timing.source == "measured"
    first, last = (layout.timing.stage(s, 2, 2, 2 * table.full_block_cost, 0, RUN) for s in (0, 1))
    assert first.forward == pytest.approx(2 * 0.005 + 0.0003) and last.backward == pytest.approx(2 * 0.009 + 0.003)
    # Full recompute (interval 1) redoes each block's forward once per backward: 2 blocks x 4 micro-batches.
    assert plan.step_time.stage_recompute_s == pytest.approx((4 * 2 * 0.004, 4 * 2 * 0.004))
    selective = plan_run(
        TINY_CFG, SelectiveRecompute(), build_layout(TINY_CFG, SelectiveRecompute(), RUN, "type:Block", 0, table), RUN
    )
    assert selective.step_time.stage_recompute_s == pytest.approx((4 * 2 * 0.002, 4 * 2 * 0.002))  # core_attn
    assert plan.step_time.by_mode_s["full"] > plan.step_time.by_mode_s["selective"] > plan.step_time.by_mode_s["none"]


def test_analytic_costs_charge_full_recompute_one_forward_and_a_gpu_by_its_peak():
    layout = build_layout(TINY_CFG, FullRecompute(), RUN, "type:Block", 0)
    timing = layout.timing
    assert timing.source == "analytic" and timing.rates.name == "cpu"
    plan = plan_run(TINY_CFG, FullRecompute(), layout, RUN)
    # Dropout on: no early stop, so a one-block segment recomputes exactly the block's forward.
    assert plan.step_time.stage_recompute_s[0] == pytest.approx(4 * 2 * timing.block_forward)
    h100, a100 = (analytic_rates("cuda", "bf16", gpu=g) for g in ("H100", "A100"))
    assert (h100.flops_per_s, a100.flops_per_s) == (989e12, 312e12)
    assert analytic_rates("cuda", "bf16", peak_tflops=100.0).flops_per_s == 100e12  # train.peak_tflops wins
