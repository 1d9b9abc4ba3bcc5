"""Compiled local pipelines (train.compile) for tests/test_compile.py and tests/test_compile_matrix.py: every stage of
a layout in this process, each block compiled, two steps on fixed micro-batches; and the compiled train.py run of the
shared launch, with what its summary must show."""

from dataclasses import dataclass

import pytest
import torch

from model import GPTConfig
from parallel.measurement.compile_counters import CompileCount
from parallel.measurement.local_stages import LocalPipeline
from parallel.planning.budget_refusal import BudgetTooSmall
from parallel.planning.config import AutoRecompute, NoRecompute
from parallel.planning.layout import build_layout
from parallel.planning.shapes import GIB, RunShape, Target, Topology
from parallel.planning.stage_plan import StagePlan
from tests.runs import TINY

MICRO_BATCHES, MICRO_BATCH_SIZE = 2, 2
EAGER = Target("cpu", "fp32")
"""What the plans are made for unless a test gives what a compiled block keeps."""


@dataclass
class CompiledSteps:
    losses: list[torch.Tensor]
    """Each step's mean loss."""
    grads: list[torch.Tensor]
    """Every parameter's gradient after the second step (accumulated over both: no optimizer step between)."""
    first: CompileCount
    """What the first step compiled (from nothing: every run compiles its own graphs)."""
    later: CompileCount
    """What the second step compiled (other micro-batches, every stage): a recompile unless zero."""
    plans: list[StagePlan]
    """Each stage's recompute plan."""


def partition(config: GPTConfig) -> str:
    """parallel.partition_method: the blocks spread evenly over the stages."""
    return f"type:{'Block' if config.arch == 'gpt2' else 'LlamaBlock'}"


def compiled_steps(
    config: GPTConfig, recompute, stages: int = 2, compile: bool = True, target: Target = EAGER
) -> CompiledSteps:
    """Two steps of `config` under `recompute` on `stages` stages in this process, planned for `target` (with what a
    compiled block keeps, for +recompute=auto). Dynamo forgets what earlier runs compiled first: the blocks of every
    model share nn.Module's one call code, whose compiled graphs dynamo caches up to a limit
    (torch._dynamo.config.recompile_limit) and past it would run eagerly without a word."""
    torch._dynamo.reset()
    run = RunShape(Topology(stages), target, MICRO_BATCHES, MICRO_BATCH_SIZE)
    layout = build_layout(config, recompute, run, partition(config), 0)
    pipe = LocalPipeline(layout, compile=compile)
    data = torch.Generator().manual_seed(1)

    def micro_batches():
        shape = (MICRO_BATCH_SIZE, config.seq_len)
        return [(torch.randint(0, config.vocab_size, shape, generator=data),) * 2 for _ in range(MICRO_BATCHES)]

    torch.manual_seed(5)  # the dropout stream: every mode draws the same masks from it
    start = CompileCount.now()
    losses = [pipe.step(micro_batches())]
    after_first = CompileCount.now()
    losses.append(pipe.step(micro_batches()))
    return CompiledSteps(
        losses,
        [p.grad for p in pipe.parameters()],
        after_first - start,
        CompileCount.now() - after_first,
        list(layout.plans),
    )


def auto_between(config: GPTConfig, run: RunShape) -> AutoRecompute:
    """+recompute=auto with its budget halfway between the least any of its plans holds on `run` and none's peak there:
    a plan that recomputes, but not everything."""
    with pytest.raises(BudgetTooSmall) as refused:  # it names the least budget any plan fits
        build_layout(
            config, AutoRecompute(budget_gb=1e-9, reserve_gb=0), run, partition(config), 0, price_alternatives=False
        )
    least = refused.value.smallest_gb
    none = max(build_layout(config, NoRecompute(), run, partition(config), 0).peak_bytes) / GIB
    return AutoRecompute(budget_gb=(least + none) / 2, reserve_gb=0, early=False)


def assert_bit_identical(run: CompiledSteps, reference: CompiledSteps) -> None:
    assert [loss.item() for loss in run.losses] == [loss.item() for loss in reference.losses]
    assert len(run.grads) == len(reference.grads)
    assert all(torch.equal(a, b) for a, b in zip(run.grads, reference.grads))


# A compiled train.py run for the shared 2-rank launch (tests/test_compile.py, tests/test_compile_auto_run.py), at
# the tiniest shape (compiling costs per graph, not per size); the evaluation at every step runs the compiled blocks in
# eval mode from the first step on; the metered step (2) and the traced one (3, the default) recompile nothing either.
COMPILED_RUN = [
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
    "logger=none",
]


def assert_compiled_in_the_first_step_only(run: dict, output: str) -> None:
    """`run` (a COMPILED_RUN's summary.json) compiled both stages in its first step (and its evaluation) and never
    again, and `output` (its launch's) says what compiling cost; the plan counted what the compiled blocks keep
    (measured at start-up), and the meters agree to the byte."""
    assert len(run["losses"]) == len(run["val_losses"]) == 3
    per_rank = run["compile_per_rank"]
    assert len(per_rank) == run["world_size"]
    for counts in per_rank:
        assert counts["first_step"]["graphs"] >= 1 and counts["later"]["graphs"] == 0
        assert counts["first_step"]["graph_breaks"] == counts["later"]["graph_breaks"] == 0
    assert "stagecheck: train.compile: each block compiled (inductor), after its plan" in output
    assert "stagecheck: train.compile: the plan counts what a compiled block keeps per micro-batch, none " in output
    assert run["activation_bytes_per_stage"] == run["planned_activation_bytes_per_stage"]
    assert "stagecheck: train.compile: the first step compiled " in output
