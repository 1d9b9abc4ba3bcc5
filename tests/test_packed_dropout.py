"""1-bit dropout masks (model.packed_dropout): the bits round-trip; on CPU the packed dropout is torch's dropout bit
for bit (same draws, same values, same gradients); every recompute mode with packed masks is bit-identical to no
recompute with torch's masks; the planner's mask bytes (ceil(numel / 8)) equal the measured bytes; with dropout 0
the option is only reported as a no-op."""

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from model import GPTConfig
from model.packed_dropout import pack_bits, packed_dropout, unpack_bits
from parallel.measurement.local_stages import LocalPipeline
from parallel.planning.config import FullRecompute, NoRecompute, SelectiveRecompute
from parallel.planning.layout import build_layout
from parallel.planning.memory_model import block_items, selective_combinations, total
from parallel.planning.run_plan import plan_run
from parallel.planning.shapes import RunShape, Shape, Target, Topology
from tests.runs import TINY, summary
from tests.shared_runs import case
from tests.test_recompute_exact import loss_and_grads as exact_loss_and_grads


@pytest.mark.parametrize("numel", [1, 7, 8, 9, 64, 1001])
def test_bits_round_trip_in_ceil_numel_over_8_bytes(numel):
    mask = torch.rand(numel, generator=torch.Generator().manual_seed(numel)) < 0.5
    packed = pack_bits(mask)
    assert packed.dtype == torch.uint8 and packed.numel() == -(-numel // 8)
    assert torch.equal(unpack_bits(packed, mask.shape), mask)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_dropout_is_torchs_cpu_dropout_bit_for_bit(dtype):
    x = torch.randn(2, 4, 15, 15, dtype=dtype, requires_grad=True)  # an odd numel: the last byte is partial
    grad = torch.randn(x.shape, dtype=dtype)
    results = []
    for dropout in (F.dropout, packed_dropout):
        torch.manual_seed(3)
        y = dropout(x, 0.3, True)
        y.backward(grad)
        results.append((y.detach(), x.grad.clone(), torch.get_rng_state()))
        x.grad = None
    (y, g, rng), (packed_y, packed_g, packed_rng) = results
    assert torch.equal(packed_y, y) and torch.equal(packed_g, g)
    assert torch.equal(packed_rng, rng)  # the same numbers were drawn: the stream goes on alike
    assert 0 < int((y == 0).sum()) < y.numel()


def loss_and_grads(recompute, attention: str, packed: bool):
    return exact_loss_and_grads(recompute, attention, packed_dropout=packed)


RECOMPUTES = [
    NoRecompute(),
    *[SelectiveRecompute(modules=list(c)) for c in selective_combinations()],
    FullRecompute(interval="1"),
    FullRecompute(interval="stage"),
]


@pytest.mark.parametrize("attention", ["math", "sdpa"])
def test_every_mode_with_packed_masks_is_bit_identical_to_unpacked_no_recompute(attention):
    base_losses, base_grads = loss_and_grads(NoRecompute(), attention, packed=False)
    for recompute in RECOMPUTES:
        losses, grads = loss_and_grads(recompute, attention, packed=True)
        assert all(torch.equal(a, b) for a, b in zip(losses, base_losses)), recompute
        assert all(torch.equal(g, b) for g, b in zip(grads, base_grads)), recompute


@pytest.mark.parametrize("recompute", [NoRecompute(), SelectiveRecompute(), FullRecompute(interval="1")], ids=repr)
@pytest.mark.parametrize("attention, precision", [("math", "fp32"), ("math", "bf16"), ("sdpa", "fp32")])
def test_planned_bytes_equal_measured_with_packed_masks(recompute, attention, precision):
    # b s h = 2 x 15 x 6 = 180 and b a s^2 = 900 elements: neither a multiple of 8, so the last bytes are partial
    cfg = GPTConfig(
        n_layer=4, n_head=2, n_embd=6, seq_len=15, vocab_size=64, dropout=0.1, attention=attention, packed_dropout=True
    )
    run = RunShape(Topology(2), Target("cpu", precision), micro_batches=2, micro_batch_size=2)
    layout = build_layout(cfg, recompute, run, "type:Block", seed=0)
    plan = plan_run(cfg, recompute, layout, run)
    pipe = LocalPipeline(layout, precision)
    g = torch.Generator().manual_seed(0)
    pipe.step([(torch.randint(0, 64, (2, 15), generator=g),) * 2 for _ in range(2)], measure=True)
    for stage, planned in zip(pipe.stages, plan.stages):
        assert stage.meter.bytes_per_micro_batch() == [planned.activation_bytes_per_microbatch] * 2


def test_packed_masks_cost_one_bit_an_element():
    shape = Shape(b=2, s=15, h=6, a=2, vocab=64, dropout=True, attention="math")
    target = Target("cpu", "fp32")
    unpacked = total(block_items(shape, target))
    packed = total(block_items(dataclasses.replace(shape, packed_dropout=True), target))
    # the two residual masks (b s h each) and the attention-probability mask (b a s^2): 4 bytes -> a bit each
    assert unpacked - packed == 2 * (180 * 4 - 23) + (900 * 4 - 113)


NO_OP = ["model.dropout=0", "model.packed_dropout=true", "train.steps=1", "train.trace_step=0", "logger=none"]
CASES = {"no-op": case(*TINY, *NO_OP)}


@pytest.mark.multiproc
def test_packed_dropout_with_dropout_0_is_reported_as_a_no_op(case_runs, shared_runs):
    assert summary(case_runs["no-op"])["losses"]  # it trained, and at start-up it said:
    assert "model.packed_dropout=true is a no-op: model.dropout is 0" in shared_runs.case_output()
