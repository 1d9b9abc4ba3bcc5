"""The Llama-family model in real launches, as jobs of the shared ones (tests/shared_runs.py): every recompute mode,
the zb-h1 schedule with early recompute, per-micro-batch recompute and auto train with bit-identical losses in fp32
on CPU; the 2-stage pipeline's first loss is the unpipelined model's; eval and resume work; the checkpoint
consolidates and generates; the untied head trains on 2 stages x 2 data-parallel with ZeRO-1, with no tied weight
anywhere."""

import pytest
import torch

from data import SyntheticDataConfig, open_token_source
from harness.consolidate import consolidate
from model import GPT, GPTConfig, lm_loss
from model.sampling import SamplingConfig, generate
from tests.runs import metrics, summary
from tests.shared_runs import case

pytestmark = pytest.mark.multiproc

LLAMA = [
    "model=tiny-llama",
    "data=synthetic",
    "train.prices=curves",
    "train.device=cpu",
    "model.seq_len=32",
    "logger=none",
]
STEPS = [*LLAMA, "train.steps=3", "train.micro_batches=4", "train.micro_batch_size=2", "train.trace_step=0"]
MODES = {
    "none": ["+recompute=none"],
    "full": ["+recompute=full", "recompute.interval=2"],
    "zb_early": ["parallel.schedule=zb-h1", "+recompute=full", "recompute.early=true"],
    "per_micro_batch": ["+recompute=selective", "recompute.modules=[mlp,layernorm]", "recompute.micro_batches=1"],
    "auto": ["+recompute=auto", "recompute.budget_gb=0.00215", "recompute.reserve_gb=0"],
}
SELECTIVE = ["+recompute=selective", "recompute.modules=[core_attn,mlp_act,layernorm]"]
RESUMABLE = [*STEPS, *SELECTIVE, "train.save_every=2", "train.eval_every=2", "train.eval_batches=1"]
ZERO1 = [*STEPS, "parallel.pipeline_stages=2", "parallel.zero_stage=1", "+recompute=full"]
CASES = {
    **{mode: case(*STEPS, "parallel.partition_method=type:Block", *overrides) for mode, overrides in MODES.items()},
    "straight": case(*RESUMABLE),
    "resumed": case(*RESUMABLE, "train.resume={runs}/llama_runs-straight/checkpoints/step_00000002"),
    "zero1": case(*ZERO1, nproc=4),
}


def test_every_mode_and_schedule_trains_with_bit_identical_losses(case_runs):
    losses = {mode: summary(case_runs[mode])["losses"] for mode in [*MODES, "straight"]}
    assert len(losses["none"]) == 3 and all(loss > 0 for loss in losses["none"])
    for mode, mode_losses in losses.items():
        assert mode_losses == losses["none"], mode


def test_the_modes_ran_their_plans(case_runs):
    choices = {mode: [s["choices"] for s in summary(case_runs[mode])["layout"]] for mode in [*MODES, "straight"]}
    assert choices["none"] == [["none", "none"], ["none", "none"]]
    assert choices["full"] == [["full", "full"], ["full", "full"]]
    assert choices["straight"][0] == ["selective:core_attn+mlp_act+layernorm"] * 2
    # the budget leaves room for less than none on stage 0, which holds the most micro-batches in flight
    assert choices["auto"][0] != ["none", "none"]


def test_the_pipeline_starts_from_the_unpipelined_models_loss(case_runs):
    cfg = GPTConfig(
        arch="llama", n_layer=4, n_head=4, n_kv_head=2, n_embd=64, intermediate_size=176, seq_len=32,
        vocab_size=256, rope_theta=500000.0, rope_scaling="llama3", rope_original_max_positions=32,
        tie_embeddings=False, activation="silu", bias=False, dropout=0.0,
    )  # fmt: skip
    model = GPT(cfg, seed=1234)
    source = open_token_source(SyntheticDataConfig(), cfg.vocab_size)
    with torch.no_grad():
        losses = [lm_loss(model(x), y) for x, y in (source.batch(1234, 1, 0, m, 2, 32) for m in range(4))]
    assert summary(case_runs["none"])["losses"][0] == pytest.approx(torch.stack(losses).mean().item(), abs=1e-5)


def test_eval_and_resume(case_runs):
    straight, resumed = case_runs["straight"], case_runs["resumed"]
    assert [r["step"] for r in metrics(straight) if "val_loss" in r] == [2, 3]
    assert [r["loss"] for r in metrics(resumed)] == [r["loss"] for r in metrics(straight)][2:]


def test_untied_head_on_two_stages_by_two_data_parallel_with_zero1(case_runs):
    s = summary(case_runs["zero1"])
    assert (s["world_size"], s["pipeline_stages"], s["data_parallel_size"]) == (4, 2, 2)
    assert s["tied_weight_sha256_per_rank"] == [None] * 4  # no tied module on any rank
    assert len(s["losses"]) == 3 and all(loss > 0 for loss in s["losses"])


def test_the_checkpoint_consolidates_and_generates_with_the_kv_cache(case_runs):
    loaded = consolidate(case_runs["none"], option="checkpoint")
    assert loaded.model.config.arch == "llama" and not loaded.model.config.tie_embeddings
    init = GPT(loaded.model.config, seed=1234).state_dict()
    drift = {name: (w - init[name]).abs().max().item() for name, w in loaded.model.state_dict().items()}
    assert 0 < max(drift.values()) and all(d < 3 * 3 * 6e-4 for d in drift.values())  # each layer in its place
    model = loaded.model.eval()
    prompt = torch.tensor([[1, 2, 3]])
    greedy = generate(model, prompt, SamplingConfig(max_new_tokens=20, temperature=0.0))
    tokens = prompt
    with torch.no_grad():  # the same greedy decoding without the KV cache: the whole sequence each time
        for _ in range(20):
            tokens = torch.cat([tokens, model(tokens)[:, -1:].argmax(-1)], dim=1)
    assert torch.equal(greedy, tokens[:, 3:])
