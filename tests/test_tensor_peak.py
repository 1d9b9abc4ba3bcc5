"""Peak tensor memory on CPU (parallel/measurement/tensor_peak.py): the allocator's view of one window, the tensors
alive when
it opens included, and a real 2-rank run whose summary.json compares it with the planner's predicted peak."""

import pytest
import torch
import yaml

from model import GPTConfig
from parallel.measurement.stage_replay import StageReplay
from parallel.measurement.tensor_peak import TensorPeakMeter, live_storages
from parallel.planning.config import FullRecompute, NoRecompute, SelectiveRecompute
from parallel.planning.layout import build_layout
from parallel.planning.run_plan import plan_run
from parallel.planning.shapes import RunShape, Target, Topology
from tests.runs import TINY, summary
from tests.shared_runs import case

MB = 1_000_000
REPLAY_GAP = 32 * 1024
"""The most a real run's measured stage peak may hold beyond the stage replay's: 28,688 B (stage 0) and 24,596 B
(stage 1) of the selective case. 12,288 B of each came with every stage's parameters counted in DeepSpeed's clipping
norm (parallel/runtime/engine.py's counted_on_every_stage; without it the run measures 16,400 and 12,308 B over the
replay), which the replay's own clipping does not hold; the rest is not traced yet: the replay is not exact."""


def measure(body):
    meter = TensorPeakMeter("cpu")
    with meter.window() as result:
        body()
    return result[0]


def test_a_tensor_alive_at_the_peak_is_counted_and_a_freed_one_is_not():
    kept = []

    def body():
        transient = torch.empty(3 * MB, dtype=torch.uint8)
        del transient  # freed before the larger one exists: never alive with it
        kept.append(torch.empty(5 * MB, dtype=torch.uint8))

    peak = measure(body)
    assert peak.peak_bytes - peak.baseline_bytes == 5 * MB
    assert peak.end_bytes - peak.baseline_bytes == 5 * MB
    assert peak.unaccounted_bytes == 0


def test_two_tensors_alive_together_are_summed():
    def body():
        a = torch.empty(2 * MB, dtype=torch.uint8)
        b = torch.empty(3 * MB, dtype=torch.uint8)
        del a, b

    peak = measure(body)
    assert peak.peak_bytes - peak.baseline_bytes == 5 * MB
    assert peak.end_bytes == peak.baseline_bytes


def test_the_baseline_counts_what_is_alive_and_its_frees_inside_the_window():
    """A tensor made before the window is in the baseline; freed inside it, its bytes leave the count at that moment
    (the profiler never reports that free: a finalizer does), so a same-sized replacement is no new peak."""
    holder = {"old": torch.empty(4 * MB, dtype=torch.uint8)}
    before = sum(s.nbytes() for s in live_storages().values())

    def body():
        del holder["old"]
        holder["new"] = torch.empty(4 * MB, dtype=torch.uint8)

    peak = measure(body)
    assert peak.baseline_bytes == before
    assert peak.peak_bytes == peak.baseline_bytes
    assert peak.end_bytes == peak.baseline_bytes and peak.unaccounted_bytes == 0


def test_a_block_allocated_in_an_earlier_window_is_freed_once():
    """The allocator remembers the sizes of blocks allocated while an earlier window profiled, so it reports their
    free as well as the finalizer: counted once."""
    holder = {}
    measure(lambda: holder.update(x=torch.empty(2 * MB, dtype=torch.uint8)))

    def body():
        holder["x"] = torch.empty(2 * MB, dtype=torch.uint8)  # allocated, then the old one freed

    peak = measure(body)
    assert peak.peak_bytes - peak.baseline_bytes == 2 * MB
    assert peak.end_bytes == peak.baseline_bytes and peak.unaccounted_bytes == 0


def test_views_and_gradients_count_their_storage_once():
    weight = torch.nn.Parameter(torch.ones(1000))
    (weight * 2).sum().backward()
    view = weight.detach()[10:]
    found = live_storages()
    assert found[weight.untyped_storage().data_ptr()].nbytes() == 4000
    assert weight.grad.untyped_storage().data_ptr() in found
    assert view.untyped_storage().data_ptr() == weight.untyped_storage().data_ptr()


def test_the_peak_names_the_op_that_reached_it():
    column, row = torch.ones(2000, 1), torch.ones(1, 2000)
    peak = measure(lambda: column.mm(row))  # (2000, 2000): 16 MB made by the matmul itself
    assert peak.peak_bytes - peak.baseline_bytes == 2000 * 2000 * 4
    assert peak.peak_op == "aten::mm"


def planned_terms(recompute, loss_chunk_tokens: int, vocab: int = 256) -> list[dict[str, int]]:
    model = GPTConfig(
        n_layer=4, n_head=4, n_embd=128, seq_len=128, vocab_size=vocab, loss_chunk_tokens=loss_chunk_tokens
    )
    run = RunShape(Topology(2), Target("cpu", "fp32"), micro_batches=4, micro_batch_size=2)
    plan = plan_run(model, recompute, build_layout(model, recompute, run, "type:Block", 0), run)
    for stage in plan.stages:
        assert sum(stage.peak_tensor_terms.values()) == stage.predicted_peak_bytes
    return [stage.peak_tensor_terms for stage in plan.stages]


def test_the_predicted_peak_holds_each_stages_own_buffers_and_its_largest_working_set():
    b, s, h = 2, 128, 128
    first, last = planned_terms(NoRecompute(), loss_chunk_tokens=0)
    assert first["grad buffer"] == b * s * h * 4 and "recv buffer" not in first and "kept input grads" not in first
    # two pipe buffers on the last stage: the one not being backpropagated keeps its input's gradient
    assert last["recv buffer"] == last["kept input grads"] == b * s * h * 4 and "grad buffer" not in last
    block_backward = 4 * (4 * b * s * h + 4 * h * h + h)
    assert first["working set: block backward"] == block_backward  # its output's gradient is the grad buffer
    # The last stage's last block runs its backward once the final norm, head and loss have freed what they kept:
    # there the loss's own backward (its log-probabilities' and logits' fp32 gradients, 2 N V 4) holds more.
    assert last["working set: loss backward"] == 2 * b * s * 256 * 4 < block_backward
    full = planned_terms(FullRecompute(interval="stage"), loss_chunk_tokens=0)
    assert all(terms["working set: segment recompute"] > block_backward for terms in full)


def test_a_large_vocabulary_makes_the_loss_backward_the_last_stages_working_set():
    n, h, v = 2 * 128, 128, 4096
    *_, unfused = planned_terms(NoRecompute(), loss_chunk_tokens=0, vocab=v)
    assert unfused["working set: loss backward"] == 2 * n * v * 4  # log-probabilities' and logits' gradients
    *_, fused = planned_terms(NoRecompute(), loss_chunk_tokens=64, vocab=v)
    # the hidden states' and the tied weight's gradients, and two 64-token chunks of fp32 logits (4 chunks in all)
    assert fused["working set: loss backward"] == n * h * 4 + v * h * 4 + 2 * 64 * v * 4


CASES = {
    "selective": case(
        *TINY,
        "train.steps=2",
        "train.trace_step=0",
        "train.micro_batches=4",
        "train.micro_batch_size=2",
        "logger=none",
        "+recompute=selective",
    ),
    # Keeps far less than the stages' gradients: the peak is ReduceGrads flattening them (docs/measurement.md)
    "nested": case(
        *TINY,
        "train.steps=2",
        "train.trace_step=0",
        "train.micro_batches=4",
        "train.micro_batch_size=1",
        "model.seq_len=32",
        "model.dropout=0.0",
        "logger=none",
        "+recompute=full",
        "recompute.interval=stage",
        "recompute.nested=true",
    ),
}


@pytest.mark.multiproc
def test_a_two_rank_run_records_measured_and_predicted_peaks_within_10_percent(case_runs):
    s = summary(case_runs["selective"])
    measured, predicted = s["measured_peak_tensor_bytes_per_stage"], s["predicted_peak_bytes_per_stage"]
    assert len(measured) == len(predicted) == 2
    for m, p, terms in zip(measured, predicted, s["predicted_peak_tensor_terms_per_stage"]):
        assert abs(m / p - 1) <= 0.10, (m, p, terms)
        assert sum(terms.values()) == p
    # the baseline holds at least the parameters and the two AdamW moments, far below the resident set
    for stage, baseline in enumerate(s["measured_baseline_tensor_bytes_per_stage"]):
        terms = s["predicted_peak_tensor_terms_per_stage"][stage]
        assert (
            terms["params"] + terms["optimizer"] <= baseline < measured[stage] < s["peak_memory_bytes_per_stage"][stage]
        )
    assert s["peak_memory_kind"] == "cpu_max_rss"


@pytest.mark.multiproc
def test_the_stage_replay_holds_the_real_runs_measured_peak(case_runs):
    """Each stage replayed alone in this process (parallel/measurement/stage_replay.py: the engine's interpreter, its
    buffers and clones) against the same stage's measured peak in the real 2-rank run, in bytes: within REPLAY_GAP,
    what the run's process holds beside its stage (the replay leaves out what its process held before the stage)."""
    run_dir = case_runs["selective"]
    s = summary(run_dir)
    config = yaml.safe_load((run_dir / "config.yaml").read_text())
    model = GPTConfig(**config["model"])
    run = RunShape(Topology(2), Target("cpu", "fp32"), micro_batches=4, micro_batch_size=2)
    layout = build_layout(model, SelectiveRecompute(), run, config["parallel"]["partition_method"], config["seed"])
    assert layout.as_dict() == s["layout"]  # the stages and plans the run trained
    measured = s["measured_peak_tensor_bytes_per_stage"]
    replayed = [StageReplay(layout, index, run).measure_peak().peak_bytes for index in range(2)]
    print(f"replayed {replayed} B, the run measured {measured} B")
    assert all(0 <= m - r <= REPLAY_GAP for r, m in zip(replayed, measured))


@pytest.mark.multiproc
def test_a_real_runs_peak_at_reduce_grads_is_the_planned_one(case_runs):
    """DeepSpeed's engine flattens every gradient in ReduceGrads, as the planner and the stage replay count: a stage
    that keeps less than its gradients peaks there, in the real run too, within what the run's process holds beside
    its stage (REPLAY_GAP). When a gloo thread freed that buffer (parallel/measurement/tensor_peak.py: the meter misses
    the free and reports it unaccounted), the meter's count stays that much high from then on, so the true peak lies
    between the measured one less the unaccounted bytes and the measured one (seen once in three runs, on stage 0)."""
    s = summary(case_runs["nested"])
    for measured, predicted, terms, unaccounted in zip(
        s["measured_peak_tensor_bytes_per_stage"],
        s["predicted_peak_bytes_per_stage"],
        s["predicted_peak_tensor_terms_per_stage"],
        s["tensor_peak_unaccounted_bytes_per_stage"],
    ):
        assert "working set: reduce grads" in terms and terms["activations"] == 0, terms
        lowest = measured - max(0, -unaccounted)
        assert lowest - REPLAY_GAP <= predicted <= measured, (measured, unaccounted, predicted, terms)
