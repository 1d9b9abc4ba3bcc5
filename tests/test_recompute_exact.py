"""Every `recompute.modules` combination (and every full interval, nested or not) is bit-exact with no recompute:
the same loss and the same gradients, dropout on (each layer's masks keyed by micro-batch and layer, as every
pipeline draws them: parallel/runtime/dropout_keys.py), on the unpipelined GPT run through
parallel.runtime.recompute.run_stage, for both attention kernels."""

import pytest
import torch

from model import GPT, Block, GPTConfig, lm_loss
from parallel.planning.config import FullRecompute, NoRecompute, SelectiveRecompute
from parallel.planning.memory_model import selective_combinations
from parallel.planning.stage_plan import plan_stage
from parallel.runtime.dropout_keys import DropoutKeys, keyed_forward
from parallel.runtime.recompute import apply_plan, run_stage

COMBOS = selective_combinations()


def loss_and_grads(recompute, attention: str, **model_options):
    """Two micro-batches' losses and the accumulated gradients of a tiny GPT with dropout under `recompute`;
    `model_options`: more GPTConfig fields (tests/test_packed_dropout.py: packed_dropout)."""
    cfg = GPTConfig(
        n_layer=3, n_head=2, n_embd=32, seq_len=16, vocab_size=64, dropout=0.1, attention=attention, **model_options
    )
    model = GPT(cfg, seed=0)
    plan = plan_stage([isinstance(f, Block) for f in model.forward_funcs], recompute)
    apply_plan(model.forward_funcs, plan)
    idx = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    losses = []
    for micro_batch in range(2):  # a segment's recompute must redraw each of its layers' keyed masks
        with keyed_forward(DropoutKeys(seed=5).micro_batch(0, micro_batch)):
            loss = lm_loss(run_stage(model.forward_funcs, plan, idx, first_layer=0), idx)
        loss.backward()
        losses.append(loss.detach())
    return losses, [p.grad.clone() for p in model.parameters()]


def test_there_are_eleven_valid_combinations():
    assert len(COMBOS) == 11 and ("mlp", "mlp_act") not in COMBOS


@pytest.mark.parametrize("attention", ["math", "sdpa"])
@pytest.mark.parametrize(
    "recompute",
    [
        *[SelectiveRecompute(modules=list(c)) for c in COMBOS],
        FullRecompute(interval="1"),
        FullRecompute(interval="2"),
        FullRecompute(interval="stage"),
        FullRecompute(interval="sqrt"),
        FullRecompute(interval="2", nested=True),
        FullRecompute(interval="stage", nested=True),
    ],
    ids=lambda r: (
        getattr(r, "interval", "") + ("-nested" if getattr(r, "nested", False) else "") or "+".join(r.modules)
    ),
)
def test_recompute_is_bit_exact_with_none(recompute, attention):
    base_losses, base_grads = loss_and_grads(NoRecompute(), attention)
    losses, grads = loss_and_grads(recompute, attention)
    assert all(torch.equal(a, b) for a, b in zip(losses, base_losses))
    assert len(grads) == len(base_grads)
    assert all(torch.equal(g, b) for g, b in zip(grads, base_grads))
