"""train.trace_step: real 2-rank runs record every pipeline instruction of the traced step on one clock, in
DeepSpeed's TrainSchedule order, with the recompute nested inside backward; trace.json, timeline.png, the
bubble figures in summary.json and the W&B copies; no trace when off; bad values refused at start-up."""

import json
import shutil
import subprocess
import sys
from contextlib import contextmanager

import pytest
import torch
from deepspeed.runtime.pipe.schedule import TrainSchedule

from parallel.measurement.step_clock import HostClock
from parallel.measurement.trace import StepRecorder
from parallel.planning.config import FullRecompute, NoRecompute, SelectiveRecompute
from parallel.planning.virtual_sim import EXCHANGE
from parallel.runtime.recompute import observe_recompute
from sweep.report import write_report
from tests.runs import TINY, free_port, python_run, summary
from tests.shared_runs import case
from tests.test_recompute_exact import loss_and_grads

SHAPE = ["model.seq_len=32", "train.micro_batch_size=2", "train.save_every=0"]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
US = 0.01  # trace.json rounds ts and dur to 1e-3 us each


CASES = {
    # Selective core_attn + mlp_act: a checkpoint's recompute and an output-discarding one in every block.
    # Step 3 runs after the traced step 2: an instruction map left wrapped would add its instructions.
    "selective": case(
        *TINY,
        *SHAPE,
        "train.steps=3",
        "train.trace_step=2",
        "train.micro_batches=4",
        "+recompute=selective",
        "recompute.modules=[core_attn,mlp_act]",
    ),
    # No train.trace_step: with train.steps < 3 the default traces the last step.
    "none": case(*TINY, *SHAPE, "train.steps=2", "train.micro_batches=3", "logger=none"),
    "off": case(*TINY, *SHAPE, "train.steps=1", "train.trace_step=0", "train.micro_batches=2", "logger=none"),
}


@pytest.fixture(scope="module")
def runs(case_runs):
    return {"selective": (case_runs["selective"], 4), "none": (case_runs["none"], 3)}


def _events(run_dir):
    return json.loads((run_dir / "trace.json").read_text())["traceEvents"]


def _per_stage(events, recompute: bool):
    stages = {}
    for e in events:
        if e["ph"] == "X" and (e["name"] == "Recompute") == recompute:
            stages.setdefault(e["pid"], []).append(e)
    return {stage: sorted(es, key=lambda e: e["ts"]) for stage, es in stages.items()}


@pytest.mark.multiproc
@pytest.mark.parametrize("mode", ["selective", "none"])
def test_every_instruction_of_both_ranks_in_schedule_order(runs, mode):
    run_dir, micro_batches = runs[mode]
    stages = _per_stage(_events(run_dir), recompute=False)
    assert sorted(stages) == [0, 1]
    for stage, events in stages.items():
        expected = [
            (type(cmd).__name__, cmd.kwargs.get("buffer_id"))
            for cmds in TrainSchedule(micro_batches=micro_batches, stages=2, stage_id=stage).steps()
            for cmd in cmds
        ]
        assert [(e["name"], e["args"].get("buffer_id")) for e in events] == expected
        assert all(e["tid"] == 0 and e["args"]["rank"] == stage for e in events)
        for kind in ("ForwardPass", "BackwardPass"):
            assert [e["args"]["micro_batch"] for e in events if e["name"] == kind] == list(range(micro_batches))
        for earlier, later in zip(events, events[1:]):
            assert earlier["ts"] + earlier["dur"] <= later["ts"] + US, (earlier, later)
        assert events[0]["ts"] >= 0


@pytest.mark.multiproc
def test_recompute_nests_inside_its_backward_pass(runs):
    run_dir, micro_batches = runs["selective"]
    events = _events(run_dir)
    blocks = [len(stage["choices"]) for stage in summary(run_dir)["layout"]]
    backward = {(e["pid"], e["args"]["micro_batch"]): e for e in events if e["name"] == "BackwardPass"}
    recomputing = _per_stage(events, recompute=True)
    assert sorted(recomputing) == [0, 1]
    for stage, recomputes in recomputing.items():
        # Each block recomputes its attention core and its GELU output once per backward.
        assert len(recomputes) == 2 * blocks[stage] * micro_batches
        for r in recomputes:
            b = backward[(stage, r["args"]["micro_batch"])]
            assert b["ts"] - US <= r["ts"] and r["ts"] + r["dur"] <= b["ts"] + b["dur"] + US, (r, b)
    assert _per_stage(_events(runs["none"][0]), recompute=True) == {}


@pytest.mark.parametrize(
    "recompute, per_backward",
    [
        (SelectiveRecompute(modules=["core_attn", "mlp_act"]), 6),  # a checkpoint and a discarded output per block
        (SelectiveRecompute(modules=["layernorm"]), 6),  # ln_1's and ln_2's outputs discarded
        (FullRecompute(interval="1"), 3),
        (FullRecompute(interval="stage"), 1),
        (NoRecompute(), 0),
    ],
    ids=["core_attn+mlp_act", "layernorm", "full-1", "full-stage", "none"],
)
def test_the_recompute_observer_brackets_each_recompute_and_changes_nothing(recompute, per_backward):
    """3 blocks, 2 micro-batches: every recompute is entered and left once, and the gradients stay bit-exact."""
    base_losses, base_grads = loss_and_grads(recompute, "math")
    edges = []

    @contextmanager
    def observer():
        edges.append("enter")
        try:
            yield
        finally:  # a checkpoint's recompute ends with torch's _StopRecomputationError once it has what it needs
            edges.append("exit")

    with observe_recompute(observer):
        losses, grads = loss_and_grads(recompute, "math")
    assert edges == ["enter", "exit"] * 2 * per_backward
    assert all(torch.equal(a, b) for a, b in zip(losses + grads, base_losses + base_grads, strict=True))


class ReadCountingClock(HostClock):
    """The CPU clock, counting how often its marks are read."""

    reads = 0

    def seconds(self, marks: list) -> list[float]:
        self.reads += 1
        return super().seconds(marks)


def test_the_recorder_numbers_micro_batches_nests_recomputes_and_reads_its_clock_once_after_the_step():
    """The bookkeeping StepTracer runs on both clocks, with the CPU one: marks unread until the step is over (on
    CUDA, reading an event waits for the device), each handler's result passed through."""
    clock = ReadCountingClock()
    recorder = StepRecorder(clock)
    clock.start()

    def forward(engine, buffer_id):
        return buffer_id * 10

    def backward(engine, buffer_id):
        with recorder.recompute():
            with recorder.recompute():  # nested: counted in the outer one
                pass
        with recorder.recompute():
            pass

    handlers = {name: recorder.timed(name, fn) for name, fn in (("ForwardPass", forward), ("BackwardPass", backward))}
    step = recorder.timed("OptimizerStep", lambda engine: None)
    assert [handlers["ForwardPass"](None, buffer_id=b) for b in (0, 1)] == [0, 10]
    handlers["BackwardPass"](None, buffer_id=0)
    handlers["BackwardPass"](None, buffer_id=1)
    step(None)
    assert clock.reads == 0
    instructions, recomputes, end_s = recorder.finish()
    assert clock.reads == 1
    assert [(i.name, i.buffer_id, i.micro_batch) for i in instructions] == [
        ("ForwardPass", 0, 0),
        ("ForwardPass", 1, 1),
        ("BackwardPass", 0, 0),
        ("BackwardPass", 1, 1),
        ("OptimizerStep", None, None),
    ]
    assert [(r.name, r.micro_batch) for r in recomputes] == [("Recompute", 0)] * 2 + [("Recompute", 1)] * 2
    edges = [t for i in instructions for t in (i.start_s, i.end_s)]
    assert 0 <= edges[0] and edges == sorted(edges) and edges[-1] <= end_s
    for r in recomputes:
        (outer,) = [i for i in instructions if i.name == "BackwardPass" and i.micro_batch == r.micro_batch]
        assert outer.start_s <= r.start_s <= r.end_s <= outer.end_s


def test_a_programme_run_by_its_engine_is_timed_with_its_chunks_and_boundaries():
    """The recorder as a virtual-stage rank's runner drives it (parallel/runtime/virtual_rank.py's run_training_step):
    each instruction with its micro-batch and its chunk's virtual stage, a recompute with those of its backward, and a
    boundary's batch as one interval (BoundaryExchange), as the simulator prices it."""
    recorder = StepRecorder(ReadCountingClock())
    recorder.clock.start()
    with recorder.instruction("ForwardPass", 0, virtual_stage=3):
        pass
    with recorder.instruction(EXCHANGE, None):
        pass
    with recorder.instruction("BackwardInput", 0, virtual_stage=3):
        with recorder.recompute():
            pass
    instructions, recomputes, _ = recorder.finish()
    assert [(i.name, i.micro_batch, i.virtual_stage) for i in instructions] == [
        ("ForwardPass", 0, 3),
        (EXCHANGE, None, None),
        ("BackwardInput", 0, 3),
    ]
    assert [(r.micro_batch, r.virtual_stage) for r in recomputes] == [(0, 3)]


@pytest.mark.multiproc
def test_chrome_trace_fields_and_timeline_png(runs):
    run_dir, _ = runs["selective"]
    trace = json.loads((run_dir / "trace.json").read_text())
    assert trace["displayTimeUnit"] == "ms"
    names = {(e["pid"], e["args"]["name"]) for e in trace["traceEvents"] if e.get("name") == "process_name"}
    assert names == {(0, "stage 0"), (1, "stage 1")}
    for e in trace["traceEvents"]:
        if e["ph"] == "X":
            assert {"name", "cat", "ts", "dur", "pid", "tid"} <= set(e)
            assert e["dur"] >= 0
    assert (run_dir / "timeline.png").read_bytes()[:8] == PNG_MAGIC
    for name in ("trace.json", "timeline.png"):  # attached to the offline W&B run
        assert list(run_dir.glob(f"wandb/offline-run-*/files/{name}")), name


@pytest.mark.multiproc
@pytest.mark.parametrize("mode, step", [("selective", 2), ("none", 2)])
def test_summary_has_the_bubbles_per_stage(runs, mode, step):
    run_dir, micro_batches = runs[mode]
    s = summary(run_dir)
    assert s["traced_step"] == step
    total = s["traced_step_time_s"]
    assert 0 < total < 60
    assert 0 <= s["trace_clock_skew_s"] < 0.1  # us when the 2 cores are free, 8 ms seen at a load average of 17
    for busy, idle, bubble in zip(s["stage_busy_s"], s["stage_idle_s"], s["bubble_fraction_per_stage"], strict=True):
        assert busy > 0 and idle >= 0
        assert busy + idle == pytest.approx(total)
        assert bubble == pytest.approx(idle / total)
    assert len(s["stage_busy_s"]) == len(s["trace_costs"]) == 2
    for costs in s["trace_costs"]:
        assert costs["forward_s"] > 0 and costs["backward_s"] > costs["recompute_s"] >= 0
    recomputed = [r > 0 for r in s["recompute_s_per_stage"]]
    assert recomputed == ([True, True] if mode == "selective" else [False, False])
    # the plan's prediction of every instruction the stage ran, against the traced step's (harness/prediction_check.py)
    prediction = s["prediction"]
    assert prediction["predicted_step_time_s"] == s["predicted_step_time_s"]
    assert prediction["error"] == pytest.approx(s["step_time_s"] / s["predicted_step_time_s"] - 1)
    for stage in prediction["per_stage"]:
        assert stage["ForwardPass"]["measured_s"] > 0 and stage["ForwardPass"]["ratio"] > 0
        assert stage["OptimizerStep"]["predicted_s"] > 0


@pytest.mark.multiproc
def test_sweep_report_shows_bubbles_and_embeds_the_timelines(runs, tmp_path):
    sweep = tmp_path / "sweep"
    for num, mode in enumerate(("none", "selective")):  # the two runs as the jobs of one sweep
        shutil.copytree(runs[mode][0], sweep / str(num), ignore=shutil.ignore_patterns("wandb", "checkpoints"))
    markdown = write_report(sweep, wandb=False)["markdown"].read_text()
    assert "| step time | step time pred. | bubble |" in markdown
    bubbles = summary(sweep / "1")["bubble_fraction_per_stage"]
    assert " / ".join(f"{b * 100:.1f}%" for b in bubbles) in markdown
    for num in ("0", "1"):
        assert f"![timeline of job {num}]({num}/timeline.png)" in markdown
        assert f"[trace.json]({num}/trace.json)" in markdown


@pytest.mark.multiproc
def test_trace_step_zero_writes_nothing(case_runs):
    run_dir = case_runs["off"]
    assert not (run_dir / "trace.json").exists() and not (run_dir / "timeline.png").exists()
    assert "traced_step" not in summary(run_dir)


@pytest.mark.parametrize("value", ["-1", "4"])
def test_bad_trace_step_is_refused_at_start_up(tmp_path, value):
    run_dir = tmp_path / "run"
    result = python_run(run_dir, *TINY, "train.steps=3", f"train.trace_step={value}", check=False, timeout=120)
    assert result.returncode == 2
    assert f"train.trace_step={value} is invalid: it must be a step in [1, train.steps=3]" in result.stderr
    assert "Traceback" not in result.stderr + result.stdout
    assert not run_dir.exists()


LATE_S = 0.5
SEND_PROBE = """
import sys, time, torch, torch.distributed as dist
rank, port, late_s = int(sys.argv[1]), sys.argv[2], float(sys.argv[3])
dist.init_process_group("gloo", rank=rank, world_size=2, init_method=f"tcp://127.0.0.1:{port}")
tensor = torch.ones(1)
if rank == 0:
    start = time.perf_counter()
    dist.send(tensor, 1)
    print(time.perf_counter() - start)
else:
    time.sleep(late_s)  # the recv is posted this late
    dist.recv(tensor, 0)
dist.destroy_process_group()
"""


@pytest.mark.multiproc
def test_gloo_send_waits_for_the_matching_recv():
    """What the timeline shows on CPU (docs/measurement.md): DeepSpeed's p2p.send is torch.distributed.send,
    and on gloo it returns only once the peer has posted its recv, even for 4 bytes: a rendezvous."""
    args = [str(free_port()), str(LATE_S)]
    ranks = [
        subprocess.Popen([sys.executable, "-c", SEND_PROBE, str(r), *args], stdout=subprocess.PIPE, text=True)
        for r in (0, 1)
    ]
    send_s = float(ranks[0].communicate(timeout=120)[0])
    ranks[1].communicate(timeout=60)
    assert send_s >= 0.8 * LATE_S
