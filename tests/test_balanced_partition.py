"""`parallel.partition_method=balanced`: the block-count programme against brute force, the stage ranges,
layouts planned against the simulated step time within the budget, and a real 2-rank run through
DeepSpeed's PipelineModule, bit-exact against no recompute."""

import itertools
import time

import pytest

from model import GPTConfig, gpt_layers
from parallel.planning.config import AutoRecompute, FullRecompute, NoRecompute, SelectiveRecompute
from parallel.planning.layout import build_layout
from parallel.planning.partition import balanced_block_counts, stages_of_block_counts
from parallel.planning.run_plan import plan_run
from parallel.planning.shapes import GIB, RunShape, Target, Topology
from tests.runs import TINY, metrics, summary
from tests.shared_runs import case

GPT2 = GPTConfig(n_layer=12, n_head=12, n_embd=768, seq_len=1024, vocab_size=50257, dropout=0.0)
# A head (vocab 4096 over h=128) that costs about two and a half blocks: balanced gives the last stage less.
HEAVY_HEAD = ["model.n_layer=6", "model.vocab_size=4096", "model.attention=math", "train.micro_batches=4"]


def brute_force(blocks, stages, stage_time):
    best = None
    for cuts in itertools.combinations(range(1, blocks), stages - 1):
        counts = [b - a for a, b in zip((0, *cuts), (*cuts, blocks))]
        times = [stage_time(s, n) for s, n in enumerate(counts)]
        if None not in times and (best is None or max(times) < best):
            best = max(times)
    return best


def synthetic_time(stage, n):
    """Stage 0 also embeds (0.5), the last stage runs a head worth 2.5 blocks, stage 1 cannot hold 4 blocks."""
    if stage == 1 and n >= 4:
        return None
    return n + (0.5 if stage == 0 else 0) + (2.5 if stage == 3 else 0)


@pytest.mark.parametrize("blocks", [4, 7, 12, 13])
def test_the_programme_finds_the_fastest_slowest_stage(blocks):
    counts = balanced_block_counts(blocks, 4, synthetic_time)
    assert sum(counts) == blocks and min(counts) >= 1 and counts[1] < 4
    assert max(synthetic_time(s, n) for s, n in enumerate(counts)) == brute_force(blocks, 4, synthetic_time)


def test_hand_worked_split_and_infeasible_input():
    # 12 blocks: the last stage's 2 blocks + head (4.5) is the slowest any split reaches (3 blocks there make
    # 5.5); of the ways to put 10 blocks on stages 0-2 (stage 1 at most 3) without exceeding 4.5, times
    # 3.5 | 3 | 4 have the smallest sum of squares (37.25, against 38.25 for 4.5 | 3 | 3).
    assert balanced_block_counts(12, 4, synthetic_time) == [3, 3, 4, 2]
    assert balanced_block_counts(12, 4, lambda s, n: None if n > 2 else n) is None  # 4 x 2 < 12
    with pytest.raises(ValueError, match="cannot give each of 4 stages a block: the model has 3"):
        balanced_block_counts(3, 4, synthetic_time)


def test_embeddings_stay_first_and_the_head_last():
    recipes = gpt_layers(GPTConfig(n_layer=6), seed=0)
    stages = stages_of_block_counts(recipes, [1, 3, 2])
    assert [(s.start, s.stop) for s in stages] == [(0, 3), (3, 6), (6, 10)]
    names = [[recipes[i].name for i in s.layers] for s in stages]
    assert names[0][:2] == ["TokenEmbedding", "PositionEmbedding"] and names[-1][-2:] == ["FinalNorm", "LMHead"]


def test_gpt2_on_4_stages_gets_blocks_everywhere_and_the_shortest_predicted_step_of_such_splits():
    run = RunShape(Topology(4), Target("cuda", "bf16"), micro_batches=8, micro_batch_size=2)
    plans = {m: plan_run(GPT2, NoRecompute(), build_layout(GPT2, NoRecompute(), run, m, 0), run) for m in METHODS}
    assert [s.blocks for s in plans["parameters"].stages] == [0, 6, 6, 0]
    blocks = [s.blocks for s in plans["balanced"].stages]
    assert min(blocks) >= 1 and sum(blocks) == 12
    # The head and its fp32 loss over 50257 logits cost several blocks: the last stage gets the fewest.
    assert blocks[-1] == min(blocks) < max(blocks)
    # Fastest of the splits that give every stage a block (parameters' 0 | 6 | 6 | 0 gives two stages none).
    best = plans["balanced"].predicted_step_time_s
    assert best < plans["uniform"].predicted_step_time_s and best < plans["type:Block"].predicted_step_time_s


METHODS = ("balanced", "parameters", "uniform", "type:Block")


def test_balanced_auto_keeps_every_stage_within_the_budget_and_beats_the_even_split():
    cfg = GPTConfig(n_layer=8, n_head=4, n_embd=256, seq_len=512, vocab_size=256, dropout=0.1, attention="math")
    run = RunShape(Topology(2), Target("cpu", "fp32"), micro_batches=8, micro_batch_size=1)

    def peak(mode):
        plan = plan_run(cfg, mode, build_layout(cfg, mode, run, "type:Block", 0), run)
        return max(s.predicted_peak_bytes for s in plan.stages)

    # Between what uniform full and uniform selective need (the benchmark shape).
    auto = AutoRecompute(budget_gb=(peak(FullRecompute()) + peak(SelectiveRecompute())) / 2 / GIB, reserve_gb=0.0)
    layouts = {m: build_layout(cfg, auto, run, m, 0) for m in ("balanced", "type:Block")}
    for layout in layouts.values():
        assert all(b.predicted_peak_bytes <= b.budget_bytes for b in layout.budgets)
    times = {m: plan_run(cfg, auto, layout, run).predicted_step_time_s for m, layout in layouts.items()}
    assert times["balanced"] <= times["type:Block"]


def test_gpt3_175b_balanced_auto_plans_in_seconds():
    gpt3 = GPTConfig(n_layer=96, n_head=96, n_embd=12288, seq_len=2048, vocab_size=50257, dropout=0.1, attention="math")
    # 82 GiB on 16 stages: stage 0's working set alone is ~4.5 GiB (math attention's fp32 softmax backward)
    for stages, data_parallel, budget_gb in [(8, 8, 200.0), (16, 64, 82.0)]:
        auto = AutoRecompute(budget_gb=budget_gb)
        run = RunShape(Topology(stages, data_parallel), Target("cuda", "bf16"), 32, 1, zero_stage=1)
        start = time.process_time()  # CPU seconds: load stretches the wall time, not the planner's work
        layout = build_layout(gpt3, auto, run, "balanced", 0)
        plan = plan_run(gpt3, auto, layout, run)
        assert time.process_time() - start < 10
        assert all(s.blocks >= 1 for s in plan.stages) and sum(s.blocks for s in plan.stages) == 96
        assert all(b.predicted_peak_bytes <= b.budget_bytes for b in layout.budgets)


# The unfused loss: with the fused one (its backward makes the logits again) none's balanced partition gives
# stage 0 a block more than auto's, and the two runs are compared on one partition here.
BALANCED_RUN = [*TINY, *HEAVY_HEAD, "model.dropout=0.1", "train.steps=3", "model.loss_chunk_tokens=0"]
BALANCED_RUN += ["train.trace_step=0", "logger=none"]
CASES = {
    "auto": case(*BALANCED_RUN, "+recompute=auto", "recompute.budget_gb=0.042", "recompute.reserve_gb=0"),
    "none": case(*BALANCED_RUN),
}


@pytest.mark.multiproc
def test_balanced_auto_run_is_bit_exact_against_none(case_runs):
    runs = {name: summary(case_runs[name]) for name in ("auto", "none")}
    # balanced's own boundaries (DeepSpeed's parameter split would be 3 | 3), set through PipelineModule.
    for s in runs.values():
        assert [stage["layers"] for stage in s["layout"]] == [[0, 6], [6, 10]]
    assert any(c != "none" for stage in runs["auto"]["layout"] for c in stage["choices"])
    assert runs["auto"]["losses"] == runs["none"]["losses"] == [r["loss"] for r in metrics(case_runs["none"])]
    assert len(runs["none"]["losses"]) == 3
    # The gradients too: after three optimizer steps the tied embedding is bit-identical on both of its stages.
    digests = {name: s["tied_weight_sha256_per_rank"] for name, s in runs.items()}
    assert digests["auto"] == digests["none"] and len(set(digests["none"])) == 1
    for s in runs.values():
        assert s["predicted_step_time_s"] > 0 and s["step_time_s"] > 0
    assert all(peak <= 0.042 * GIB for peak in runs["auto"]["predicted_peak_bytes_per_stage"])
