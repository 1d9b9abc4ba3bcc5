"""Dropout keyed by layer and micro-batch (parallel/runtime/dropout_keys.py): a layer's masks depend on (seed, replica,
step, micro-batch, layer) alone, not on the order micro-batches run in nor on where the stage boundaries fall; outside
a keyed forward, run_stage draws from the caller's stream. The unpipelined GPT through run_stage, in one process."""

import torch

from model import GPT, GPTConfig
from parallel.planning.stage_plan import StagePlan
from parallel.runtime.dropout_keys import DropoutKeys, keyed_forward
from parallel.runtime.recompute import run_stage

CFG = GPTConfig(n_layer=2, n_head=2, n_embd=16, seq_len=8, vocab_size=32, dropout=0.5)
KEYS = DropoutKeys(seed=3, replica=1)


def outputs(model: GPT, micro_batches: list[torch.Tensor], order: list[int], split: int, step: int = 0):
    """Each micro-batch's output, run in `order`, its layers as two stages split before layer `split`."""
    funcs, out = model.forward_funcs, {}
    for k in order:
        with keyed_forward(KEYS.micro_batch(step, k)):
            hidden = run_stage(funcs[:split], StagePlan(), micro_batches[k], first_layer=0)
            out[k] = run_stage(funcs[split:], StagePlan(), hidden, first_layer=split)
    return [out[k] for k in sorted(out)]


def test_masks_are_the_same_whatever_the_order_and_the_stage_boundaries():
    model = GPT(CFG, seed=0)
    g = torch.Generator().manual_seed(0)
    micro_batches = [torch.randint(0, 32, (2, 8), generator=g) for _ in range(3)]
    reference = outputs(model, micro_batches, [0, 1, 2], split=2)
    torch.manual_seed(123)  # the process stream plays no part
    for order, split in (([2, 0, 1], 2), ([1, 2, 0], 3), ([0, 1, 2], 1)):
        assert all(torch.equal(a, b) for a, b in zip(outputs(model, micro_batches, order, split), reference))
    # Another step, or the same tokens as another micro-batch, draws other masks.
    same_tokens = [micro_batches[0]] * 2
    first, second = outputs(model, same_tokens, [0, 1], split=2)
    assert not torch.equal(first, second)
    assert not torch.equal(outputs(model, micro_batches, [0], split=2, step=1)[0], reference[0])


def test_outside_a_keyed_forward_the_callers_stream_draws_the_masks():
    model = GPT(CFG, seed=0)
    tokens = torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(0))
    drawn = []
    for _ in range(2):
        torch.manual_seed(7)
        drawn.append(run_stage(model.forward_funcs, StagePlan(), tokens, first_layer=0))
    assert torch.equal(*drawn)
    torch.manual_seed(8)
    assert not torch.equal(run_stage(model.forward_funcs, StagePlan(), tokens, first_layer=0), drawn[0])
