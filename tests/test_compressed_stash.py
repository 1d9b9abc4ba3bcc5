"""Compressed stashes (`recompute.compress`): full recompute's segment inputs stored in bf16, fp8 (e4m3, a scale per
token) or int8 (a scale per token) until their recompute. Lossy by design, so not bit-exact: the gradients are those
of the decompressed input, close to the exact ones; the kept bytes and the peak are what the planner says; `auto`
stores compressed only when allowed (`recompute.compress`), where that lets a stage fit, and counts the peak as the
plan does; a run says it is lossy in its plan, its start-up print and its summary; and what cannot work is refused in
one line."""

import pytest
import torch
import torch.nn.functional as F

from model import GPT, Block, GPTConfig, lm_loss
from parallel.measurement.stage_replay import StageReplay
from parallel.planning.block_prices import MACHINE_BALANCE
from parallel.planning.budget_refusal import BudgetTooSmall
from parallel.planning.compression import check_compress, compress_traffic_bytes, lossy_note
from parallel.planning.config import AutoRecompute, FullRecompute, NoRecompute
from parallel.planning.layout import build_layout
from parallel.planning.plan_record import RunPlan
from parallel.planning.run_plan import plan_run
from parallel.planning.shapes import GIB, RunShape, Shape, Target, Topology
from parallel.planning.stage_plan import plan_stage
from parallel.runtime.compressed_stash import CompressedStash
from parallel.runtime.early_recompute import EarlyRecompute
from parallel.runtime.recompute import apply_plan, run_stage
from tests.runs import TINY, summary
from tests.shared_runs import case
from tests.test_activation_planner import measured_and_planned

COMPRESSED = [
    FullRecompute(interval="1", compress="bf16"),
    FullRecompute(interval="2", compress="fp8"),
    FullRecompute(interval="stage", nested=True, compress="fp8"),
    FullRecompute(interval="2", compress="int8"),
]
IDS = ["full(1) bf16", "full(2) fp8", "nested full(stage) fp8", "full(2) int8"]
CASES = {"fp8": case(*TINY, "train.steps=2", "logger=none", "+recompute=full", "recompute.compress=fp8")}


def loss_and_grad(recompute, early: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """One micro-batch of a tiny GPT with dropout: its loss and every parameter's gradient, flattened."""
    cfg = GPTConfig(n_layer=4, n_head=4, n_embd=64, seq_len=32, vocab_size=64, dropout=0.1, attention="math")
    model = GPT(cfg, seed=0)
    plan = plan_stage([isinstance(f, Block) for f in model.forward_funcs], recompute)
    apply_plan(model.forward_funcs, plan)
    idx = torch.randint(0, 64, (2, 32), generator=torch.Generator().manual_seed(1))
    torch.manual_seed(5)  # the dropout stream
    registry = EarlyRecompute()
    with registry.registering() if early else torch.enable_grad():
        loss = lm_loss(run_stage(model.forward_funcs, plan, idx, first_layer=0), idx)
    if early:
        registry.recompute_next()
    loss.backward()
    return loss.detach(), torch.cat([p.grad.flatten() for p in model.parameters()])


@pytest.mark.parametrize("early", [False, True], ids=["in backward", "early"])
@pytest.mark.parametrize("recompute", COMPRESSED, ids=IDS)
def test_the_gradient_is_the_decompressed_inputs_close_to_the_exact_one(recompute, early):
    exact_loss, exact = loss_and_grad(NoRecompute())
    loss, grad = loss_and_grad(recompute, early)
    assert torch.equal(loss, exact_loss)  # the forward runs on the exact inputs
    assert not torch.equal(grad, exact)  # the backward on the decompressed ones: lossy
    assert F.cosine_similarity(grad, exact, dim=0) >= 0.999


@pytest.mark.parametrize("recompute", COMPRESSED, ids=IDS)
def test_planned_kept_bytes_equal_measured_bytes(recompute):
    pipe, plan = measured_and_planned(recompute)
    for stage, planned in zip(pipe.stages, plan.stages):
        assert stage.meter.bytes_per_micro_batch() == [planned.activation_bytes_per_microbatch] * 2


@pytest.mark.parametrize("compress", ["fp8", "int8"])
def test_8_bits_keep_a_quarter_of_fp32_plus_a_scale_per_token(compress):
    def measured(compress: str) -> list[int]:
        pipe, _ = measured_and_planned(FullRecompute(interval="1", compress=compress))
        return [stage.meter.bytes_per_micro_batch()[0] for stage in pipe.stages]

    tokens, h = 2 * 16, 32  # measured_and_planned's micro-batch: 2 sequences of 16 tokens, n_embd 32
    # each stage holds 3 one-block segments: each input 4 bytes an element down to 1, plus a 4-byte scale a token
    assert [a - b for a, b in zip(measured("none"), measured(compress))] == [3 * (3 * tokens * h - 4 * tokens)] * 2


def test_int8_rounds_each_value_to_the_nearest_of_255_steps_of_its_tokens_range():
    x = torch.randn(2, 8, 64, generator=torch.Generator().manual_seed(0))  # (b, s, h)
    stored = []
    stash = CompressedStash("int8", lambda *parts: stored.extend(parts))
    back = stash.unpack(stash.pack(x))
    step = x.abs().amax(dim=-1, keepdim=True) / 127
    assert stored[0].dtype == torch.int8 and stored[1].shape == (2, 8, 1)
    assert bool(((back - x).abs() <= step / 2 * (1 + 1e-5)).all())  # nearest, not truncated toward zero
    assert torch.equal(back.abs().amax(dim=-1), x.abs().amax(dim=-1))  # each token's largest value is exact
    fp8 = CompressedStash("fp8", lambda *parts: None)
    fp8_error = (fp8.unpack(fp8.pack(x)) - x).pow(2).mean()
    assert (back - x).pow(2).mean() < fp8_error / 4  # the same bytes, under a quarter of fp8's squared error


def test_a_compressed_stages_planned_peak_is_its_measured_peak():
    model = GPTConfig(n_layer=6, n_head=4, n_embd=64, seq_len=64, vocab_size=128, dropout=0.1, attention="math")
    run = RunShape(Topology(2), Target("cpu", "fp32"), micro_batches=4, micro_batch_size=2)
    recompute = FullRecompute(interval="1", compress="fp8")
    layout = build_layout(model, recompute, run, "type:Block", 0)
    measured = StageReplay(layout, 0, run).measure_peak()
    predicted = plan_run(model, recompute, layout, run).stages[0].predicted_peak_bytes
    assert abs(measured.peak_bytes / predicted - 1) <= 0.02  # measured 0.6% over


def test_the_plan_says_lossy_and_how_and_an_exact_plan_does_not():
    # Activations well above the gradients ReduceGrads flattens: both stages' peaks fall under full recompute
    model = GPTConfig(n_layer=4, n_head=2, n_embd=32, seq_len=64, vocab_size=64)
    run = RunShape(Topology(2), Target("cpu", "fp32"), micro_batches=2, micro_batch_size=2)
    for recompute, words in ((FullRecompute(compress="fp8"), "float8 e4m3"), (FullRecompute(), None)):
        plan = plan_run(model, recompute, build_layout(model, recompute, run, "type:Block", 0), run)
        if words is None:
            assert plan.lossy is None and not any("LOSSY" in line for line in plan.lines())
            continue
        assert plan.lossy.startswith("LOSSY: ") and words in plan.lossy and "stages 0, 1" in plan.lossy
        assert "gradients are those of the decompressed inputs" in plan.lossy and plan.lossy in plan.lines()
        assert RunPlan.from_json(plan.to_json()).lossy == plan.lossy


def test_what_cannot_be_compressed_is_refused_in_one_line():
    stash = CompressedStash("fp8", lambda *tensors: None)
    with pytest.raises(ValueError, match=r"^recompute.compress=fp8 cannot store a segment input of dtype torch.int64"):
        stash.pack(torch.zeros(2, 3, dtype=torch.long))
    with pytest.raises(ValueError, match=r"^recompute.compress=bf16 stores nothing less under train.precision=bf16"):
        check_compress("bf16", "bf16")
    with pytest.raises(ValueError, match=r"^recompute.compress='int4' is unknown: allowed values are none, bf16, fp8"):
        FullRecompute(compress="int4")


# Activations well above the gradients ReduceGrads flattens, so that storing less lowers the floor
AUTO_MODEL = GPTConfig(n_layer=8, n_head=4, n_embd=64, seq_len=256, vocab_size=128, dropout=0.0)
AUTO_RUN = RunShape(Topology(2), Target("cpu", "fp32"), micro_batches=6, micro_batch_size=4)


def test_auto_stores_compressed_only_when_allowed_and_where_that_lets_a_stage_fit():
    with pytest.raises(BudgetTooSmall) as refused:
        build_layout(AUTO_MODEL, AutoRecompute(budget_gb=1e-6, reserve_gb=0.0), AUTO_RUN, "type:Block", 0)
    lossy_gb = float(str(refused.value).split("recompute.compress=fp8 (lossy) fits at ")[1].split(",")[0])
    assert lossy_gb < refused.value.smallest_gb  # the refusal names lossy storage, priced
    with pytest.raises(BudgetTooSmall):  # not allowed: that budget does not fit
        build_layout(AUTO_MODEL, AutoRecompute(budget_gb=lossy_gb, reserve_gb=0.0), AUTO_RUN, "type:Block", 0)
    auto = AutoRecompute(budget_gb=lossy_gb, reserve_gb=0.0, compress="fp8")
    layout = build_layout(AUTO_MODEL, auto, AUTO_RUN, "type:Block", 0)
    plan = plan_run(AUTO_MODEL, auto, layout, AUTO_RUN)
    compressed = [s for s, p in enumerate(layout.plans) if p.compress == "fp8"]
    assert compressed and f"stage{'s' if len(compressed) > 1 else ''} {', '.join(map(str, compressed))}:" in plan.lossy
    assert any("segment inputs stored as fp8: lossy" in line for line in layout.describe_budgets(auto))
    roomy = AutoRecompute(budget_gb=1.0, reserve_gb=0.0, compress="fp8")  # nothing to recompute: nothing stored
    assert lossy_note(build_layout(AUTO_MODEL, roomy, AUTO_RUN, "type:Block", 0).plans) is None


@pytest.mark.parametrize("compress", ["bf16", "fp8", "int8"])
def test_a_compressed_plan_pays_its_compression_in_the_predicted_step(compress):
    """Each segment input stored compressed costs its passes' memory traffic at the table's price of a byte (here
    the analytic machine balance, FLOP-equivalents), charged with the recompute: full(2) on 4 blocks a stage, two
    segments each, is priced 2 x that above the same plan stored exactly, and its simulated step is longer."""
    layouts = [
        build_layout(AUTO_MODEL, FullRecompute(interval="2", compress=c), AUTO_RUN, "type:Block", 0)
        for c in ("none", compress)
    ]
    exact, compressed = (
        plan_run(AUTO_MODEL, r, layout, AUTO_RUN)
        for r, layout in zip((FullRecompute(interval="2"), FullRecompute(interval="2", compress=compress)), layouts)
    )
    timing = layouts[0].timing
    per_input = timing.table.compress_cost(compress)
    shape = Shape.of(AUTO_MODEL, AUTO_RUN.micro_batch_size)
    assert per_input == MACHINE_BALANCE["cpu"] * compress_traffic_bytes(shape, AUTO_RUN.target, compress) > 0
    for stage, plan in enumerate(layouts[1].plans):
        assert len(plan.segments) == 2 and plan.compress == compress
        extra = compressed.step_time.stage_recompute_s[stage] - exact.step_time.stage_recompute_s[stage]
        micro_batches = AUTO_RUN.micro_batches
        assert extra == pytest.approx(micro_batches * 2 * per_input * timing.seconds_per_cost)
    assert compressed.predicted_step_time_s > exact.predicted_step_time_s


@pytest.mark.parametrize("compress", ["bf16", "fp8", "int8"])
def test_auto_counts_a_compressed_stages_peak_as_the_plan_does(compress):
    """Auto's own count of each stage's peak (by parts) against the peak of the plan it chose (every block walked),
    at budgets from its floor up, with lossy storage allowed."""
    roomy = AutoRecompute(budget_gb=1.0, reserve_gb=0.0, compress=compress)
    floor = max(b.least_bytes for b in build_layout(AUTO_MODEL, roomy, AUTO_RUN, "type:Block", 0).budgets)
    stored = 0
    for factor in (1.0, 1.03, 1.1, 1.25):
        auto = AutoRecompute(budget_gb=factor * floor / GIB, reserve_gb=0.0, compress=compress)
        layout = build_layout(AUTO_MODEL, auto, AUTO_RUN, "type:Block", 0, price_alternatives=False)
        peaks = [s.predicted_peak_bytes for s in plan_run(AUTO_MODEL, auto, layout, AUTO_RUN).stages]
        assert peaks == [b.predicted_peak_bytes for b in layout.budgets], factor
        stored += sum(p.compress == compress for p in layout.plans)
    assert stored  # some of those plans store compressed


@pytest.mark.multiproc
def test_a_compressed_run_says_lossy_at_start_up_and_in_its_summary(case_runs, shared_runs):
    lossy = summary(case_runs["fp8"])["lossy"]
    assert lossy.startswith("LOSSY: ") and "float8 e4m3" in lossy
    assert f"stagecheck: {lossy}" in shared_runs.case_output()
