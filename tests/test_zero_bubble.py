"""ZB-H1's split backward and early recompute are exact: the deferred weight gradient is nn.Linear's bit for bit;
on the unpipelined GPT every recompute mode, early and deferred, gives the gradients of no recompute; real
pipelines of 2 and 4 stages give 1F1B-without-recompute's losses, gradient norms and trained weights under every
schedule x early x recompute combination (tests/fixtures/zero_bubble_runs.py, in the session's shared engine
launches of 2 and 4 ranks), also with 2-way data parallelism and ZeRO-1; and what an early recompute holds until
backward is what the memory model predicts. (A zb-h1 train.py run's trace and resume: tests/test_zero_bubble_run.py.)"""

import weakref

import pytest
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from model import FIRST_BLOCK_INDEX, GPT, Block, GPTConfig, gpt_layers, lm_loss
from model.weight_grad import WeightGradStore, linear, split_backward
from parallel.planning.config import FullRecompute, NoRecompute, SelectiveRecompute
from parallel.planning.memory_model import selective_combinations, stage_activations
from parallel.planning.shapes import Shape, Target
from parallel.planning.stage_plan import StagePlan, plan_stage
from parallel.runtime.early_recompute import EarlyRecompute
from parallel.runtime.recompute import apply_plan, run_stage
from tests.shared_runs import EngineRun

ENGINE_RUNS = {
    "stages-2": EngineRun("zero_bubble_runs", {"stages": 2, "zero_stage": 0, "combos": "all"}, nproc=2),
    "stages-4": EngineRun("zero_bubble_runs", {"stages": 4, "zero_stage": 0, "combos": "all"}, nproc=4),
    # 2 stages x 2 data-parallel ranks, ZeRO-1
    "zero1": EngineRun("zero_bubble_runs", {"stages": 2, "zero_stage": 1, "combos": "zero"}, nproc=4),
    "no-dropout": EngineRun("zero_bubble_runs", {"stages": 4, "zero_stage": 0, "combos": "no-dropout"}, nproc=4),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [True, False])
def test_linear_gradients_are_nn_linears_deferred_or_not(dtype, bias):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 16, 32, generator=gen).to(dtype).requires_grad_()
    weight = torch.randn(96, 32, generator=gen).to(dtype).requires_grad_()
    b = torch.randn(96, generator=gen).to(dtype).requires_grad_() if bias else None
    params = [x, weight] + ([b] if bias else [])
    for grad in (torch.randn(2, 16, 96, generator=gen), torch.randn(96, 2, 16, generator=gen).movedim(0, -1)):
        grad = grad.to(dtype)  # contiguous, then not (as a transposed upstream gradient arrives)
        F.linear(x, weight, b).backward(grad)
        expected = [p.grad for p in params]
        for p in params:
            p.grad = None
        store = WeightGradStore()
        with split_backward(), store.deferring():
            out = linear(x, weight, b)
            assert torch.equal(out, F.linear(x, weight, b))
            out.backward(grad)
        assert weight.grad is None and len(store) == 1  # B: the input and bias gradients only
        assert store.deferred_bytes() == grad.numel() * grad.element_size()
        assert store.apply_oldest() == 1 and len(store) == 0  # W
        assert all(torch.equal(p.grad, e) for p, e in zip(params, expected))
        for p in params:
            p.grad = None


def test_a_deferred_weight_gradient_holds_no_recomputed_graph():
    """Under recompute the Linear's saved input is the recomputed tensor, whose graph reaches back to the checkpoint's
    input: the store keeps it detached, so after B the checkpoint's input (and its gradient) can be freed before W."""
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(96, 32, generator=gen).requires_grad_()
    x = torch.randn(2, 16, 32, generator=gen).requires_grad_()
    store = WeightGradStore()
    with split_backward(), store.deferring():
        out = checkpoint(lambda t: linear(F.layer_norm(t, (32,)), weight), x, use_reentrant=False)
        out.backward(torch.ones_like(out))
    held = weakref.ref(x)
    del x, out
    assert held() is None and len(store) == 1  # nothing but the store's entry could keep the input alive
    store.apply_oldest()
    assert weight.grad is not None


def gpt_grads(
    recompute, attention: str, early: bool, defer: bool, device: str = "cpu", dtype=torch.float32, width: int = 32
):
    """Two micro-batches of the unpipelined GPT: both forwards, then both backwards (each after its early
    recompute when `early`, its weight gradients deferred to the end when `defer`), the RNG used in between.
    (tests/test_gpu.py runs it on CUDA, in 16 bits and wider.)"""
    cfg = GPTConfig(n_layer=3, n_head=2, n_embd=width, seq_len=16, vocab_size=64, dropout=0.1, attention=attention)
    model = GPT(cfg, seed=0).to(device=device, dtype=dtype)
    plan = plan_stage([isinstance(f, Block) for f in model.forward_funcs], recompute)
    apply_plan(model.forward_funcs, plan)
    idx = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1)).to(device)
    # One stage holds both the embedding and the tied LM head: that weight's gradient stays immediate.
    store = WeightGradStore(immediate=[model.forward_funcs[0].wte.weight])
    torch.manual_seed(5)  # the dropout stream
    # The stream moves on before the recompute: it must replay its own state.
    return two_micro_batches(model, plan, idx, early, defer, store, between=lambda: torch.rand(8, device=device))


def two_micro_batches(model: GPT, plan, idx: torch.Tensor, early: bool, defer: bool, store: WeightGradStore, between):
    """Both forwards of `idx` through `model`'s planned stage (`between()` after each), then both backwards, each
    after its early recompute when `early`, its weight gradients deferred into `store` when `defer`: the losses and
    the parameters' gradients."""
    early_recompute = EarlyRecompute()
    losses = []
    with split_backward(defer):
        for _ in range(2):
            with early_recompute.registering() if early else torch.enable_grad():
                losses.append(lm_loss(run_stage(model.forward_funcs, plan, idx, first_layer=0), idx))
            between()
        for loss in losses:
            if early:
                early_recompute.recompute_next()
            with store.deferring() if defer else torch.enable_grad():
                loss.backward()
        while len(store):
            store.apply_oldest()
    assert len(early_recompute) == 0
    return [loss.detach() for loss in losses], [p.grad for p in model.parameters()]


@pytest.mark.parametrize("attention", ["math", "sdpa"])
@pytest.mark.parametrize(
    "recompute",
    [
        *[SelectiveRecompute(modules=list(c)) for c in selective_combinations()],
        FullRecompute(interval="2"),
        FullRecompute(interval="stage", nested=True),
    ],
    ids=lambda r: (
        getattr(r, "interval", "") + ("-nested" if getattr(r, "nested", False) else "") or "+".join(r.modules)
    ),
)
def test_early_and_deferred_recompute_is_bit_exact_with_none(recompute, attention):
    base_losses, base_grads = gpt_grads(NoRecompute(), attention, early=False, defer=False)
    for early, defer in ((True, False), (False, True), (True, True)):
        losses, grads = gpt_grads(recompute, attention, early, defer)
        assert all(torch.equal(a, b) for a, b in zip(losses, base_losses)), (early, defer)
        assert all(torch.equal(g, b) for g, b in zip(grads, base_grads)), (early, defer)


def early_recomputed_bytes(block: torch.nn.Module, cfg: GPTConfig, modules: list[str]) -> list[int]:
    """The bytes one early recompute of `block` under selective `modules` keeps until its backward, metered on a
    forward and backward of 2 sequences."""
    apply_plan([block], StagePlan(selective={0: tuple(modules)}))
    early_recompute = EarlyRecompute()
    early_recompute.measure = True
    x = torch.randn(2, cfg.seq_len, cfg.n_embd, requires_grad=True)
    with early_recompute.registering():
        out = block(x)  # (B, T, C)
    early_recompute.recompute_next()
    out.sum().backward()
    return early_recompute.recomputed_bytes


@pytest.mark.parametrize(
    "modules", [["mlp_act"], ["layernorm"], ["mlp"], ["layernorm", "mlp"], ["mlp_act", "layernorm"]], ids="+".join
)
def test_early_recompute_holds_what_the_memory_model_says(modules):
    """The bytes an early recompute keeps until its backward are the block's bytes under none minus under its
    plan: what parallel/planning/stage_bytes.py charges an early-recomputed micro-batch."""
    cfg = GPTConfig(n_layer=1, n_head=4, n_embd=64, seq_len=32, vocab_size=256, dropout=0.1)
    recomputed = early_recomputed_bytes(Block(cfg, seed=0, layer_index=FIRST_BLOCK_INDEX), cfg, modules)
    shape, target, layers = Shape.of(cfg, 2), Target("cpu", "fp32"), range(FIRST_BLOCK_INDEX, FIRST_BLOCK_INDEX + 1)
    recipes = gpt_layers(cfg, seed=0)
    kept = stage_activations(recipes, layers, StagePlan(selective={0: tuple(modules)}), shape, target, False)
    plain = stage_activations(recipes, layers, StagePlan(), shape, target, False)
    assert recomputed == [sum(a.bytes for a in plain) - sum(a.bytes for a in kept)]


def _by_combination(ranks: list[dict]) -> dict[str, list[dict]]:
    """Every rank's results of one engine run, per combination: name -> [rank 0's, rank 1's, ...]."""
    return {name: [rank[name] for rank in ranks] for name in ranks[0]}


def _same_training(runs: list[dict], reference: list[dict]) -> bool:
    return all(
        (r["losses"], r["grad_norms"], r["digest"]) == (b["losses"], b["grad_norms"], b["digest"])
        for r, b in zip(runs, reference, strict=True)
    )


@pytest.mark.multiproc
@pytest.mark.parametrize("stages", [2, 4])
def test_every_schedule_early_and_recompute_trains_bit_identically(engine_runs, stages):
    runs = _by_combination(engine_runs[f"stages-{stages}"])
    bf16 = {name: runs.pop(name) for name in ("1f1b/none/bf16", "zb-h1/full/early/bf16") if name in runs}
    assert len(runs) == 2 * (4 + 3) and len(bf16) == (2 if stages == 2 else 0)  # fp32: schedule x (4 + 3 early)
    reference = runs["1f1b/none"]
    if bf16:
        assert _same_training(bf16["zb-h1/full/early/bf16"], bf16["1f1b/none/bf16"])
        assert not _same_training(bf16["1f1b/none/bf16"], reference)  # bf16 really ran
    for name, ranks in runs.items():
        assert _same_training(ranks, reference), name
        zero_bubble, early = name.startswith("zb-h1/"), name.endswith("/early")
        for rank in ranks:  # the instructions really ran: B and W apart, recompute ahead of RecvGrad
            counts, last = rank["instructions"], rank["stage"] == stages - 1
            assert counts.get("BackwardWeight", 0) == counts.get("BackwardInput", 0) == (4 if zero_bubble else 0)
            assert counts.get("BackwardPass", 0) == (0 if zero_bubble else 4)
            # Every non-last stage runs early when asked, but for auto's plans, whose stages without recompute
            # have nothing to run early (zero_bubble_runs.layout_for).
            asked = early and not last
            assert rank["planned_early"] == asked if "/auto" not in name else rank["planned_early"] <= asked, name
            assert counts.get("RecomputeEarly", 0) == (4 if rank["planned_early"] else 0), (name, rank["stage"])
            assert len(rank["early_recomputed_bytes"]) == counts.get("RecomputeEarly", 0)
        if early:  # auto's early variant runs early somewhere too
            assert any(rank["planned_early"] for rank in ranks), name
    for name in ("1f1b/full/early", "zb-h1/full/early"):  # each early recompute holds the modelled bytes
        for rank in runs[name][: stages - 1]:
            assert rank["early_recomputed_bytes"] == [rank["predicted_early_bytes"]] * 4 != [0] * 4


@pytest.mark.multiproc
@pytest.mark.parametrize("stages", [2, 4])
def test_an_fp32_pipeline_clips_by_the_norm_of_every_stage(engine_runs, stages):
    """DeepSpeed's clip_grad_norm_ (fp32 without ZeRO) adds up only the first stage's gradients unless the parameters
    are marked model-parallel (parallel/runtime/engine.py's counted_on_every_stage): the norm it clipped by must be
    that of every stage's gradients, the tied LM head's copy left out."""
    for rank in _by_combination(engine_runs[f"stages-{stages}"])["1f1b/none"]:
        assert len(rank["every_stage_norms"]) == len(rank["losses"]) >= 2
        assert rank["grad_norms"] == pytest.approx(rank["every_stage_norms"], rel=1e-6)


@pytest.mark.multiproc
def test_no_send_posted_in_an_evaluation_outlives_it(engine_runs):
    """eval_batch after training, every combination on 2 stages: the sends evaluation posted (stage 0's activations
    under the schedules that post them) are complete when it returns, not held into the next training step."""
    runs = _by_combination(engine_runs["stages-2"])
    assert all(rank["sends_after_eval"] == 0 for ranks in runs.values() for rank in ranks)
    assert any(rank["sends_in_eval"] > 0 for rank in runs["zb-h1/none"])  # evaluation did post and hold some


@pytest.mark.multiproc
def test_zb_h1_with_data_parallel_zero1_trains_like_1f1b(engine_runs):
    runs = _by_combination(engine_runs["zero1"])
    assert sorted(r["stage"] for r in runs["1f1b/none"]) == [0, 0, 1, 1]
    for name in ("zb-h1/none", "zb-h1/full/early", "1f1b/nested", "zb-h1/nested/early"):
        assert _same_training(runs[name], runs["1f1b/none"]), name
    for rank in runs["zb-h1/nested/early"]:  # stage 0's nested segment (2 blocks) really recomputed early
        early_runs = rank["instructions"].get("RecomputeEarly", 0)
        assert early_runs == (4 if rank["stage"] == 0 else 0) == 4 * rank["planned_early"]


@pytest.mark.multiproc
def test_zb_h1_without_dropout_trains_like_1f1b(engine_runs):
    """Without dropout a block's last Linear gets the stage output's gradient itself, so a deferred W holds
    DeepSpeed's gradient receive buffer, and a middle stage of 4 posts its next gradient's receive (with its
    SendActivation) before that W runs: the engine receives each gradient into a fresh buffer. (Whether a receive
    into the held buffer lands before the W depends on timing: this run did not fail without the fresh buffer.)"""
    runs = _by_combination(engine_runs["no-dropout"])
    assert _same_training(runs["zb-h1/none"], runs["1f1b/none"])
