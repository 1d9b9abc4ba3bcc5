"""Per-micro-batch recompute (`recompute.micro_batches`): which micro-batches recompute under DeepSpeed's 1F1B
schedule, the planner's peak with k recomputed and in_flight - k plain micro-batches live, auto's search over
k, and real 2-stage runs that stay bit-exact against none while the metered bytes of every micro-batch equal
the planned ones."""

import json

import pytest
import torch

from model import GPT, Block, GPTConfig, lm_loss
from parallel.measurement.activation_meter import ActivationMeter
from parallel.planning.auto_recompute import choose_stage, choose_stage_micro_batches
from parallel.planning.block_prices import analytic_prices
from parallel.planning.config import AutoRecompute, FullRecompute, SelectiveRecompute
from parallel.planning.layout import build_layout
from parallel.planning.plan_record import RunPlan
from parallel.planning.run_plan import plan_run
from parallel.planning.schedule_walk import in_flight_micro_batches
from parallel.planning.shapes import GIB, RunShape, Shape, Target, Topology
from parallel.planning.stage_plan import StagePlan, plan_stage
from parallel.planning.step_sim import instructions, simulate
from parallel.planning.working_set import StageWorking
from parallel.runtime.recompute import apply_plan, run_stage
from tests.runs import python_run
from tests.shared_runs import EngineRun

TINY = GPTConfig(n_layer=4, n_head=2, n_embd=32, seq_len=32, vocab_size=64, dropout=0.1, attention="math")
TWO_STAGES = RunShape(Topology(2, 1), Target("cpu", "fp32"), micro_batches=3, micro_batch_size=2)
MIDDLE_STAGE = StageWorking(block_offset=0)  # blocks only: the working set is the last block's
AUTO_BUDGET_GB = 1_200_000 / GIB
"""A budget at which auto on TWO_STAGES recomputes for 1 of stage 0's 2 in-flight micro-batches."""
SELECTIVE = ["core_attn", "mlp_act", "layernorm"]
ENGINE_RUNS = {  # tests/fixtures/micro_batch_exact.py, one engine per configuration, in the shared 2-rank launch
    "exact": EngineRun(
        "micro_batch_exact",
        {
            "configs": {
                "none": {"mode": "none"},
                **{f"full-{k}": {"mode": "full", "micro_batches": k} for k in (1, 2)},
                **{f"selective-{k}": {"mode": "selective", "modules": SELECTIVE, "micro_batches": k} for k in (1, 2)},
                "auto": {"mode": "auto", "budget_gb": AUTO_BUDGET_GB, "reserve_gb": 0.0, "per_micro_batch": True},
            }
        },
    )
}


def _live_sets(micro_batches: int, stages: int, stage: int):
    """The micro-batches the stage holds after each forward and backward of DeepSpeed's TrainSchedule."""
    live: set[int] = set()
    for ins in instructions(micro_batches, stages, stage):
        if ins.name == "ForwardPass":
            live.add(ins.micro_batch)
        elif ins.name == "BackwardPass":
            live.discard(ins.micro_batch)
        yield frozenset(live)


@pytest.mark.parametrize("stages", [2, 3, 4])
@pytest.mark.parametrize("micro_batches", [1, 2, 3, 5, 8])
def test_every_peak_holds_exactly_k_recomputed_micro_batches(stages, micro_batches):
    for stage in range(stages):
        in_flight = in_flight_micro_batches(micro_batches, stages, stage)
        for k in range(1, in_flight + 1):
            plan = StagePlan(segments=((0, 1),), micro_batches=k, in_flight=in_flight)
            peaks = []
            for live in _live_sets(micro_batches, stages, stage):
                recomputed = sum(plan.recomputes_micro_batch(m) for m in live)
                assert recomputed <= k and len(live) - recomputed <= in_flight - k, (stage, k, sorted(live))
                if len(live) == in_flight:
                    peaks.append(recomputed)
            assert peaks and set(peaks) == {k}
            # The fewest recomputed micro-batches for which every run of in_flight consecutive ones holds k.
            full_runs, rest = divmod(micro_batches, in_flight)
            assert plan.recomputed_count(micro_batches) == full_runs * k + max(0, rest - (in_flight - k))


def test_the_recomputed_micro_batches_include_the_one_that_waits_longest():
    """Equal forward and backward costs on 4 stages: stage 0's last warm-up micro-batch waits longest."""
    micro_batches, stages = 8, 4
    timeline = simulate(micro_batches, stages, lambda ins: {"ForwardPass": 1.0, "BackwardPass": 2.0}.get(ins.name, 0))
    for stage in range(stages - 1):
        ends = {
            i.instruction.micro_batch: i.end_s for i in timeline.of_stage(stage) if i.instruction.name == "ForwardPass"
        }
        starts = {
            i.instruction.micro_batch: i.start_s
            for i in timeline.of_stage(stage)
            if i.instruction.name == "BackwardPass"
        }
        wait = {m: starts[m] - ends[m] for m in range(micro_batches)}
        plan = StagePlan(micro_batches=1, in_flight=in_flight_micro_batches(micro_batches, stages, stage))
        longest = max(wait.values())
        assert any(plan.recomputes_micro_batch(m) for m, w in wait.items() if w == longest), (stage, wait)


def test_a_left_out_micro_batch_keeps_what_none_keeps_and_stays_bit_exact():
    """In one process: the same built model runs a micro-batch under its selective and full plans and then as a
    plain one (run_stage(recompute=False)); the plain one keeps none's bytes and gives none's gradients."""

    def run(plan: StagePlan, recompute: bool):
        model = GPT(TINY, seed=0)
        apply_plan(model.forward_funcs, plan)
        idx = torch.randint(0, 64, (2, 32), generator=torch.Generator().manual_seed(1))
        meter = ActivationMeter(model.parameters)
        torch.manual_seed(5)
        with meter.record():
            loss = lm_loss(run_stage(model.forward_funcs, plan, idx, recompute, first_layer=0), idx)
        loss.backward()
        return meter.bytes_per_micro_batch()[0], loss.detach(), [p.grad for p in model.parameters()]

    is_block = [isinstance(f, Block) for f in GPT(TINY, seed=0).forward_funcs]
    none_bytes, none_loss, none_grads = run(StagePlan(), True)
    for config in (SelectiveRecompute(modules=["core_attn", "mlp_act", "layernorm"]), FullRecompute(interval="2")):
        plan = plan_stage(is_block, config)
        planned_bytes, _, _ = run(plan, True)
        plain_bytes, loss, grads = run(plan, False)
        assert planned_bytes < none_bytes and plain_bytes == none_bytes
        assert torch.equal(loss, none_loss) and all(torch.equal(g, b) for g, b in zip(grads, none_grads))


@pytest.mark.parametrize("k", [1, 2])
def test_the_planned_peak_counts_k_recomputed_and_the_rest_plain(k):
    recompute = FullRecompute(micro_batches=k)
    plan = plan_run(TINY, recompute, build_layout(TINY, recompute, TWO_STAGES, "type:Block", 0), TWO_STAGES)
    none = plan_run(TINY, FullRecompute(), build_layout(TINY, FullRecompute(), TWO_STAGES, "type:Block", 0), TWO_STAGES)
    stage0 = plan.stages[0]
    assert (stage0.in_flight_microbatches, stage0.recomputed_in_flight) == (2, k)
    assert stage0.activation_bytes_per_microbatch == none.stages[0].activation_bytes_per_microbatch
    peak = k * stage0.activation_bytes_per_microbatch + (2 - k) * stage0.plain_activation_bytes_per_microbatch
    assert stage0.peak_activation_bytes == peak
    assert stage0.predicted_peak_bytes - stage0.peak_activation_bytes == (
        none.stages[0].predicted_peak_bytes - none.stages[0].peak_activation_bytes
    )
    # Micro-batch 1 of 3 recomputes with k = 1 (1 mod 2 >= 1); all three with k = 2.
    assert stage0.recomputed_microbatches_per_step == {1: 1, 2: 3}[k]
    assert stage0.recompute_flops_per_step == none.stages[0].recompute_flops_per_step * {1: 1, 2: 3}[k] // 3
    assert RunPlan.from_json(json.loads(json.dumps(plan.to_json()))) == plan
    assert any("recompute for 1 of 2 in flight" in line for line in plan.lines()) == (k == 1)


def test_the_h100_figure_of_a_per_micro_batch_plan_is_its_predicted_step():
    """A CUDA plan is timed at an H100's peak unless told otherwise, so under 1F1B its `by_gpu` H100 step is the
    predicted step itself: both charge the plan's recompute only to the micro-batches that run it."""
    run = RunShape(Topology(2, 1), Target("cuda", "bf16"), micro_batches=3, micro_batch_size=2)
    recompute = FullRecompute(micro_batches=1)
    step = plan_run(TINY, recompute, build_layout(TINY, recompute, run, "type:Block", 0), run).step_time
    every = FullRecompute()
    always = plan_run(TINY, every, build_layout(TINY, every, run, "type:Block", 0), run).step_time
    assert step.schedule == "1f1b" and step.by_gpu["H100"]["step_time_s"] == step.predicted_step_time_s
    assert step.predicted_step_time_s < always.predicted_step_time_s


def test_auto_searches_k_and_never_pays_more_recompute_than_without():
    shape, target = Shape.of(TINY, 2), TWO_STAGES.target
    table = analytic_prices(shape, target)
    none_bytes = 2 * table.block_bytes
    found_fewer = False
    for room in range(2 * table.segment_input_bytes, 2 * none_bytes + 1, none_bytes // 40):
        every = choose_stage(2, table, 2, room, MIDDLE_STAGE)
        some = choose_stage_micro_batches(2, table, 2, 3, room, MIDDLE_STAGE)
        assert (every is None) == (some is None)
        if every is None:
            continue
        k = StagePlan(micro_batches=some.micro_batches).recomputed_in_flight(2)
        moment = max(some.working_bytes, some.plain_working_bytes)
        assert (2 - k) * some.plain_kept_bytes + MIDDLE_STAGE.bytes(some.kept_bytes, k, moment) <= room
        recomputed = StagePlan(micro_batches=k, in_flight=2).recomputed_count(3)
        assert some.cost * recomputed <= every.cost * 3
        found_fewer |= some.micro_batches is not None and some.cost * recomputed < every.cost * 3
    assert found_fewer


def test_auto_per_micro_batch_plans_between_todays_plans_and_shows_them():
    auto = AutoRecompute(budget_gb=AUTO_BUDGET_GB, reserve_gb=0.0, per_micro_batch=True)
    layout = build_layout(TINY, auto, TWO_STAGES, "type:Block", 0)
    today = build_layout(TINY, AutoRecompute(budget_gb=AUTO_BUDGET_GB, reserve_gb=0.0), TWO_STAGES, "type:Block", 0)
    assert layout.plans[0].micro_batches == 1 and today.plans[0].micro_batches is None
    for b in layout.budgets:
        assert b.predicted_peak_bytes <= b.budget_bytes
    plan = plan_run(TINY, auto, layout, TWO_STAGES)
    assert plan.predicted_step_time_s < plan_run(TINY, auto, today, TWO_STAGES).predicted_step_time_s
    assert plan.stages[0].predicted_peak_bytes == layout.peak_bytes[0] <= layout.budgets[0].budget_bytes
    assert "recompute for 1 of 2 in-flight micro-batches" in layout.describe()[0]
    assert "for 1 of them, none for the others" in layout.describe_budgets(auto)[1]


@pytest.mark.multiproc
def test_two_stage_runs_are_bit_exact_with_none_and_meter_the_planned_bytes_per_micro_batch(engine_runs):
    for rank, runs in enumerate(engine_runs["exact"]):
        assert runs["auto"]["micro_batches"] == (1 if rank == 0 else None)
        for name, run in runs.items():
            assert run["losses"] == runs["none"]["losses"], name
            assert run["grad_norms"] == runs["none"]["grad_norms"], name
            assert run["measured"] == run["planned"], name
        if rank == 0:  # 1 of 2 in flight: micro-batch 1 of 3 recomputes, 0 and 2 keep none's bytes
            plain = runs["none"]["measured"][0]
            for name in ("full-1", "selective-1", "auto"):
                measured = runs[name]["measured"]
                assert measured[0] == measured[2] == plain and measured[1] < plain, name
            assert max(runs["full-2"]["measured"]) < plain


def test_the_dry_run_shows_the_per_micro_batch_plan(tmp_path):
    shape = [
        *[
            f"model.{k}={getattr(TINY, k)}"
            for k in ("n_layer", "n_head", "n_embd", "seq_len", "vocab_size", "attention")
        ],
        "model.dropout=0.1",
        "data=synthetic",
        "train.device=cpu",
        "train.prices=curves",  # the exact choice below is the analytic prices' (no profile cached in tests)
        "train.micro_batches=3",
        "train.micro_batch_size=2",
        "parallel.pipeline_stages=2",
        "parallel.data_parallel_size=1",
        "parallel.partition_method=type:Block",
        "dry_run=true",
    ]
    auto = ["+recompute=auto", f"recompute.budget_gb={AUTO_BUDGET_GB!r}", "recompute.reserve_gb=0"]
    out = python_run(tmp_path / "auto", *shape, *auto, "recompute.per_micro_batch=true", tmp=tmp_path).stdout
    assert "recompute for 1 of 2 in-flight micro-batches" in out and "for 1 of them, none for the others" in out
    stage0 = json.loads((tmp_path / "auto" / "plan.json").read_text())["stages"][0]
    assert (stage0["recomputed_in_flight"], stage0["recomputed_microbatches_per_step"]) == (1, 1)
