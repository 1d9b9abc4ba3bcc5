"""Recompute plans (pure) and their exactness on the unpipelined model."""

import pytest
import torch

from model import GPT, Block, GPTConfig, lm_loss
from parallel.planning.config import FullRecompute, NoRecompute, SelectiveRecompute
from parallel.planning.layout import build_layout
from parallel.planning.run_plan import plan_run
from parallel.planning.shapes import RunShape, Target, Topology
from parallel.planning.stage_plan import StagePlan, plan_stage
from parallel.runtime.recompute import apply_plan, run_stage

STAGE = [False, False, True, True, True, True, True]  # embeddings, then 5 blocks


@pytest.mark.parametrize(
    "interval, segments",
    [
        ("1", ((2, 3), (3, 4), (4, 5), (5, 6), (6, 7))),
        ("2", ((2, 4), (4, 6), (6, 7))),
        ("stage", ((2, 7),)),
        ("sqrt", ((2, 4), (4, 6), (6, 7))),
    ],
)
def test_full_segments_cover_only_blocks_and_start_at_the_first_block(interval, segments):
    assert plan_stage(STAGE, FullRecompute(interval=interval)).segments == segments


def test_nested_keeps_the_segments_and_marks_the_plan():
    plan = plan_stage(STAGE, FullRecompute(interval="2", nested=True))
    assert plan.segments == ((2, 4), (4, 6), (6, 7)) and plan.nested
    assert not plan_stage(STAGE, FullRecompute(interval="2")).nested


def test_selective_marks_every_block_and_nothing_else():
    plan = plan_stage(STAGE, SelectiveRecompute(modules=["core_attn", "mlp_act"]))
    assert plan.segments == ()
    assert sorted(plan.selective) == [2, 3, 4, 5, 6]
    assert plan.choice_of(0) == "none" and plan.choice_of(2) == "selective:core_attn+mlp_act"


def test_no_recompute_is_an_empty_plan():
    assert plan_stage(STAGE, NoRecompute()) == plan_stage([False, False], FullRecompute())


def _loss_and_grads(recompute):
    cfg = GPTConfig(n_layer=3, n_head=2, n_embd=32, seq_len=16, vocab_size=64, dropout=0.1, attention="math")
    model = GPT(cfg, seed=0)
    plan = plan_stage([isinstance(f, Block) for f in model.forward_funcs], recompute)
    apply_plan(model.forward_funcs, plan)
    idx = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    torch.manual_seed(5)  # the dropout stream
    loss = lm_loss(run_stage(model.forward_funcs, plan, idx, first_layer=0), idx)
    loss.backward()
    return loss.detach(), [p.grad for p in model.parameters()]


@pytest.mark.parametrize(
    "recompute",
    [
        FullRecompute(interval="1"),
        FullRecompute(interval="2"),
        FullRecompute(interval="stage"),
        SelectiveRecompute(),
        SelectiveRecompute(modules=["core_attn", "mlp_act", "layernorm"]),
        SelectiveRecompute(modules=["mlp", "layernorm"]),
    ],
    ids=repr,
)
def test_recompute_is_bit_exact_with_dropout(recompute):
    base_loss, base_grads = _loss_and_grads(NoRecompute())
    loss, grads = _loss_and_grads(recompute)
    assert torch.equal(loss, base_loss)
    assert all(torch.equal(g, b) for g, b in zip(grads, base_grads))


@pytest.mark.parametrize(
    "config, message",
    [
        (lambda: FullRecompute(interval="0"), "recompute.interval='0' is invalid"),
        (lambda: FullRecompute(interval="often"), "recompute.interval='often' is invalid"),
        (
            lambda: FullRecompute(interval="1", nested=True),
            "recompute.nested=true is invalid with recompute.interval=1: a one-block segment has nothing to nest",
        ),
        (
            lambda: SelectiveRecompute(modules=["attn"]),
            r"recompute.modules=\['attn'\] is invalid: choose one or more of core_attn",
        ),
    ],
)
def test_invalid_recompute_options(config, message):
    with pytest.raises(ValueError, match=message):
        config()


def test_a_stage_whose_peak_would_not_fall_runs_without_recompute():
    """Under full(stage) the last of 2 stages holds one micro-batch and its backward remakes all that `none` keeps:
    recomputing there would cost time on the critical path and save no memory, so that stage runs without recompute.
    Stage 0 (2 in flight) keeps its segment, and full(1), which lowers both stages' peaks, stays on both."""
    cfg = GPTConfig(n_layer=8, n_head=8, n_embd=256, seq_len=512, vocab_size=256, dropout=0.1, attention="math")
    run = RunShape(Topology(2), Target("cpu", "fp32"), micro_batches=4, micro_batch_size=1)

    def planned(recompute):
        layout = build_layout(cfg, recompute, run, "type:Block", 0)
        return layout.plans, [s.predicted_peak_bytes for s in plan_run(cfg, recompute, layout, run).stages]

    none_plans, none_peaks = planned(NoRecompute())
    stage_plans, stage_peaks = planned(FullRecompute(interval="stage"))
    one_plans, one_peaks = planned(FullRecompute(interval="1"))
    assert stage_plans[0].segments == ((2, 6),) and stage_plans[1] == StagePlan()
    assert stage_peaks[0] < none_peaks[0] and stage_peaks[1] == none_peaks[1]
    assert [len(p.segments) for p in one_plans] == [4, 4]
    assert all(one < none for one, none in zip(one_peaks, none_peaks))
