"""Virtual-stage schedules on real ranks (parallel/runtime/virtual_engine.py): interleaved 1F1B, ZB-V and V-Half on
2 ranks with 2 chunks each train bit-identically to DeepSpeed's 1F1B on 2 stages of the same model, seed and data,
under no, full and selective recompute (also early) with dropout 0.1, alone and with 2 data-parallel replicas (also
under ZeRO-1), GPT and Llama (tests/fixtures/virtual_runs.py, in the session's shared 2- and 4-rank engine launches):
the same losses, the same gradient of every parameter at every step (both copies of the tied embedding), the same
trained weights; in bf16 too, under DeepSpeed's BF16_Optimizer (whose backward prologue, run by DeepSpeed from a hook
on the stage's output, wiped the LM head's loss gradient on 1F1B's last stage until
parallel/runtime/zero_bubble_engine.py cleared the 16-bit gradients before the loss's backward instead: the chunks,
which clear them themselves, found it). And the runtime refuses, in one line, what it does not run yet."""

import pytest

from parallel.planning.config import AutoRecompute, FullRecompute, NoRecompute
from parallel.planning.virtual_program import VIRTUAL_SCHEDULES
from parallel.planning.virtual_support import virtual_refusal
from tests.fixtures.virtual_runs import CLIP, MODES
from tests.shared_runs import EngineRun

ENGINE_RUNS = {
    "two-ranks": EngineRun("virtual_runs", {"modes": list(MODES)}, nproc=2),
    "resume": EngineRun("virtual_runs", {"modes": [], "resume": "zb-v"}, nproc=2),
    "three-chunks": EngineRun("virtual_runs", {"modes": ["full"], "chunks": 3}, nproc=2),
    "clip": EngineRun("virtual_runs", {"modes": [], "clip": True}, nproc=2),
    # the programmes laid out as this CPU's measured prices lay them out: the V's ops in another order
    "cpu-slots": EngineRun("virtual_runs", {"modes": ["selective"], "slots": [3, 2, 1]}, nproc=2),
    # 2 pipeline ranks x 2 data-parallel replicas, in the shared 4-rank launch, without and with ZeRO-1
    "data-parallel": EngineRun("virtual_runs", {"modes": ["none"]}, nproc=4),
    "zero1": EngineRun("virtual_runs", {"modes": ["full"], "zero_stage": 1}, nproc=4),
    # bf16: DeepSpeed's BF16_Optimizer (fp32 master weights), as its PipelineEngine chooses it; resumed too
    "bf16": EngineRun("virtual_runs", {"modes": ["selective"], "resume": "v-half", "precision": "bf16"}, nproc=2),
    "bf16-data-parallel": EngineRun("virtual_runs", {"modes": ["none"], "precision": "bf16"}, nproc=4),
    # the Llama family, its untied LM head on the last chunk (whose bf16 gradient 1F1B lost: the module's docstring)
    "llama-bf16": EngineRun("virtual_runs", {"modes": ["selective"], "precision": "bf16", "model": "llama"}, nproc=2),
    "llama-zero1": EngineRun("virtual_runs", {"modes": ["full-early"], "zero_stage": 1, "model": "llama"}, nproc=4),
}
OPTIMIZERS = {
    "zero1": "DeepSpeedZeroOptimizer",
    "llama-zero1": "DeepSpeedZeroOptimizer",
    "bf16": "BF16_Optimizer",
    "bf16-data-parallel": "BF16_Optimizer",
    "llama-bf16": "BF16_Optimizer",
}
"""DeepSpeed's optimizer wrapper of each run (the rest: none, torch's AdamW)."""


def _merged(ranks: list[dict], field: str) -> list[dict[str, set[str]]] | dict[str, set[str]]:
    """Every rank's digests of `field` by key, each key's copies (over ranks and within one) as a set."""

    def merge(per_rank: list[dict[str, list[str]]]) -> dict[str, set[str]]:
        out: dict[str, set[str]] = {}
        for digests in per_rank:
            for key, values in digests.items():
                out.setdefault(key, set()).update(values)
        return out

    if field == "weights":
        return merge([rank["weights"] for rank in ranks])
    return [merge([rank["grads"][step] for rank in ranks]) for step in range(len(ranks[0]["grads"]))]


@pytest.mark.multiproc
@pytest.mark.parametrize(
    "run, mode",
    [("two-ranks", mode) for mode in MODES]
    + [("data-parallel", "none"), ("zero1", "full"), ("cpu-slots", "selective")]
    + [
        ("bf16", "selective"),
        ("bf16-data-parallel", "none"),
        ("llama-bf16", "selective"),
        ("llama-zero1", "full-early"),
    ],
)
@pytest.mark.parametrize("schedule", VIRTUAL_SCHEDULES)
def test_two_chunks_per_rank_train_as_deepspeeds_1f1b_bit_for_bit(engine_runs, schedule, run, mode):
    runs = {name: [rank[name] for rank in engine_runs[run]] for name in engine_runs[run][0]}
    reference, ranks = runs[f"1f1b/{mode}"], runs[f"{schedule}/{mode}"]
    placement = [[0, 2], [1, 3]] if schedule == "interleaved-1f1b" else [[0, 3], [1, 2]]
    replicas = len(ranks) // 2  # DeepSpeed's grid: pipeline rank = global rank // replicas
    assert [rank["stages"] for rank in ranks] == [placement[r // replicas] for r in range(len(ranks))]
    assert all(rank["losses"] == reference[0]["losses"] for rank in ranks)
    # ZeRO-1's gradients: only in the weights; bf16's: those BF16_Optimizer accumulates and steps with
    assert {rank["optimizer"] for rank in ranks + reference} == {OPTIMIZERS.get(run, "AdamW")}
    for grads, expected in zip(_merged(ranks, "grads"), _merged(reference, "grads"), strict=True):
        assert grads.keys() == expected.keys()
        for key, digests in grads.items():
            assert len(digests) == 1 and digests == expected[key], key  # a tied weight's two copies agree
    assert _merged(ranks, "weights") == _merged(reference, "weights")


@pytest.mark.multiproc
def test_interleaving_three_chunks_per_rank_trains_as_deepspeeds_1f1b_bit_for_bit(engine_runs):
    runs = {name: [rank[name] for rank in engine_runs["three-chunks"]] for name in engine_runs["three-chunks"][0]}
    reference, ranks = runs["1f1b/full"], runs["interleaved-1f1b/full"]
    assert [rank["stages"] for rank in ranks] == [[0, 2, 4], [1, 3, 5]]
    assert all(rank["losses"] == reference[0]["losses"] for rank in ranks)
    assert _merged(ranks, "grads") == _merged(reference, "grads")
    assert _merged(ranks, "weights") == _merged(reference, "weights")


@pytest.mark.multiproc
@pytest.mark.parametrize("run, schedule", [("resume", "zb-v"), ("bf16", "v-half")])
def test_a_run_resumed_from_deepspeeds_checkpoint_continues_bit_exactly(engine_runs, run, schedule):
    """DeepSpeed's engine saves and loads the chunks' weights, the optimizer and the LR schedule (a V's rank 0 holds
    both copies of the tied embedding); in bf16, BF16_Optimizer's fp32 master weights from its own files."""
    for rank in engine_runs[run]:
        losses = rank[f"resume/{schedule}"]
        assert len(losses["straight"]) == 2 and losses["resumed"] == losses["straight"]


@pytest.mark.multiproc
def test_clipping_counts_the_tied_weight_once_on_every_placement(engine_runs):
    """DeepSpeed's fp32 clipping counts every parameter on the pipeline's rank 0: a V's rank 0 holds both copies of the
    tied embedding, and the engine's clipping leaves the later one out (TiedCopies.count_once_in_clipping). Clipped at
    a norm far below the gradients', every placement's clipped gradients then have that norm, each weight once."""
    for rank in engine_runs["clip"]:
        for schedule in ("1f1b", *VIRTUAL_SCHEDULES):
            assert rank[f"clip/{schedule}"] == pytest.approx(CLIP, rel=1e-5), schedule


def test_what_the_runtime_does_not_run_yet_is_refused_in_one_line():
    def refusal(recompute=None, precision="fp32", zero=0):
        return virtual_refusal("zb-v", recompute or NoRecompute(), precision, zero)

    assert refusal() is None and refusal(recompute=FullRecompute(interval="1")) is None
    assert refusal(recompute=AutoRecompute()) is None  # auto per chunk (parallel/planning/virtual_auto.py)
    assert refusal(precision="bf16") is None
    for early in (FullRecompute(interval="1", early=True), AutoRecompute(early=True)):  # early recompute: every mode
        assert refusal(recompute=early) is None
    refusals = [refusal(precision="fp16"), refusal(zero=2)]
    assert all(line and "\n" not in line and "zb-v" in line for line in refusals)
    assert "train.precision=fp16" in refusals[0] and "bf16 or fp32" in refusals[0]
