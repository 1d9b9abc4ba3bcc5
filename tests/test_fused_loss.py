"""The fused, chunked LM head and loss (model.loss_chunk_tokens): the loss, the hidden states' gradient and the tied
weight's gradient equal the unfused path's to fp32 rounding, alone and across two pipeline stages (each stage with
its own copy of the tied weight); the planner's bytes equal the measured bytes with it on and off; a negative chunk
is refused at start-up."""

import dataclasses

import pytest
import torch

from model import GPT, GPTConfig, gpt_layers, lm_loss
from model.fused_loss import HeadLoss, chunked_lm_loss
from model.layers import final_hidden, head_logits
from parallel.measurement.local_stages import LocalPipeline
from parallel.planning.config import FullRecompute, NoRecompute, SelectiveRecompute
from parallel.planning.layout import build_layout
from parallel.planning.run_plan import plan_run
from parallel.planning.shapes import RunShape, Target, Topology
from tests.runs import TINY, python_run


def unfused_and_fused(chunk_tokens: int, tokens: int = 50, width: int = 24, vocab: int = 97):
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(2, tokens // 2, width, generator=g)  # (B, T, C)
    weight = torch.randn(vocab, width, generator=g) * 0.3  # (V, C)
    labels = torch.randint(0, vocab, (2, tokens // 2), generator=g)  # (B, T)
    results = []
    for loss_of in (
        lambda h, w: lm_loss(head_logits(h, w), labels),
        lambda h, w: chunked_lm_loss(h, w, labels, chunk_tokens),
    ):
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        loss = loss_of(h, w)
        (3.0 * loss).backward()  # a gradient other than 1 reaches the loss, as under loss scaling
        results.append((loss.detach(), h.grad, w.grad))
    return results


@pytest.mark.parametrize("chunk_tokens", [1, 7, 25, 50, 4096])
def test_fused_loss_and_gradients_equal_the_unfused_path_to_fp32_rounding(chunk_tokens):
    (loss, grad_h, grad_w), (fused_loss, fused_h, fused_w) = unfused_and_fused(chunk_tokens)
    # fp32 epsilon is 1.2e-7; sums over 50 tokens and 97 logits reorder, so allow a few dozen ulps.
    torch.testing.assert_close(fused_loss, loss, rtol=2e-6, atol=0)
    torch.testing.assert_close(fused_h, grad_h, rtol=1e-5, atol=1e-5 * grad_h.abs().max().item())
    torch.testing.assert_close(fused_w, grad_w, rtol=1e-5, atol=1e-5 * grad_w.abs().max().item())
    assert not torch.equal(grad_w, torch.zeros_like(grad_w))


def test_the_bound_is_tight_enough_to_see_a_wrong_gradient():
    (_, _, grad_w), (_, _, fused_w) = unfused_and_fused(7)
    wrong = fused_w.clone()
    wrong[3, 5] += 1e-4 * grad_w.abs().max().item()  # one element off by a hundred of the allowed error
    with pytest.raises(AssertionError):
        torch.testing.assert_close(wrong, grad_w, rtol=1e-5, atol=1e-5 * grad_w.abs().max().item())


def test_the_pipelined_head_returns_hidden_states_and_the_unpipelined_gpt_logits():
    cfg = GPTConfig(n_layer=2, n_head=2, n_embd=32, seq_len=16, vocab_size=64)
    assert cfg.loss_chunk_tokens > 0  # on by default
    assert gpt_layers(cfg, seed=0)[-1].forward_fn is final_hidden
    assert HeadLoss.of(gpt_layers(cfg, seed=0)) == HeadLoss(cfg.loss_chunk_tokens)
    assert HeadLoss.of(gpt_layers(cfg, seed=0, logits=True)) == HeadLoss(0)
    idx = torch.randint(0, 64, (2, 16))
    assert GPT(cfg, seed=0)(idx).shape == (2, 16, 64)


def pipeline_step(cfg: GPTConfig, recompute, stages: int = 2, precision: str = "fp32", measure: bool = False):
    run = RunShape(Topology(stages), Target("cpu", precision), micro_batches=2, micro_batch_size=2)
    layout = build_layout(cfg, recompute, run, "type:Block", seed=0)
    pipe = LocalPipeline(layout, precision)
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randint(0, cfg.vocab_size, (2, 16), generator=g),) * 2 for _ in range(2)]
    torch.manual_seed(5)  # the dropout stream
    loss = pipe.step(batches, measure=measure)
    return pipe, plan_run(cfg, recompute, layout, run), loss


@pytest.mark.parametrize("recompute", [NoRecompute(), FullRecompute(interval="1"), SelectiveRecompute()], ids=repr)
def test_two_stages_give_the_unfused_loss_and_gradients_with_each_copy_of_the_tied_weight(recompute):
    cfg = GPTConfig(n_layer=4, n_head=2, n_embd=32, seq_len=16, vocab_size=64, dropout=0.1, attention="math")
    unfused, _, loss = pipeline_step(dataclasses.replace(cfg, loss_chunk_tokens=0), recompute)
    fused, _, fused_loss = pipeline_step(dataclasses.replace(cfg, loss_chunk_tokens=5), recompute)
    torch.testing.assert_close(fused_loss, loss, rtol=2e-6, atol=0)
    for stage, fused_stage in zip(unfused.stages, fused.stages):
        for (name, p), q in zip(stage.named_parameters(), fused_stage.parameters()):
            scale = p.grad.abs().max().item()
            torch.testing.assert_close(q.grad, p.grad, rtol=1e-5, atol=1e-5 * scale, msg=name)
    # the first stage's copy of the tied weight has the embedding's gradient, the last stage's the head's
    assert fused.stages[-1].layers[-1].wte.weight.grad is not None


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("chunk_tokens", [0, 5, 64])
def test_planned_last_stage_bytes_equal_measured_with_the_loss_fused_or_not(chunk_tokens, precision):
    cfg = GPTConfig(
        n_layer=4, n_head=2, n_embd=32, seq_len=16, vocab_size=512, dropout=0.1, loss_chunk_tokens=chunk_tokens
    )
    pipe, plan, _ = pipeline_step(cfg, NoRecompute(), precision=precision, measure=True)
    for stage, planned in zip(pipe.stages, plan.stages):
        assert stage.meter.bytes_per_micro_batch() == [planned.activation_bytes_per_microbatch] * 2


def test_the_fused_loss_keeps_no_logits():
    cfg = GPTConfig(n_layer=4, n_head=2, n_embd=32, seq_len=16, vocab_size=512, dropout=0.1)
    unfused = pipeline_step(dataclasses.replace(cfg, loss_chunk_tokens=0), NoRecompute(), measure=True)[0]
    fused = pipeline_step(cfg, NoRecompute(), measure=True)[0]
    saved = unfused.stages[-1].meter.bytes_per_micro_batch()[0] - fused.stages[-1].meter.bytes_per_micro_batch()[0]
    tokens = 2 * 16
    # the fp32 log-probabilities and the scalar go; an fp32 log-sum-exp per token comes
    assert saved == tokens * 512 * 4 + 4 - tokens * 4
    assert fused.stages[0].meter.bytes_per_micro_batch() == unfused.stages[0].meter.bytes_per_micro_batch()


def test_a_negative_chunk_is_refused_at_start_up(tmp_path):
    result = python_run(tmp_path / "run", *TINY, "model.loss_chunk_tokens=-1", check=False, timeout=120)
    assert result.returncode == 2
    assert "model.loss_chunk_tokens=-1 is invalid: allowed values are 0" in result.stderr
    assert "Traceback" not in result.stderr + result.stdout
    assert not (tmp_path / "run").exists()
