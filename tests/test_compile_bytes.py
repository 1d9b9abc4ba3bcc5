"""The planner's compiled bytes against the meter, at shapes no test tunes to, for both families and for
+recompute=auto (`make test-compile`): one block compiled per option the plan runs or auto weighs
(parallel/measurement/compiled_bytes.py), the plan made from those bytes, and the compiled stages' own meters: each
stage's activation bytes per micro-batch equal the plan's to the byte, and each stage's peak (the stage replay,
compiled) is within PEAK_TOLERANCE of the plan's, whose parts outside the blocks (the loss's and the embedding's working
sets, the optimizer step) stay the analytic ones, as in eager."""

from dataclasses import replace

import pytest
import torch

from model import GPTConfig
from parallel.measurement.compile_counters import CompileCount
from parallel.measurement.compiled_bytes import compiled_options, measure_compiled_blocks
from parallel.measurement.local_stages import LocalPipeline
from parallel.measurement.stage_prices import measure_stage_prices
from parallel.measurement.stage_replay import StageReplay
from parallel.planning.config import AutoRecompute, SelectiveRecompute
from parallel.planning.layout import build_layout
from parallel.planning.run_plan import plan_run
from parallel.planning.shapes import RunShape, Target, Topology
from tests.compiled_runs import auto_between

pytestmark = pytest.mark.compile

# no other test's shapes: gpt2 with 3 heads of 16 channels, 24 tokens, 3 sequences per micro-batch; llama (whose
# compiled blocks all save one rotary angles table) with grouped heads 10 channels wide and a SwiGLU 80 wide
FAMILIES = {
    "gpt2": (
        GPTConfig(n_layer=3, n_head=3, n_embd=48, seq_len=24, vocab_size=96, dropout=0.1),
        SelectiveRecompute(modules=["mlp_act", "core_attn"]),
        3,
    ),
    "llama": (
        GPTConfig(
            arch="llama", activation="silu", bias=False, tie_embeddings=False, intermediate_size=80, n_layer=3,
            n_head=4, n_kv_head=2, n_embd=40, seq_len=20, vocab_size=72, dropout=0.0,
        ),
        SelectiveRecompute(modules=["mlp_act"]),
        2,
    ),
    # auto (its budget: tests/compiled_runs.py's auto_between) weighing all six compiled options, 2 blocks a stage
    "gpt2-auto": (
        GPTConfig(n_layer=4, n_head=2, n_embd=40, seq_len=28, vocab_size=80, dropout=0.1),
        AutoRecompute(),
        2,
    ),
}  # fmt: skip
MICRO_BATCHES = 3
PEAK_TOLERANCE = 0.02
COMPILED_PROBE_GRAPHS = 5
"""One graph per compiled stage price probe (parallel/measurement/stage_prices.py)."""


@pytest.fixture(scope="module", params=list(FAMILIES))
def planned(request):
    """{compiled?: (model, run, layout, plan)}, eager and compiled, of one family on 2 stages; under auto, whose plans
    are made for the compiled bytes (an eager plan at its budget may not fit), eager is the compiled layout's plans
    counted by eager autograd."""
    model, recompute, micro_batch_size = FAMILIES[request.param]
    blocks = measure_compiled_blocks(model, micro_batch_size, Target("cpu", "fp32"), compiled_options(recompute))
    compiled = RunShape(Topology(2), Target("cpu", "fp32", blocks), MICRO_BATCHES, micro_batch_size)
    runs = {False: replace(compiled, target=Target("cpu", "fp32")), True: compiled}
    partition = f"type:{'Block' if model.arch == 'gpt2' else 'LlamaBlock'}"
    if isinstance(recompute, AutoRecompute):
        recompute = auto_between(model, compiled)
        layouts = dict.fromkeys(runs, build_layout(model, recompute, compiled, partition, 0))
    else:
        layouts = {key: build_layout(model, recompute, run, partition, 0) for key, run in runs.items()}
    return {key: (model, run, layouts[key], plan_run(model, recompute, layouts[key], run)) for key, run in runs.items()}


def test_each_compiled_stage_keeps_the_bytes_the_plan_counts(planned):
    model, run, layout, plan = planned[True]
    assert any("selective" in choice for stage in plan.stages for choice in stage.choices), run.target
    torch._dynamo.reset()
    pipe = LocalPipeline(layout, compile=True)
    data = torch.Generator().manual_seed(2)
    shape = (run.micro_batch_size, model.seq_len)
    batches = [(torch.randint(0, model.vocab_size, shape, generator=data),) * 2 for _ in range(MICRO_BATCHES)]
    pipe.step(batches)  # compiles
    pipe.step(batches, measure=True)
    for stage, planned_stage in zip(pipe.stages, plan.stages):
        assert stage.meter.bytes_per_micro_batch() == [planned_stage.activation_bytes_per_microbatch] * MICRO_BATCHES
    # what the measurement changed: eager autograd's count would have missed the compiled blocks
    eager = planned[False][3]
    assert [s.activation_bytes_per_microbatch for s in eager.stages] != [
        s.activation_bytes_per_microbatch for s in plan.stages
    ]


def test_each_compiled_stages_peak_is_the_planned_peak(planned):
    _, run, layout, plan = planned[True]
    for index, stage in enumerate(plan.stages):
        torch._dynamo.reset()
        measured = StageReplay(layout, index, run, compile=True).measure_peak()
        assert measured.unaccounted_bytes == 0
        assert measured.peak_bytes == pytest.approx(stage.predicted_peak_bytes, rel=PEAK_TOLERANCE), (
            index,
            stage.peak_tensor_terms,
            measured,
            run.target,
        )


def test_a_compiled_runs_stage_prices_time_compiled_blocks():
    """The step-time prices of a compiled run come from compiled instructions: the stage price measurement compiles the
    probe's block in each 1F1B block replay (none, core_attn, mlp, mlp_act, full), without a graph break."""
    model, _, micro_batch_size = FAMILIES["gpt2"]
    run = RunShape(Topology(2), Target("cpu", "fp32"), MICRO_BATCHES, micro_batch_size)
    before = CompileCount.now()
    measure_stage_prices(model, run, compile=True)
    compiled = CompileCount.now() - before
    assert compiled.graphs == COMPILED_PROBE_GRAPHS
    assert compiled.graph_breaks == 0
