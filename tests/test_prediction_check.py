"""summary.json's `prediction`: the plan's predicted seconds of each instruction against a traced step's, and the
end-of-run line when the measured step is more than 10% off the predicted one."""

import dataclasses
import json

import pytest

from harness.prediction_check import (
    RESIDUAL_WINDOW,
    learn_residuals,
    prediction_record,
    prediction_warning,
    read_residuals,
    residuals_path,
    traced_instruction_seconds,
)
from model import GPTConfig
from parallel.measurement.trace import Interval, RankTrace, StepTrace
from parallel.planning.block_prices import with_residuals
from parallel.planning.config import FullRecompute
from parallel.planning.layout import build_layout
from parallel.planning.plan_record import RunPlan
from parallel.planning.run_plan import plan_run
from parallel.planning.shapes import RunShape, Target, Topology
from tests.test_instruction_seconds import PROFILE

CFG = GPTConfig(n_layer=4, n_head=2, n_embd=32, seq_len=16, vocab_size=64)
RUN = RunShape(Topology(2), Target("cpu", "fp32"), micro_batches=2, micro_batch_size=2)


def _plan(schedule: str = "zb-h1", early: bool = True):
    recompute = FullRecompute(interval="1", early=early)
    return plan_run(CFG, recompute, build_layout(CFG, recompute, RUN, "type:Block", 0, schedule=schedule), RUN)


def test_the_plan_predicts_each_instruction_its_stages_programme_runs_and_plan_json_keeps_them():
    plan = _plan()
    first, last = plan.step_time.stage_instruction_s
    assert {"RecomputeEarly", "BackwardInput", "BackwardWeight", "SendActivation", "RecvGrad"} <= set(first)
    assert "RecvActivation" not in first and "SendGrad" not in first  # stage 0 has no previous stage
    assert "RecomputeEarly" not in last and "BackwardPass" not in last  # the last stage never recomputes early
    assert first["RecomputeEarly"] > 0 and first["BackwardInput"] > first["BackwardWeight"] > 0
    assert RunPlan.from_json(plan.to_json()).step_time.stage_instruction_s == plan.step_time.stage_instruction_s


def test_the_predicted_optimizer_step_holds_the_clipping_barriers_wait_as_a_trace_times_it():
    """Each stage's predicted instruction is timed in the simulated step from reaching it to its end: under clipping
    (train.grad_clip, on by default) a stage's OptimizerStep holds its wait for the last stage to reach its own."""
    recompute = FullRecompute(interval="1")
    plans = {}
    for clip in (0.0, 1.0):
        run = dataclasses.replace(RUN, topology=Topology(4), grad_clip=clip)
        plans[clip] = plan_run(CFG, recompute, build_layout(CFG, recompute, run, "type:Block", 0), run).step_time
    waits = [
        clipped["OptimizerStep"] - free["OptimizerStep"]
        for clipped, free in zip(plans[1.0].stage_instruction_s, plans[0.0].stage_instruction_s)
    ]
    assert min(waits) == pytest.approx(0.0, abs=1e-12) and max(waits) > 0  # the last to arrive waits for none
    assert plans[1.0].predicted_step_time_s >= plans[0.0].predicted_step_time_s


def _trace(seconds_by_stage: list[dict[str, list[float]]]) -> StepTrace:
    ranks = []
    for stage, seconds in enumerate(seconds_by_stage):
        rank = RankTrace(rank=stage, stage=stage, dp_rank=0)
        clock = 0.0
        for name, durations in seconds.items():
            for duration in durations:
                rank.instructions.append(Interval(name, clock, clock + duration))
                clock += duration
        rank.end_s = clock
        ranks.append(rank)
    return StepTrace(step=3, micro_batches=2, stages=len(ranks), ranks=ranks)


def test_each_instruction_is_compared_with_the_mean_of_its_traced_intervals():
    plan = _plan("1f1b", early=False)
    predicted_forward = plan.step_time.stage_instruction_s[0]["ForwardPass"]
    trace = _trace([{"ForwardPass": [predicted_forward, 3 * predicted_forward]}, {"ForwardPass": [0.5]}])
    assert traced_instruction_seconds(trace) == [{"ForwardPass": 2 * predicted_forward}, {"ForwardPass": 0.5}]
    record = prediction_record(plan, plan.predicted_step_time_s * 1.5, trace)
    forward = record["per_stage"][0]["ForwardPass"]
    assert forward["ratio"] == pytest.approx(2.0) and forward["measured_s"] == pytest.approx(2 * predicted_forward)
    assert record["per_stage"][0]["BackwardPass"]["measured_s"] is None  # not traced: no ratio either
    both = predicted_forward + plan.step_time.stage_instruction_s[1]["ForwardPass"]
    assert record["by_kind"]["ForwardPass"] == pytest.approx(
        {"predicted_s": both, "measured_s": 2 * predicted_forward + 0.5, "ratio": (2 * predicted_forward + 0.5) / both}
    )
    assert set(record["by_kind"]) == {"ForwardPass"}  # only what the step traced
    assert record["error"] == pytest.approx(0.5) and record["costs"] == "analytic"
    assert "+50% off the plan's prediction" in prediction_warning(record)
    assert "per_stage" not in prediction_record(plan, plan.predicted_step_time_s, None)


@pytest.mark.parametrize("ratio, warned", [(1.0, False), (1.099, False), (0.901, False), (1.11, True), (0.88, True)])
def test_the_run_says_so_only_beyond_ten_percent(ratio, warned):
    plan = _plan()
    record = prediction_record(plan, plan.predicted_step_time_s * ratio, None)
    assert (prediction_warning(record) is not None) == warned


def test_a_run_priced_by_measured_prices_folds_its_residuals_into_them(tmp_path):
    """Each kind's factor is multiplied by the run's measured / predicted: the next prediction meets this run."""
    prices = tmp_path / "cpu-x-fp32-abc.json"
    record = {"by_kind": {"ForwardPass": {"ratio": 2.0}, "BackwardInput": {"ratio": 0.5}, "SendGrad": {"ratio": 9.0}}}
    record["by_kind"]["ReduceGrads"] = {"ratio": 2.0}
    assert learn_residuals(record, {"kind": "analytic", "path": None}, 2) is None  # nothing measured to correct
    assert learn_residuals(record, {"kind": "measured", "path": str(prices)}, 2) == residuals_path(prices)
    # a send's wait is not a price, nor ReduceGrads' where it waits for other replicas
    assert read_residuals(prices) == ({"forward": 2.0, "backward_input": 0.5}, 1)
    learn_residuals({"by_kind": {"ForwardPass": {"ratio": 1.5}}}, {"kind": "measured", "path": str(prices)}, 2)
    # the second run measured 1.5x the first run's factor: 3.0x the unscaled price; the mean of 2.0 and 3.0
    assert read_residuals(prices) == ({"forward": pytest.approx((2.0 * 3.0) ** 0.5), "backward_input": 0.5}, 2)


def test_a_kind_is_averaged_over_the_runs_that_measured_it_and_over_the_last_window_of_them(tmp_path):
    """BackwardWeight runs under zb-h1 only: 1f1b runs before and after it leave its factor as the zb-h1 run measured
    it. A file with many runs behind a factor moves by 1/RESIDUAL_WINDOW of a new run's log-ratio, no less."""
    prices, source = (
        tmp_path / "cpu-x-fp32-abc.json",
        {"kind": "measured", "path": str(tmp_path / "cpu-x-fp32-abc.json")},
    )
    for record in (
        {"ForwardPass": {"ratio": 1.0}},
        {"BackwardWeight": {"ratio": 1.2}},
        {"ForwardPass": {"ratio": 1.0}},
    ):
        learn_residuals({"by_kind": record}, source, 2)
    assert read_residuals(prices) == ({"forward": 1.0, "weight_grad": pytest.approx(1.2)}, 3)
    residuals_path(prices).write_text(json.dumps({"runs": 500, "residuals": {"forward": 1.0}}))  # counts unrecorded
    learn_residuals({"by_kind": {"ForwardPass": {"ratio": 2.0}}}, source, 2)
    assert read_residuals(prices) == ({"forward": pytest.approx(2.0 ** (1 / RESIDUAL_WINDOW))}, 501)


def test_reduce_grads_is_learnt_where_a_run_has_one_replica(tmp_path):
    """At one replica ReduceGrads waits for nobody: its time is the flat gradient's copies, priced per parameter."""
    prices = tmp_path / "cpu-x-fp32-abc.json"
    record = {"by_kind": {"ReduceGrads": {"ratio": 2.0}, "ReduceTiedGrads": {"ratio": 3.0}}}
    learn_residuals(record, {"kind": "measured", "path": str(prices)}, 1)
    assert read_residuals(prices) == ({"reduce_grads": 2.0}, 1)
    scaled = with_residuals(PROFILE, {"reduce_grads": 2.0})
    assert scaled.reduce_grads_per_param == pytest.approx(2 * PROFILE.reduce_grads_per_param)
    assert dataclasses.replace(scaled, reduce_grads_per_param=PROFILE.reduce_grads_per_param) == PROFILE


def test_a_boundarys_post_is_learnt_as_seconds_from_the_ranks_of_a_virtual_stage_run(tmp_path):
    """No replay times a boundary's post (the engine's buffers, the backend's posts) before the process group exists:
    a traced run with virtual stages teaches it as the seconds its ranks measured beyond the prediction (a prediction
    of 0 included, where a ratio means nothing), averaged over the runs; a run without virtual stages (its plan
    predicts no BoundaryExchange) teaches none."""
    prices = tmp_path / "cpu-x-fp32-abc.json"
    source = {"kind": "measured", "path": str(prices)}
    traced = [{"BoundaryExchange": {"predicted_s": 0.0002, "measured_s": 0.0012}}, {}]
    traced[1]["BoundaryExchange"] = {"predicted_s": 0.0, "measured_s": 0.0008}
    learn_residuals({"by_kind": {}, "per_stage": traced}, source, 1)
    assert read_residuals(prices)[0] == {"exchange_s": pytest.approx(0.0009)}
    # the next run's prediction held 0.0009 s per post, and its ranks measured 0.0003 s more: the mean of 0.0009 and
    # 0.0012
    again = [{"BoundaryExchange": {"predicted_s": 0.0011, "measured_s": 0.0014}}]
    learn_residuals({"by_kind": {}, "per_stage": again}, source, 1)
    assert read_residuals(prices)[0] == {"exchange_s": pytest.approx(0.00105)}
    untouched = [{"SendActivation": {"predicted_s": 0.0, "measured_s": 1.0}}]
    learn_residuals({"by_kind": {}, "per_stage": untouched}, source, 1)
    assert read_residuals(prices)[0] == {"exchange_s": pytest.approx(0.00105)}
    assert with_residuals(PROFILE, {"exchange_s": 0.00105}).exchange == 0.00105 and PROFILE.exchange == 0.0
