"""The per-stage costs the step-time simulator is fed (parallel/planning/instruction_seconds.py): a measured cost
table (`MeasuredSeconds`, every field required) or the analytic one, each stage's instructions priced from it, the
links' transfers, and W, the weight gradients ZB-H1 defers."""

import dataclasses

import pytest

from model import GPTConfig
from parallel.planning.block_prices import MeasuredSeconds, measured_prices
from parallel.planning.config import FullRecompute, NoRecompute, SelectiveRecompute
from parallel.planning.device_profile_file import CostSource
from parallel.planning.instruction_seconds import PEAK_EFFICIENCY, analytic_rates, time_model
from parallel.planning.layout import build_layout
from parallel.planning.run_plan import plan_run
from parallel.planning.shapes import RunShape, Shape, Target, Topology
from parallel.planning.stage_price import StagePricing, price_stage
from parallel.planning.step_sim import StageCosts, simulate_stages

TINY_CFG = GPTConfig(n_layer=4, n_head=4, n_embd=128, seq_len=128, vocab_size=256, dropout=0.1, attention="math")
RUN = RunShape(Topology(2), Target("cpu", "fp32"), micro_batches=4, micro_batch_size=2)
PROFILE = MeasuredSeconds(
    block_recompute=0.004,
    core_attn=0.002,
    mlp=0.001,
    mlp_act=0.0001,
    layernorm=0.0002,
    block_forward=0.005,
    block_backward=0.009,
    embedding_forward=0.0003,
    embedding_backward=0.0004,
    head_forward=0.002,
    head_backward=0.003,
    optimizer_per_param=1e-8,
    load=0.0001,
    reduce_grads_per_param=2e-9,
    block_weight_grad=0.004,
    head_weight_grad=0.0015,
    block_backward_input=0.0055,
    head_backward_input=0.0017,
    transfer=None,
    link_bytes_per_s=None,
)
SOURCE = CostSource("profile", "/profiles/cpu.json", "2026-12-01T21:00:00+00:00")


def test_a_misspelt_missing_or_negative_measured_cost_is_an_error_not_an_analytic_fallback():
    """The step-time inputs were an untyped dict where a misspelt key silently fell back to the analytic model."""
    fields = dataclasses.asdict(PROFILE)
    with pytest.raises(TypeError, match="block_bakward"):
        MeasuredSeconds(**fields, block_bakward=0.009)
    del fields["block_backward"]
    with pytest.raises(TypeError, match="block_backward"):
        MeasuredSeconds(**fields)
    with pytest.raises(ValueError, match="head_forward"):
        dataclasses.replace(PROFILE, head_forward=-1.0)
    with pytest.raises(ValueError, match="transfer"):
        dataclasses.replace(PROFILE, transfer="0.1")
    with pytest.raises(ValueError, match="layernrom"):
        measured_prices(Shape.of(TINY_CFG, 2), RUN.target, PROFILE, SOURCE).measured.selective(["layernrom"])
    assert PROFILE.selective(["core_attn", "layernorm"]) == pytest.approx(0.0022)


def test_measured_costs_price_each_stage_from_the_profile():
    table = measured_prices(Shape.of(TINY_CFG, 2), RUN.target, PROFILE, SOURCE)
    layout = build_layout(TINY_CFG, FullRecompute(), RUN, "type:Block", 0, table)
    plan = plan_run(TINY_CFG, FullRecompute(), layout, RUN)
    assert plan.step_time.costs == "measured" and layout.timing.source == "measured"
    assert plan.step_time.cost_source == {"kind": "profile", "path": "/profiles/cpu.json", "created": SOURCE.created}
    assert any("(device profile /profiles/cpu.json, measured 2026-12-01T21:00:00+00:00)" in x for x in plan.lines())
    first, last = (layout.timing.stage(s, 2, 2, 2 * table.full_block_cost, 1000, RUN) for s in (0, 1))
    assert first.forward == pytest.approx(2 * 0.005 + 0.0003) and last.backward == pytest.approx(2 * 0.009 + 0.003)
    # the fixed work: the end stages' loads, and ReduceGrads' flattening at one data-parallel replica
    assert first.load == last.load == 0.0001 and first.reduce_grads == pytest.approx(1000 * 2e-9)
    middle = layout.timing.stage(1, 3, 2, 0.0, 1000, RUN)
    assert middle.load == 0.0 and middle.optimizer == pytest.approx(1000 * 1e-8)
    # Full recompute (interval 1) redoes each block's forward once per backward: 2 blocks x 4 micro-batches.
    assert plan.step_time.stage_recompute_s == pytest.approx((4 * 2 * 0.004, 4 * 2 * 0.004))
    selective = plan_run(
        TINY_CFG, SelectiveRecompute(), build_layout(TINY_CFG, SelectiveRecompute(), RUN, "type:Block", 0, table), RUN
    )
    assert selective.step_time.stage_recompute_s == pytest.approx((4 * 2 * 0.002, 4 * 2 * 0.002))  # core_attn
    assert plan.step_time.by_mode_s["full"] > plan.step_time.by_mode_s["selective"] > plan.step_time.by_mode_s["none"]


def test_every_transfer_of_a_two_stage_pipeline_takes_the_links_time():
    """An end stage's receive was priced as its own send (none that way: 0), and a rendezvous lasts its shorter
    side's cost: the two stages' transfers took no time."""
    table = measured_prices(Shape.of(TINY_CFG, 2), RUN.target, dataclasses.replace(PROFILE, transfer=0.001), SOURCE)
    layout = build_layout(TINY_CFG, NoRecompute(), RUN, "type:Block", 0, table)
    timeline = simulate_stages(layout_costs(layout, TINY_CFG, RUN), RUN.micro_batches)
    p2p = ("SendActivation", "RecvActivation", "SendGrad", "RecvGrad")
    transfers = [i.end_s - i.start_s for i in timeline.intervals if i.instruction.name in p2p]
    assert len(transfers) == 4 * RUN.micro_batches and all(t == pytest.approx(0.001) for t in transfers)


def test_analytic_costs_charge_full_recompute_one_forward_and_a_gpu_by_its_peak():
    layout = build_layout(TINY_CFG, FullRecompute(), RUN, "type:Block", 0)
    timing = layout.timing
    assert timing.source == "analytic" and timing.rates.name == "cpu"
    plan = plan_run(TINY_CFG, FullRecompute(), layout, RUN)
    # Dropout on: no early stop, so a one-block segment recomputes exactly the block's forward.
    assert plan.step_time.stage_recompute_s[0] == pytest.approx(4 * 2 * timing.block_forward)
    h100, a100 = (analytic_rates("cuda", "bf16", gpu=g) for g in ("H100", "A100"))
    # a realistic share of the peak, not the peak
    assert (h100.flops_per_s, a100.flops_per_s) == (989e12 * PEAK_EFFICIENCY, 312e12 * PEAK_EFFICIENCY)
    assert analytic_rates("cuda", "bf16", peak_tflops=100.0).flops_per_s == 100e12 * PEAK_EFFICIENCY  # it wins
    assert plan.step_time.cost_source == {"kind": "analytic", "path": None, "created": None}


def layout_costs(layout, model: GPTConfig, run: RunShape) -> list[StageCosts]:
    """Each stage's costs under the layout's plans, priced as the planner prices them."""
    pricing = StagePricing.of(layout.recipes, run, Shape.of(model, run.micro_batch_size), layout.timing)
    return [price_stage(pricing, stage, plan).costs for stage, plan in zip(layout.stages, layout.plans)]


def test_w_is_the_linear_layers_weight_gradients_analytic_and_the_profiles_weight_gradient_matmuls():
    unfused = dataclasses.replace(TINY_CFG, loss_chunk_tokens=0)  # the fused loss's head has no W to defer
    shape = Shape.of(unfused, 2)
    timing = build_layout(unfused, FullRecompute(), RUN, "type:Block", 0).timing
    linear = 2 * shape.b * shape.s * 12 * shape.h * shape.h
    head = 2 * shape.b * shape.s * shape.h * shape.vocab
    assert timing.block_weight_grad == pytest.approx(linear / timing.rates.flops_per_s)
    assert timing.head_weight_grad == pytest.approx(head / timing.rates.flops_per_s)
    assert build_layout(TINY_CFG, FullRecompute(), RUN, "type:Block", 0).timing.head_weight_grad == 0.0
    table = measured_prices(shape, RUN.target, PROFILE, SOURCE)
    measured = build_layout(unfused, FullRecompute(), RUN, "type:Block", 0, table)
    assert measured.timing.block_weight_grad == 0.004 and measured.timing.head_weight_grad == 0.0015
    first, last = layout_costs(measured, unfused, RUN)
    assert first.weight_grad == pytest.approx(2 * 0.004)  # the embeddings' gradients are B's
    assert last.weight_grad == pytest.approx(2 * 0.004 + 0.0015)


def test_a_split_backward_prices_its_b_as_the_replay_timed_it():
    """ZB-H1's B keeps each Linear's input and output gradient for W: the replay times it above backward less W."""
    stage = StageCosts(1.0, 2.0, 0.5, 0.0, 0.0, 0.0, 0.0, 0.0, weight_grad=1.0)  # forward 1, backward 2 of which W 1
    split = dataclasses.replace(stage, backward_input=1.25).by_instruction()
    assert split["BackwardInput"] == 1.25 + 0.5 and split["BackwardWeight"] == 1.0
    assert split["BackwardPass"] == 2.5  # 1F1B's fused backward splits nothing
    assert stage.by_instruction()["BackwardInput"] == 2.0 - 1.0 + 0.5  # a trace's costs: backward less W
    shape = Shape.of(TINY_CFG, 2)
    model = time_model(shape, RUN, measured_prices(shape, RUN.target, PROFILE, SOURCE), analytic_rates("cpu", "fp32"))
    first, last = (model.stage(stage, 2, blocks=2, recompute_cost=0.0, params=1, run=RUN) for stage in (0, 1))
    assert first.backward_input == pytest.approx(2 * PROFILE.block_backward_input + PROFILE.embedding_backward)
    # the fused loss (the default) defers none of the head's backward: its B is all of it
    assert shape.loss_chunk_tokens and last.backward_input == pytest.approx(
        2 * PROFILE.block_backward_input + PROFILE.head_backward
    )
