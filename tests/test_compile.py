"""train.compile (parallel/runtime/compile_blocks.py): each block compiled after its stage plan; what cannot compile is
refused at start-up in one line; one representative compiled run through the launcher (the exactness matrix, in process:
tests/test_compile_matrix.py, `make test-compile`)."""

import pytest

from model import FIRST_BLOCK_INDEX, GPTConfig, gpt_layers
from parallel.measurement.compiled_bytes import compiled_options
from parallel.planning import working_set
from parallel.planning.block_prices import analytic_prices
from parallel.planning.config import AutoRecompute, FullRecompute, NoRecompute, SelectiveRecompute
from parallel.planning.layout import build_layout
from parallel.planning.memory_model import block_kept_items, stage_activations
from parallel.planning.shapes import CompiledBlocks, RunShape, Shape, Target, Topology, option_key
from parallel.planning.stage_plan import StagePlan
from parallel.runtime.compile_blocks import compile_refusal, compiled_auto
from tests.compiled_runs import (
    COMPILED_RUN,
    assert_compiled_in_the_first_step_only,
)
from tests.runs import summary
from tests.shared_runs import case

# Full recompute: its plan needs one compiled block measured (`none`'s bytes), where selective needs two, and each
# costs a compile at start-up. (+recompute=auto, which compiles six options at start-up:
# tests/test_compile_auto_run.py; every mode's exactness against compiled none: tests/test_compile_matrix.py; both
# `make test-compile`, whose cold compiles would take make test past its 12 minutes.)
CASES = {"compiled-full": case(*COMPILED_RUN, "+recompute=full")}

REFUSED = [
    ("zb-h1", FullRecompute(interval="1"), "not zb-h1: its split backward defers each Linear's weight gradient"),
    ("v-half", FullRecompute(interval="1"), "not v-half: its split backward defers each Linear's weight gradient"),
    ("interleaved-1f1b", FullRecompute(interval="1"), "not interleaved-1f1b: compiled blocks are not yet checked"),
    ("1f1b", AutoRecompute(early=True), "train.compile=true cannot run recompute.early=true"),
    (
        "1f1b",
        AutoRecompute(compress="bf16"),
        "train.compile=true cannot run recompute.nested=true or recompute.compress",
    ),
    ("1f1b", FullRecompute(interval="1", early=True), "train.compile=true cannot run recompute.early=true"),
    (
        "1f1b",
        SelectiveRecompute(modules=["mlp_act", "layernorm"]),
        "train.compile=true cannot run recompute.modules=['mlp_act', 'layernorm']: layernorm discards the norm output",
    ),
]


@pytest.mark.parametrize("schedule, recompute, message", REFUSED)
def test_a_combination_that_cannot_compile_is_refused_with_its_reason(schedule, recompute, message):
    assert message in compile_refusal(schedule, recompute)


@pytest.mark.parametrize(
    "recompute",
    [
        NoRecompute(),
        FullRecompute(interval="stage", micro_batches=1),
        SelectiveRecompute(modules=["core_attn", "mlp"]),
        SelectiveRecompute(modules=["core_attn", "mlp_act"]),
        AutoRecompute(per_micro_batch=True),
    ],
)
def test_what_compiles_is_accepted(recompute):
    assert compile_refusal("1f1b", recompute) is None


def test_a_compiled_blocks_bytes_are_read_only_where_they_were_measured():
    """The planner counts a compiled block's measured bytes (tests/test_compile_bytes.py holds them to the meters) at
    the shape, precision and options they were measured with; anything else is refused, never eager autograd's count."""
    config = GPTConfig(n_layer=2, n_head=2, n_embd=32, seq_len=16, vocab_size=64, dropout=0.1)
    shape = Shape.of(config, 2)
    blocks = CompiledBlocks(
        shape, "fp32", (((), 900), (("core_attn", "mlp"), 500)), (((), 70), (("core_attn", "mlp"), 90)), shared=40
    )
    target = Target("cpu", "fp32", blocks)
    assert [kept for _, kept in block_kept_items(shape, target, ("mlp", "core_attn"))] == [500]
    # one storage every compiled block saves (Llama's rotary angles table) counts once per stage
    blocks_only = range(FIRST_BLOCK_INDEX, FIRST_BLOCK_INDEX + 2)
    stage = stage_activations(gpt_layers(config, 0), blocks_only, StagePlan(), shape, target, is_last=False)
    assert [layer.bytes for layer in stage] == [940, 900]
    assert working_set.block_backward_bytes(shape, target, ()) == {working_set.COMPILED: 70}
    with pytest.raises(ValueError, match="no compiled block was measured with recompute.modules=.'mlp'."):
        block_kept_items(shape, target, ("mlp",))
    with pytest.raises(ValueError, match="compiled blocks were measured at"):
        block_kept_items(Shape.of(GPTConfig(n_layer=2, n_head=2, n_embd=32, seq_len=16, vocab_size=64), 2), target)
    with pytest.raises(ValueError, match="compiled blocks were measured at"):
        block_kept_items(shape, Target("cpu", "bf16", blocks))


def test_auto_under_compile_weighs_only_the_options_a_compiled_block_was_measured_with():
    """+recompute=auto under train.compile measures every selective option compiled blocks can run and weighs exactly
    those, from their measured bytes (made-up figures here; tests/test_compile_bytes.py measures real ones): never
    `layernorm`, never a nested segment, never an early recompute (each refused under compile)."""
    config = GPTConfig(n_layer=4, n_head=2, n_embd=32, seq_len=16, vocab_size=64, dropout=0.1)
    shape = Shape.of(config, 2)
    options = compiled_options(AutoRecompute())
    assert options == ((), ("core_attn",), ("mlp_act",), ("mlp",), ("core_attn", "mlp_act"), ("core_attn", "mlp"))
    kept, working = (77312, 68120, 60928, 40000, 52000, 30000), (20096, 35840, 41088, 45000, 50000, 52000)
    blocks = CompiledBlocks(shape, "fp32", tuple(zip(options, kept)), tuple(zip(options, working)))
    compiled = Target("cpu", "fp32", blocks)
    table = analytic_prices(shape, compiled)
    assert [(o.modules, o.kept_bytes, o.working_bytes) for o in table.options] == list(zip(options, kept, working))
    assert not table.nesting
    eager = analytic_prices(shape, Target("cpu", "fp32"))
    assert eager.nesting and any("layernorm" in o.modules for o in eager.options)
    chosen = set()
    for budget_gb in (0.00055, 0.0006, 0.0007, 0.0008, 0.0009, 0.001):
        auto = AutoRecompute(budget_gb=budget_gb, reserve_gb=0)
        layout = build_layout(config, auto, RunShape(Topology(2), compiled, 4, 2), "type:Block", 0)
        assert not any(plan.nested for plan in layout.plans)
        chosen |= {option_key(modules) for plan in layout.plans for modules in plan.selective.values()}
    assert chosen and chosen <= set(options)
    assert compiled_auto(AutoRecompute()).early is False


@pytest.mark.multiproc
def test_a_compiled_two_stage_run_counts_no_graph_break_and_no_recompile(case_runs, shared_runs):
    """Through the deepspeed launcher: both stages compile in the first step (and its evaluation) and never again, and
    start-up says what compiling cost."""
    assert_compiled_in_the_first_step_only(summary(case_runs["compiled-full"]), shared_runs.case_output())
