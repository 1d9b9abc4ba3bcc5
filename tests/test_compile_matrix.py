"""The compiled exactness matrix (`make test-compile`, left out of `make test` for its compile time): every recompute
mode train.compile accepts (+recompute=auto planned from compiled bytes too), for both model families, packed dropout
masks and either loss (fused or not), is bit-identical to the compiled `none` run with dropout on, with no graph break
and nothing compiled after the first step."""

import gc

import pytest
import torch
from torch._subclasses.fake_tensor import is_fake

from model import GPTConfig
from parallel.measurement.compiled_bytes import compiled_options, measure_compiled_blocks
from parallel.measurement.tensor_peak import live_storages
from parallel.planning.config import AutoRecompute, FullRecompute, NoRecompute, SelectiveRecompute
from parallel.planning.shapes import RunShape, Target, Topology
from tests.compiled_runs import (
    EAGER,
    MICRO_BATCH_SIZE,
    MICRO_BATCHES,
    assert_bit_identical,
    auto_between,
    compiled_steps,
)

pytestmark = pytest.mark.compile

GPT2 = dict(n_layer=4, n_head=2, n_embd=32, seq_len=16, vocab_size=64, dropout=0.1)
LLAMA = dict(
    arch="llama", activation="silu", bias=False, tie_embeddings=False, intermediate_size=64, n_layer=4, n_head=4,
    n_kv_head=2, n_embd=32, seq_len=16, vocab_size=64, dropout=0.0,
)  # fmt: skip
ACCEPTED = [
    FullRecompute(interval="1"),
    FullRecompute(interval="2"),
    FullRecompute(interval="stage"),
    FullRecompute(interval="1", micro_batches=1),
    SelectiveRecompute(modules=["core_attn"]),
    SelectiveRecompute(modules=["mlp"]),
    SelectiveRecompute(modules=["mlp_act"]),
    SelectiveRecompute(modules=["core_attn", "mlp_act"]),
    SelectiveRecompute(modules=["core_attn", "mlp"], micro_batches=1),
]
CONFIGS = {
    "gpt2": GPTConfig(**GPT2),
    "gpt2-packed-dropout-unfused-loss": GPTConfig(**GPT2, packed_dropout=True, loss_chunk_tokens=0),
    "llama": GPTConfig(**LLAMA),
}


@pytest.fixture(scope="module", params=list(CONFIGS))
def family(request):
    config = CONFIGS[request.param]
    return config, compiled_steps(config, NoRecompute())


@pytest.mark.parametrize("recompute", ACCEPTED, ids=str)
def test_every_accepted_mode_compiled_is_bit_identical_to_compiled_none(family, recompute):
    config, reference = family
    run = compiled_steps(config, recompute)
    assert_bit_identical(run, reference)
    assert run.first.graph_breaks == run.later.graph_breaks == 0
    assert run.first.graphs >= 1  # compiled indeed
    assert run.later.graphs == 0  # the second step's micro-batches and both stages reuse the first step's graphs


def test_auto_compiled_is_bit_identical_to_compiled_none(family):
    """+recompute=auto planned from what a compiled block keeps under each option it weighs (measured, as start-up
    measures it), at a budget between its floor and none's peak: its plan recomputes, and runs compiled none's losses
    and gradients bit for bit."""
    config, reference = family
    blocks = measure_compiled_blocks(config, MICRO_BATCH_SIZE, EAGER, compiled_options(AutoRecompute()))
    compiled = Target("cpu", "fp32", blocks)
    auto = auto_between(config, RunShape(Topology(2), compiled, MICRO_BATCHES, MICRO_BATCH_SIZE))
    run = compiled_steps(config, auto, target=compiled)
    assert any(plan.selective or plan.segments for plan in run.plans)
    assert not any(plan.nested or plan.early for plan in run.plans)
    assert_bit_identical(run, reference)
    assert run.first.graph_breaks == run.later.graph_breaks == 0
    assert run.first.graphs >= 1 and run.later.graphs == 0
    # The compiler's fake tensors stay alive in its caches, and the CPU peak meter's scan of live tensors skips them.
    assert any(is_fake(obj) for obj in gc.get_objects() if issubclass(type(obj), torch.Tensor))
    live_storages()


def test_compiled_none_against_eager_none(family):
    """Eager stays the reference: a compiled run is not bit-identical to it (inductor draws dropout from its own
    generator and fuses ops into other roundings), but its losses agree to float32 rounding where dropout is off."""
    config, reference = family
    eager = compiled_steps(config, NoRecompute(), compile=False)
    if config.dropout == 0:
        for compiled_loss, eager_loss in zip(reference.losses, eager.losses):
            assert compiled_loss.item() == pytest.approx(eager_loss.item(), rel=1e-5)
    else:
        assert reference.losses[0].item() != eager.losses[0].item()
