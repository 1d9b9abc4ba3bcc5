"""The planner's compiled bytes against the meter, at a shape no test tunes to (`make test-compile`): one block compiled
per option the plan runs (parallel/measurement/compiled_bytes.py), the plan made from those bytes, and the compiled
stages' own meters: each stage's activation bytes per micro-batch equal the plan's to the byte, and each stage's peak
(the stage replay, compiled) is within PEAK_TOLERANCE of the plan's, whose one part not measured from a compiled block
is the analytic working set of the loss, the embedding and the optimizer step, which stay eager."""

import pytest
import torch

from harness.compiled_blocks import compiled_options
from model import GPTConfig
from parallel.measurement.compiled_bytes import measure_compiled_blocks
from parallel.measurement.local_stages import LocalPipeline
from parallel.measurement.stage_replay import StageReplay
from parallel.planning.config import SelectiveRecompute
from parallel.planning.layout import build_layout
from parallel.planning.run_plan import plan_run
from parallel.planning.shapes import RunShape, Target, Topology

pytestmark = pytest.mark.compile

# 3 heads of 16 channels, 24 tokens, 3 sequences per micro-batch, 3 blocks on 2 stages: no other test's shape
MODEL = GPTConfig(n_layer=3, n_head=3, n_embd=48, seq_len=24, vocab_size=96, dropout=0.1)
MICRO_BATCH_SIZE, MICRO_BATCHES = 3, 3
RECOMPUTE = SelectiveRecompute(modules=["mlp_act", "core_attn"])
PEAK_TOLERANCE = 0.02


@pytest.fixture(scope="module")
def planned():
    eager = Target("cpu", "fp32")
    blocks = measure_compiled_blocks(MODEL, MICRO_BATCH_SIZE, eager, compiled_options(RECOMPUTE))
    plans = {}
    for target in (eager, Target("cpu", "fp32", blocks)):
        run = RunShape(Topology(2), target, MICRO_BATCHES, MICRO_BATCH_SIZE)
        layout = build_layout(MODEL, RECOMPUTE, run, "type:Block", 0)
        plans[target.compiled is not None] = (run, layout, plan_run(MODEL, RECOMPUTE, layout, run))
    return plans


def test_each_compiled_stage_keeps_the_bytes_the_plan_counts(planned):
    run, layout, plan = planned[True]
    assert any("selective" in choice for stage in plan.stages for choice in stage.choices)
    torch._dynamo.reset()
    pipe = LocalPipeline(layout, compile=True)
    data = torch.Generator().manual_seed(2)
    shape = (MICRO_BATCH_SIZE, MODEL.seq_len)
    batches = [(torch.randint(0, MODEL.vocab_size, shape, generator=data),) * 2 for _ in range(MICRO_BATCHES)]
    pipe.step(batches)  # compiles
    pipe.step(batches, measure=True)
    for stage, planned_stage in zip(pipe.stages, plan.stages):
        assert stage.meter.bytes_per_micro_batch() == [planned_stage.activation_bytes_per_microbatch] * MICRO_BATCHES
    # what the measurement changed: eager autograd's count would have missed the compiled blocks
    eager = planned[False][2]
    assert [s.activation_bytes_per_microbatch for s in eager.stages] != [
        s.activation_bytes_per_microbatch for s in plan.stages
    ]


def test_each_compiled_stages_peak_is_the_planned_peak(planned):
    run, layout, plan = planned[True]
    for index, stage in enumerate(plan.stages):
        torch._dynamo.reset()
        measured = StageReplay(layout, index, run, compile=True).measure_peak()
        assert measured.unaccounted_bytes == 0
        assert measured.peak_bytes == pytest.approx(stage.predicted_peak_bytes, rel=PEAK_TOLERANCE), (
            index,
            stage.peak_tensor_terms,
            measured,
        )
