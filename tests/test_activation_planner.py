"""The analytic activation planner against the saved-tensor meter, on the tiny model: every recompute mode
and interval, both attention kernels, dropout on and off, fp32 and bf16. The planner mirrors the code,
so the two must agree to the byte. Also: 1F1B in-flight counts from DeepSpeed's schedule, the paper's
per-block anchor for GPT-3 175B, and what sdpa without dropout leaves selective recompute to save."""

import pytest
import torch

from model import GPTConfig
from parallel.measurement.local_stages import LocalPipeline
from parallel.planning.config import FullRecompute, NoRecompute, SelectiveRecompute
from parallel.planning.layout import build_layout
from parallel.planning.memory_model import block_items, selective_combinations, total
from parallel.planning.plan_record import PaperBytes
from parallel.planning.run_plan import block_choices, plan_run
from parallel.planning.schedule_walk import in_flight_micro_batches, pipe_buffers
from parallel.planning.shapes import RunShape, Shape, Target, Topology

MODES = [
    NoRecompute(),
    FullRecompute(interval="1"),
    FullRecompute(interval="2"),
    FullRecompute(interval="3"),
    FullRecompute(interval="stage"),
    FullRecompute(interval="sqrt"),
    FullRecompute(interval="2", nested=True),
    FullRecompute(interval="stage", nested=True),
    *[SelectiveRecompute(modules=list(combo)) for combo in selective_combinations()],
]
# Each attention path that runs on CPU: explicit ops with and without dropout, SDPA's math backend
# (dropout on; upcasts bf16) and SDPA's flash kernel (dropout off); fp32 and bf16.
VARIANTS = [("math", 0.1, "fp32"), ("math", 0.0, "bf16"), ("sdpa", 0.1, "bf16"), ("sdpa", 0.0, "fp32")]


def mode_id(recompute) -> str:
    if isinstance(recompute, FullRecompute):
        return f"full-{recompute.interval}" + ("-nested" if recompute.nested else "")
    if isinstance(recompute, SelectiveRecompute):
        return "selective-" + "+".join(recompute.modules)
    return "none"


def measured_and_planned(
    recompute, attention="math", dropout=0.1, precision="fp32", stages=2, n_layer=6, micro_batch_size=2
):
    cfg = GPTConfig(
        n_layer=n_layer, n_head=4, n_embd=32, seq_len=16, vocab_size=64, dropout=dropout, attention=attention
    )
    run = RunShape(Topology(stages), Target("cpu", precision), micro_batches=2, micro_batch_size=micro_batch_size)
    layout = build_layout(cfg, recompute, run, "type:Block", seed=0)
    plan = plan_run(cfg, recompute, layout, run)
    pipe = LocalPipeline(layout, precision)
    g = torch.Generator().manual_seed(0)
    batches = [
        (
            torch.randint(0, 64, (micro_batch_size, 16), generator=g),
            torch.randint(0, 64, (micro_batch_size, 16), generator=g),
        )
        for _ in range(2)
    ]
    pipe.step(batches, measure=True)
    return pipe, plan


@pytest.mark.parametrize("attention, dropout, precision", VARIANTS, ids=lambda v: str(v))
@pytest.mark.parametrize("recompute", MODES, ids=mode_id)
def test_planned_bytes_equal_measured_bytes(recompute, attention, dropout, precision):
    pipe, plan = measured_and_planned(recompute, attention, dropout, precision)
    for stage, planned in zip(pipe.stages, plan.stages):
        per_micro_batch = stage.meter.bytes_per_micro_batch()
        assert per_micro_batch == [planned.activation_bytes_per_microbatch] * 2
        assert stage.meter.stage_input_bytes() == [planned.stage_input_bytes] * 2


def test_three_stages_and_bigger_micro_batches_agree_too():
    for recompute in (NoRecompute(), FullRecompute(interval="2"), SelectiveRecompute()):
        pipe, plan = measured_and_planned(recompute, stages=3, micro_batch_size=3)
        assert [s.meter.bytes_per_micro_batch()[0] for s in pipe.stages] == [
            s.activation_bytes_per_microbatch for s in plan.stages
        ]


def test_one_sequence_in_fp32_sdpa_keeps_the_qkv_output_its_v_views():
    """SDPA's math backend copies q and k but, in fp32 at b = 1, keeps a view of the QKV output as v."""
    for recompute in (NoRecompute(), SelectiveRecompute()):
        pipe, plan = measured_and_planned(recompute, "sdpa", 0.1, "fp32", micro_batch_size=1)
        assert [s.meter.bytes_per_micro_batch()[0] for s in pipe.stages] == [
            s.activation_bytes_per_microbatch for s in plan.stages
        ]


def test_stage_interval_stores_nothing_beyond_the_stage_input_on_a_block_only_stage():
    # 8 blocks over 4 stages, split by blocks: stages 1 and 2 hold blocks only.
    pipe, plan = measured_and_planned(FullRecompute(interval="stage"), stages=4, n_layer=8)
    for stage in (1, 2):
        measured = pipe.stages[stage].meter.bytes_per_micro_batch()[0]
        assert measured == plan.stages[stage].stage_input_bytes == 2 * 16 * 32 * 4
        assert plan.stages[stage].activation_bytes_per_microbatch == measured


@pytest.mark.parametrize("stages, micro_batches", [(2, 4), (4, 8), (4, 2), (8, 4)])
def test_in_flight_micro_batches_come_from_deepspeeds_schedule(stages, micro_batches):
    in_flight = [in_flight_micro_batches(micro_batches, stages, s) for s in range(stages)]
    # 1F1B: stage s runs (stages - s) forwards before its first backward, never more than there are.
    assert in_flight == [min(stages - s, micro_batches) for s in range(stages)]
    assert all(pipe_buffers(micro_batches, stages, s) >= n for s, n in enumerate(in_flight))


def test_peak_activation_bytes_are_per_micro_batch_bytes_times_in_flight():
    cfg = GPTConfig(n_layer=8, n_head=4, n_embd=32, seq_len=16, vocab_size=64, dropout=0.1, attention="math")
    run = RunShape(Topology(4), Target("cpu", "fp32"), micro_batches=8, micro_batch_size=2)
    plan = plan_run(cfg, NoRecompute(), build_layout(cfg, NoRecompute(), run, "type:Block", seed=0), run)
    assert [s.in_flight_microbatches for s in plan.stages] == [4, 3, 2, 1]
    for s in plan.stages:
        assert s.peak_activation_bytes == s.activation_bytes_per_microbatch * s.in_flight_microbatches
        # the peak adds DeepSpeed's transfer buffers, the causal masks and the backward's working set
        assert (
            s.predicted_peak_bytes
            == sum(s.peak_tensor_terms.values())
            > (s.param_bytes + s.grad_bytes + s.optimizer_bytes + s.peak_activation_bytes + s.pipe_buffer_bytes)
        )


GPT3 = Shape(b=1, s=2048, h=12288, a=96, vocab=50257, dropout=True, attention="math")


@pytest.mark.parametrize("modules, paper", [((), "none"), (("core_attn",), "selective")])
def test_gpt3_per_block_bytes_match_korthikanti_in_16_bit_on_cuda(modules, paper):
    planned = total(block_items(GPT3, Target("cuda", "bf16"), modules))
    assert planned == pytest.approx(getattr(PaperBytes.of(GPT3), paper), rel=0.10)


def test_gpt3_full_recompute_keeps_2sbh_per_block():
    choices = block_choices(GPT3, Target("cuda", "bf16"))
    assert choices["full"].activation_bytes == PaperBytes.of(GPT3).full


def test_sdpa_without_dropout_leaves_selective_almost_nothing_to_save():
    fused = Shape(b=1, s=2048, h=12288, a=96, vocab=50257, dropout=False, attention="sdpa")
    choices = block_choices(fused, Target("cuda", "bf16"))
    assert choices["selective:core_attn"].saved_bytes < 0.01 * choices["none"].activation_bytes
    explicit = block_choices(Shape(1, 2048, 12288, 96, 50257, False, "math"), Target("cuda", "bf16"))
    assert explicit["selective:core_attn"].saved_bytes > 0.4 * explicit["none"].activation_bytes


def test_cpu_dropout_masks_cost_the_input_dtype_and_cuda_masks_one_byte():
    shape = Shape(b=1, s=64, h=32, a=4, vocab=64, dropout=True, attention="math")
    off = Shape(b=1, s=64, h=32, a=4, vocab=64, dropout=False, attention="math")
    for device, mask in (("cpu", 2), ("cuda", 1)):
        target = Target(device, "bf16")
        # dropout adds: residual + MLP masks (2 sbh), the score mask (a s^2) and the dropped scores (2 a s^2)
        extra = total(block_items(shape, target)) - total(block_items(off, target))
        assert extra == 2 * 64 * 32 * mask + 4 * 64 * 64 * (mask + 2)
