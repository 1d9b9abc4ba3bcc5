"""train.compile (parallel/runtime/compile_blocks.py): each block compiled after its stage plan; what cannot compile is
refused at start-up in one line; one representative compiled check (the whole matrix: tests/test_compile_matrix.py,
`make test-compile`)."""

import pytest

from model import GPTConfig
from parallel.planning.config import AutoRecompute, FullRecompute, NoRecompute, SelectiveRecompute
from parallel.runtime.compile_blocks import compile_refusal
from tests.compiled_runs import assert_bit_identical, compiled_steps
from tests.runs import TINY, summary
from tests.shared_runs import case

# Two compiled runs in the shared 2-rank launch, at the tiniest shape (compiling costs per graph, not per size): the
# evaluation at every step runs the compiled blocks in eval mode from the first step on.
COMPILED = [
    *TINY,
    "model.n_layer=2",
    "model.n_embd=32",
    "model.n_head=2",
    "model.seq_len=32",
    "model.dropout=0.1",
    "train.compile=true",
    "train.steps=3",
    "train.micro_batches=2",
    "train.eval_every=1",
    "train.eval_batches=1",
    "train.trace_step=0",
    "logger=none",
]
CASES = {
    "compiled-none": case(*COMPILED),
    "compiled-selective": case(*COMPILED, "+recompute=selective", "recompute.modules=[core_attn,mlp]"),
}

REFUSED = [
    ("zb-h1", FullRecompute(interval="1"), "train.compile=true needs parallel.schedule=1f1b, not zb-h1"),
    ("1f1b", AutoRecompute(), "train.compile=true cannot run +recompute=auto"),
    ("1f1b", FullRecompute(interval="1", early=True), "train.compile=true cannot run recompute.early=true"),
    (
        "1f1b",
        SelectiveRecompute(modules=["core_attn", "mlp_act"]),
        "train.compile=true cannot run recompute.modules=['core_attn', 'mlp_act']: mlp_act discard an output",
    ),
    ("1f1b", SelectiveRecompute(modules=["layernorm"]), "layernorm discard an output through saved-tensor hooks"),
]


@pytest.mark.parametrize("schedule, recompute, message", REFUSED)
def test_a_combination_that_cannot_compile_is_refused_with_its_reason(schedule, recompute, message):
    assert message in compile_refusal(schedule, recompute)


@pytest.mark.parametrize(
    "recompute",
    [NoRecompute(), FullRecompute(interval="stage", micro_batches=1), SelectiveRecompute(modules=["core_attn", "mlp"])],
)
def test_what_compiles_is_accepted(recompute):
    assert compile_refusal("1f1b", recompute) is None


def test_compiled_recompute_is_bit_identical_to_compiled_none_without_recompiles():
    """Dropout on, two stages in this process: a selective checkpoint traced inside the compiled block and a full
    segment around compiled blocks give the compiled `none` run's losses and gradients, and the second step (other
    micro-batches, both stages) compiles nothing."""
    config = GPTConfig(n_layer=2, n_head=2, n_embd=32, seq_len=16, vocab_size=64, dropout=0.1)
    reference = compiled_steps(config, NoRecompute())
    for recompute in (SelectiveRecompute(modules=["core_attn", "mlp"]), FullRecompute(interval="1")):
        run = compiled_steps(config, recompute)
        assert_bit_identical(run, reference)
        assert run.first.graphs >= 1 and run.later.graphs == 0
        assert run.first.graph_breaks == run.later.graph_breaks == 0
    assert reference.first.graphs >= 1 and reference.later.graphs == 0


@pytest.mark.multiproc
def test_a_compiled_two_stage_run_counts_no_graph_break_and_no_recompile(case_runs, shared_runs):
    """Through the deepspeed launcher: both stages compile in the first step (and its evaluation) and never again, the
    compiled selective run's losses are the compiled none run's, and start-up says what compiling cost."""
    runs = {name: summary(run_dir) for name, run_dir in case_runs.items()}
    assert runs["compiled-selective"]["losses"] == runs["compiled-none"]["losses"]
    assert runs["compiled-none"]["val_losses"] == runs["compiled-selective"]["val_losses"]
    for run in runs.values():
        per_rank = run["compile_per_rank"]
        assert len(per_rank) == 2
        for counts in per_rank:
            assert counts["first_step"]["graph_breaks"] == counts["later"]["graph_breaks"] == 0
            assert counts["later"]["graphs"] == 0
    assert "stagecheck: train.compile: the first step compiled " in shared_runs.case_output()
