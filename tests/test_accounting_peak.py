"""The measured peak of activation bytes (harness/accounting.py's live_peak) follows the schedule the stage ran:
1F1B's windows of in-flight micro-batches, ZB-H1's pending W's, early recompute's remade bytes. Pure: the walk
of each schedule with bytes per micro-batch given by hand (the run's are measured; tests/test_zero_bubble.py
reads them back from a zb-h1 run)."""

import pytest
import torch

from harness.accounting import live_peak
from model import Block, GPTConfig, gpt_layers
from model.weight_grad import WeightGradStore, split_backward
from parallel.planning.memory_model import total
from parallel.planning.shapes import Shape, Target
from parallel.planning.weight_grad_bytes import weight_grad_items

KEPT = [10, 20, 30, 40]
"""Bytes each micro-batch's forward keeps until its backward: all different, so a wrong window shows."""


@pytest.mark.parametrize("stages", [1, 2, 3, 4])
@pytest.mark.parametrize("micro_batches", [1, 2, 5, 8])
def test_under_1f1b_it_is_the_largest_sum_of_consecutive_in_flight_micro_batches(stages, micro_batches):
    kept = [(7 * k) % 11 + k for k in range(micro_batches)]
    for stage in range(stages):
        window = min(stages - stage, micro_batches)  # DeepSpeed's 1F1B: stage s holds up to stages - s
        largest = max(sum(kept[i : i + window]) for i in range(micro_batches - window + 1))
        assert live_peak(kept, [], [], "1f1b", False, None, stages, stage) == largest


def test_zb_h1_counts_the_ws_still_pending():
    """Last of 2 stages, 4 micro-batches, W's deferred by one: F0 B0 F1 B1 W0 F2 B2 W1 F3 B3 W2 W3. 1F1B holds one
    micro-batch at a time (40 at most); here F3 runs while micro-batch 2's W is pending, and after B3 two W's are."""
    assert live_peak(KEPT, [], [], "1f1b", False, None, 2, 1) == 40
    assert live_peak(KEPT, [], [5] * 4, "zb-h1", False, None, 2, 1) == 40 + 5
    assert live_peak(KEPT, [], [50] * 4, "zb-h1", False, None, 2, 1) == 2 * 50  # the peak moves to the step's end
    assert live_peak(KEPT, [], [5] * 4, "zb-h1", False, 0, 2, 1) == 40  # nothing deferred: 1F1B's backward in two


def test_early_recompute_counts_the_remade_bytes_before_the_backward():
    """First of 2 stages: F0 F1 R0 B0 F2 R1 B1 F3 R2 B2 R3 B3. 1F1B's largest window is F2..F3 (70); micro-batch
    2's early recompute adds its 3 while both are held."""
    assert live_peak(KEPT, [], [], "1f1b", False, None, 2, 0) == 30 + 40
    assert live_peak(KEPT, [1, 2, 3, 4], [], "1f1b", True, None, 2, 0) == 30 + 40 + 3
    assert live_peak(KEPT, [100, 0, 0, 0], [], "1f1b", True, None, 2, 0) == 10 + 20 + 100  # at micro-batch 0's


def test_a_deferring_backward_measures_what_the_planner_says_a_block_holds_until_its_w():
    """The W-pending bytes the run feeds the walk: a block's Linear inputs and output gradients, each storage once."""
    cfg = GPTConfig(n_layer=1, n_head=2, n_embd=32, seq_len=16, vocab_size=64)
    (block,) = [recipe.build() for recipe in gpt_layers(cfg, seed=0) if recipe.module_class is Block]
    x = torch.randn(2, 16, 32, requires_grad=True)  # (b, s, h)
    store = WeightGradStore()
    store.measure = True
    with split_backward(), store.deferring():
        out = block(x)
        out.backward(torch.randn_like(out))
    planned = total(weight_grad_items(Shape.of(cfg, micro_batch_size=2), Target("cpu", "fp32")))
    assert store.held_bytes == [planned] and planned == 2 * 16 * 32 * 4 * (4 + 2 + 5 + 5)
