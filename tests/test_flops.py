"""FLOP counts of the planner against torch.utils.flop_counter.FlopCounterMode on the tiny model (a whole
2-stage training step, recompute included), the 6(N + hV) + 12 L h s formula, and the peak table."""

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from model import GPT, GPTConfig, gpt_layers, layer_param_counts
from parallel.measurement.local_stages import LocalPipeline
from parallel.planning.config import FullRecompute, NoRecompute, SelectiveRecompute
from parallel.planning.flops import (
    head_flops_per_token,
    lookup_peak_tflops,
    model_flops_per_token,
    non_embedding_params,
)
from parallel.planning.layout import build_layout
from parallel.planning.memory_model import selective_combinations
from parallel.planning.run_plan import plan_run
from parallel.planning.shapes import RunShape, Target, Topology

MODES = [
    NoRecompute(),
    FullRecompute(interval="1"),
    FullRecompute(interval="2"),
    FullRecompute(interval="stage"),
    FullRecompute(interval="2", nested=True),
    FullRecompute(interval="stage", nested=True),
    *[SelectiveRecompute(modules=list(combo)) for combo in selective_combinations()],
]


def tiny(dropout: float, attention: str = "math") -> GPTConfig:
    return GPTConfig(n_layer=4, n_head=4, n_embd=32, seq_len=16, vocab_size=64, dropout=dropout, attention=attention)


def counted_and_planned(recompute, dropout: float, attention: str = "math", micro_batch_size: int = 2):
    cfg = tiny(dropout, attention)
    run = RunShape(Topology(2), Target("cpu", "fp32"), micro_batches=1, micro_batch_size=micro_batch_size)
    layout = build_layout(cfg, recompute, run, "type:Block", seed=0)
    plan = plan_run(cfg, recompute, layout, run)
    tokens = torch.randint(0, 64, (micro_batch_size, 16), generator=torch.Generator().manual_seed(0))
    with FlopCounterMode(display=False) as counter:
        LocalPipeline(layout).step([(tokens, tokens)])
    return counter.get_total_flops(), plan


# sdpa without dropout runs PyTorch's CPU flash kernel, which FlopCounterMode does not count (no formula
# is registered for it); with dropout on CPU it runs the math backend, made of counted matmuls.
@pytest.mark.parametrize("attention, dropout", [("math", 0.1), ("math", 0.0), ("sdpa", 0.1)])
@pytest.mark.parametrize("recompute", MODES, ids=repr)
def test_hardware_flops_match_flop_counter_mode(recompute, attention, dropout):
    counted, plan = counted_and_planned(recompute, dropout, attention)
    assert counted == sum(s.hardware_flops_per_step for s in plan.stages)
    assert plan.flops.matmul_flops_per_step == sum(s.model_flops_per_step for s in plan.stages)


def test_model_flops_formula_matches_counted_matmuls_up_to_biases_and_norms():
    counted, plan = counted_and_planned(NoRecompute(), dropout=0.1)
    # no recompute: model FLOPs = what runs, but for the fused loss's second forward of the head (its own recompute)
    head_forward = plan.flops.head_flops_per_token // 3 * plan.flops.tokens_per_step
    assert counted == plan.flops.matmul_flops_per_step + head_forward
    # 6N counts biases and LayerNorm gains as if they were matmul weights: 6 (13 h L + 2 h) per token more.
    cfg = tiny(0.1)
    extra = 6 * (13 * cfg.n_embd * cfg.n_layer + 2 * cfg.n_embd) * plan.flops.tokens_per_step
    assert plan.flops.model_flops_per_step == counted - head_forward + extra


@pytest.mark.parametrize("bias", [True, False])
def test_non_embedding_params_exclude_both_embeddings_and_count_the_tied_head_once(bias):
    cfg = GPTConfig(n_layer=12, n_head=12, n_embd=768, seq_len=1024, vocab_size=50257, bias=bias)
    with torch.device("meta"):
        model = GPT(cfg, seed=0)
    total = sum(p.numel() for p in model.parameters())  # the tied weight appears once
    recipes = gpt_layers(cfg, seed=0)
    n = non_embedding_params(recipes, layer_param_counts(recipes))
    assert n == total - 50257 * 768 - 1024 * 768
    # The closed form: per block 12 h^2 weights, 9 h biases (QKV 3h, projection h, MLP 4h + h) and two LayerNorms
    # (h gains, h biases each); then the final LayerNorm.
    h, layers = 768, 12
    assert n == layers * (12 * h * h + bias * 9 * h + (2 + 2 * bias) * h) + (1 + bias) * h
    assert model_flops_per_token(cfg, n) == 6 * (n + 768 * 50257) + 12 * 12 * 768 * 1024
    assert head_flops_per_token(cfg) == 6 * 768 * 50257


# full(stage) on 4 micro-batches: stage 0 (2 in flight) recomputes its blocks; stage 1 (1 in flight) would remake in
# its backward all that `none` keeps, its peak would not fall, so it runs without recompute: half the extra forward.
@pytest.mark.parametrize("interval, lo, hi", [("1", 1.31, 1.35), ("stage", 1.15, 1.18)])
def test_full_recompute_costs_one_extra_forward_at_the_benchmark_shape(interval, lo, hi):
    cfg = GPTConfig(n_layer=8, n_head=8, n_embd=256, seq_len=512, vocab_size=256, dropout=0.1, attention="math")
    recompute = FullRecompute(interval=interval)
    run = RunShape(Topology(2), Target("cpu", "fp32"), micro_batches=4, micro_batch_size=1)
    plan = plan_run(cfg, recompute, build_layout(cfg, recompute, run, "type:Block", 0), run)
    assert lo <= plan.flops.hardware_over_model <= hi


def test_early_stop_skips_the_last_matmul_of_a_segment_without_dropout():
    counted_on, _ = counted_and_planned(FullRecompute(interval="1"), dropout=0.1)
    counted_off, _ = counted_and_planned(FullRecompute(interval="1"), dropout=0.0)
    # 4 one-block segments, each without its MLP output matmul (2 * tokens * 4h * h) when dropout is off.
    assert counted_on - counted_off == 4 * 2 * (2 * 16) * 4 * 32 * 32


@pytest.mark.parametrize(
    "name, precision, peak",
    [
        ("NVIDIA H100 80GB HBM3", "bf16", 989.0),
        ("NVIDIA H100 PCIe", "bf16", 756.0),
        ("NVIDIA A100-SXM4-80GB", "bf16", 312.0),
        ("NVIDIA A100-SXM4-40GB", "fp32", 19.5),
        ("NVIDIA H200", "fp16", 989.0),
        ("Tesla V100-SXM2-16GB", "bf16", None),
        ("Some Future GPU", "bf16", None),
        (None, "fp32", None),
    ],
)
def test_peak_tflops_table(name, precision, peak):
    assert lookup_peak_tflops(name, precision) == peak
