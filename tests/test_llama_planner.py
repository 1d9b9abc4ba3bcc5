"""The analytic planner on the Llama block against the saved-tensor meter and FlopCounterMode, in process: every
recompute mode and interval, both attention kernels, fp32 and bf16, tied and untied heads, the fused and the unfused
loss. The planner mirrors the code, so the two must agree to the byte. Plus the per-block formula of
docs/llama.md at Llama-3-8B's shape."""

from dataclasses import replace

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from model import GPT, GPTConfig, LlamaBlock
from model.weight_grad import WeightGradStore
from parallel.measurement.local_stages import LocalPipeline
from parallel.measurement.stage_replay import StageReplay
from parallel.planning.config import FullRecompute, NoRecompute, SelectiveRecompute
from parallel.planning.layout import build_layout
from parallel.planning.memory_model import llama_block_items, selective_combinations, total
from parallel.planning.plan_record import PaperBytes
from parallel.planning.run_plan import block_choices, plan_run
from parallel.planning.shapes import RunShape, Shape, Target, Topology
from parallel.planning.stage_plan import plan_stage
from parallel.runtime.recompute import apply_plan
from tests.test_activation_planner import mode_id
from tests.test_zero_bubble import early_recomputed_bytes, two_micro_batches

MODES = [
    NoRecompute(),
    FullRecompute(interval="1"),
    FullRecompute(interval="2"),
    FullRecompute(interval="stage"),
    *[SelectiveRecompute(modules=list(combo)) for combo in selective_combinations()],
]
# (attention kernel, precision, tied head, loss_chunk_tokens): each CPU attention path in both dtypes, both heads
VARIANTS = [
    ("sdpa", "fp32", False, 0),
    ("sdpa", "bf16", True, 16),
    ("math", "fp32", True, 0),
    ("math", "bf16", False, 16),
]


def llama(**overrides) -> GPTConfig:
    fields = dict(arch="llama", n_layer=5, n_head=4, n_kv_head=2, n_embd=32, intermediate_size=88, seq_len=16)
    fields.update(vocab_size=64, activation="silu", bias=False, dropout=0.0, tie_embeddings=False)
    return GPTConfig(**{**fields, **overrides})


# Qwen3's block: q and k normed per head, and a head_dim that makes q twice the hidden size (as Qwen3-0.6B's).
QWEN3 = {"head_dim": 16, "qk_norm": True}


def run_llama(recompute, attention, precision, tied, chunk, stages=2, micro_batch_size=2, **overrides):
    cfg = llama(attention=attention, tie_embeddings=tied, loss_chunk_tokens=chunk, **overrides)
    run = RunShape(Topology(stages), Target("cpu", precision), micro_batches=2, micro_batch_size=micro_batch_size)
    layout = build_layout(cfg, recompute, run, "type:Block", seed=0)
    plan = plan_run(cfg, recompute, layout, run)
    pipe = LocalPipeline(layout, precision)
    g = torch.Generator().manual_seed(0)
    batches = [tuple(torch.randint(0, 64, (micro_batch_size, 16), generator=g) for _ in range(2)) for _ in range(2)]
    return cfg, pipe, plan, batches


@pytest.mark.parametrize("attention, precision, tied, chunk", VARIANTS, ids=lambda v: str(v))
@pytest.mark.parametrize("recompute", MODES, ids=mode_id)
def test_planned_bytes_equal_measured_bytes(recompute, attention, precision, tied, chunk):
    _, pipe, plan, batches = run_llama(recompute, attention, precision, tied, chunk)
    pipe.step(batches, measure=True)
    for stage, planned in zip(pipe.stages, plan.stages):
        assert stage.meter.bytes_per_micro_batch() == [planned.activation_bytes_per_microbatch] * 2
        assert stage.meter.stage_input_bytes() == [planned.stage_input_bytes] * 2


@pytest.mark.parametrize("attention, precision", [("sdpa", "fp32"), ("math", "bf16")])
@pytest.mark.parametrize("recompute", MODES, ids=mode_id)
def test_qwen3_planned_bytes_equal_measured_bytes(recompute, attention, precision):
    _, pipe, plan, batches = run_llama(recompute, attention, precision, False, 0, **QWEN3)
    pipe.step(batches, measure=True)
    for stage, planned in zip(pipe.stages, plan.stages):
        assert stage.meter.bytes_per_micro_batch() == [planned.activation_bytes_per_microbatch] * 2


@pytest.mark.parametrize("recompute", [MODES[0], MODES[1], *MODES[4:]], ids=mode_id)
def test_qwen3_hardware_flops_match_flop_counter_mode(recompute):
    _, pipe, plan, batches = run_llama(recompute, "math", "fp32", False, 0, **QWEN3)
    with FlopCounterMode(display=False) as counter:
        pipe.step(batches)
    assert counter.get_total_flops() == sum(s.hardware_flops_per_step for s in plan.stages)


def test_three_stages_and_one_sequence_agree_too():
    for recompute in (NoRecompute(), FullRecompute(interval="2"), SelectiveRecompute(modules=["core_attn", "mlp_act"])):
        for attention in ("sdpa", "math"):
            _, pipe, plan, batches = run_llama(recompute, attention, "fp32", False, 0, stages=3, micro_batch_size=1)
            pipe.step(batches, measure=True)
            assert [s.meter.bytes_per_micro_batch()[0] for s in pipe.stages] == [
                s.activation_bytes_per_microbatch for s in plan.stages
            ]


# Only the explicit attention ops: PyTorch's CPU flash kernel (sdpa without dropout) has no FlopCounterMode formula.
# The untied unfused head in every mode; the tied head with the fused loss (which makes its logits again) once.
@pytest.mark.parametrize(
    "recompute, tied, chunk",
    [*[(mode, False, 0) for mode in MODES], (SelectiveRecompute(modules=["mlp", "layernorm"]), True, 16)],
    ids=lambda v: mode_id(v) if not isinstance(v, (bool, int)) else str(v),
)
def test_hardware_flops_match_flop_counter_mode(recompute, tied, chunk):
    _, pipe, plan, batches = run_llama(recompute, "math", "fp32", tied, chunk)
    with FlopCounterMode(display=False) as counter:
        pipe.step(batches)
    assert counter.get_total_flops() == sum(s.hardware_flops_per_step for s in plan.stages)


@pytest.mark.parametrize("overrides", [{}, QWEN3], ids=["llama", "qwen3"])
def test_model_flops_formula_matches_counted_matmuls_up_to_norm_gains(overrides):
    cfg, pipe, plan, batches = run_llama(NoRecompute(), "math", "fp32", False, 0, **overrides)
    with FlopCounterMode(display=False) as counter:
        pipe.step(batches)
    # 6N counts the RMSNorm gains as if they were matmul weights: 6 (2 h L + h) per token more, and Qwen3's q and k
    # norms' 2 hs per block.
    gains = 2 * cfg.n_embd * cfg.n_layer + cfg.n_embd + (2 * cfg.head_size * cfg.n_layer if cfg.qk_norm else 0)
    extra = 6 * gains * plan.flops.tokens_per_step
    assert plan.flops.model_flops_per_step == counter.get_total_flops() + extra


LLAMA3_8B = Shape(b=1, s=8192, h=4096, a=32, vocab=128256, dropout=False, attention="math", arch="llama", g=8, f=14336)


def test_llama3_8b_per_block_bytes_equal_the_formula_in_16_bit_on_cuda():
    """docs/llama.md's formula, exactly: explicit attention (materialised scores) without recompute, and with the
    attention core recomputed; SDPA's fused kernel keeps what the latter keeps plus its fp32 log-sum-exp."""
    paper, target = PaperBytes.of(LLAMA3_8B), Target("cuda", "bf16")
    assert total(llama_block_items(LLAMA3_8B, target)) == paper.none == 5_540_741_120
    assert total(llama_block_items(LLAMA3_8B, target, ("core_attn",))) == paper.selective == 1_145_110_528
    fused = replace(LLAMA3_8B, attention="sdpa")
    lse = 4 * fused.b * fused.a * fused.s
    assert total(llama_block_items(fused, target)) == paper.selective + lse == 34 * fused.bsh + 4_259_840 + lse
    assert block_choices(LLAMA3_8B, target)["full"].activation_bytes == paper.full


def _llama_grads(recompute, attention: str, early: bool, defer: bool):
    """Two micro-batches of the unpipelined Llama model: both forwards, then both backwards (each after its early
    recompute when `early`, its weight gradients deferred to the end when `defer`)."""
    cfg = llama(n_layer=3, attention=attention)
    model = GPT(cfg, seed=0)
    plan = plan_stage([isinstance(f, LlamaBlock) for f in model.forward_funcs], recompute)
    apply_plan(model.forward_funcs, plan)
    idx = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    return two_micro_batches(model, plan, idx, early, defer, WeightGradStore(), between=lambda: None)


@pytest.mark.parametrize(
    "recompute, attention",
    [*[(mode, "math") for mode in MODES[1:]], (MODES[2], "sdpa"), (MODES[-1], "sdpa")],
    ids=lambda v: v if isinstance(v, str) else mode_id(v),
)
def test_recompute_early_and_deferred_is_bit_exact_with_none(recompute, attention):
    base_losses, base_grads = _llama_grads(NoRecompute(), attention, early=False, defer=False)
    for early, defer in ((False, False), (True, False), (False, True), (True, True)):
        losses, grads = _llama_grads(recompute, attention, early, defer)
        assert all(torch.equal(a, b) for a, b in zip(losses, base_losses)), (early, defer)
        assert all(torch.equal(g, b) for g, b in zip(grads, base_grads)), (early, defer)


@pytest.mark.parametrize(
    "modules", [["mlp_act"], ["layernorm"], ["mlp"], ["layernorm", "mlp"], ["mlp_act", "layernorm"]]
)
def test_early_recompute_holds_what_the_memory_model_says(modules):
    cfg = llama(n_layer=1)
    recomputed = early_recomputed_bytes(LlamaBlock(cfg, seed=0, layer_index=1), cfg, modules)
    shape, target = Shape.of(cfg, 2), Target("cpu", "fp32")
    saved = total(llama_block_items(shape, target)) - total(llama_block_items(shape, target, tuple(modules)))
    assert recomputed == [saved]


# Llama shapes the peak model was not derived at: each stage replays its own training step with DeepSpeed's buffers
# (parallel/measurement/stage_replay.py), the allocator's peak of live tensors against the prediction, within the 10 %
# tests/test_peak_prediction.py holds GPT-2 to.
PEAK_MODES = {
    "none": (NoRecompute(), "1f1b"),
    "full(1)": (FullRecompute(interval="1"), "1f1b"),
    "selective all": (SelectiveRecompute(modules=["core_attn", "mlp", "layernorm"]), "1f1b"),
    "zb-h1 selective": (SelectiveRecompute(modules=["core_attn", "mlp_act"]), "zb-h1"),
}


@pytest.mark.parametrize("mode", PEAK_MODES)
def test_each_stages_predicted_peak_is_within_10_percent_of_its_measured_peak(mode):
    cfg = llama(n_layer=4, n_head=8, n_embd=64, intermediate_size=176, seq_len=192, vocab_size=384, attention="math")
    run = RunShape(Topology(2), Target("cpu", "fp32"), micro_batches=4, micro_batch_size=2)
    recompute, schedule = PEAK_MODES[mode]
    layout = build_layout(cfg, recompute, run, "type:Block", 0, schedule=schedule)
    plan = plan_run(cfg, recompute, layout, run)
    for index, stage in enumerate(plan.stages):
        measured = StageReplay(layout, index, run).measure_peak()
        assert measured.unaccounted_bytes == 0
        assert abs(measured.peak_bytes / stage.predicted_peak_bytes - 1) <= 0.10, (index, stage.peak_tensor_terms)


@pytest.mark.parametrize("modules", [["layernorm"], ["layernorm", "mlp_act"], ["layernorm", "core_attn"]])
def test_layernorm_recompute_remakes_each_norm_once_per_backward(modules):
    """q, k and v (and gate and up) each save the one RMSNorm output they read: all take one remade output. Five
    remakes per block before (one per consuming Linear), priced as two."""
    cfg = llama(n_layer=1)
    block = LlamaBlock(cfg, seed=0, layer_index=1)
    calls = {"input_layernorm": 0, "post_attention_layernorm": 0}

    def counting(name, forward):  # installed before the plan, so the recompute's own call of the forward counts too
        def counted(*args):
            calls[name] += 1
            return forward(*args)

        return counted

    for name in calls:
        norm = getattr(block, name)
        norm.forward = counting(name, norm.forward)
    apply_plan([block], plan_stage([True], SelectiveRecompute(modules=modules)))
    x = torch.randn(2, cfg.seq_len, cfg.n_embd, requires_grad=True)  # (b, s, h)
    out = block(x)
    forward_calls = dict(calls)
    out.backward(torch.randn_like(out))
    assert forward_calls == {"input_layernorm": 1, "post_attention_layernorm": 1}
    assert calls == {"input_layernorm": 2, "post_attention_layernorm": 2}
