"""A zb-h1 run with early recompute, as a user types it (a train.py case of the session's shared launch): its trace
holds B, W and RecomputeEarly in the order the schedule gives them, and a later job of the same launch resumes from
its step-2 checkpoint bit-exactly. (The engine-level zb-h1 checks are tests/test_zero_bubble.py's, in the shared
engine launches.)"""

import json

import pytest

from tests.runs import TINY, metrics
from tests.shared_runs import case

ZB_EARLY_FULL = [
    *TINY,
    "model.seq_len=64",
    "train.steps=4",
    "train.micro_batches=4",
    "train.save_every=2",
    "train.trace_step=3",
    "logger=none",
    "parallel.schedule=zb-h1",
    "+recompute=full",
    "recompute.early=true",
]
CASES = {
    "straight": case(*ZB_EARLY_FULL),
    # a later job of the same launch: it resumes from the straight run's step-2 checkpoint
    "resumed": case(*ZB_EARLY_FULL, "train.resume={runs}/zero_bubble_run-straight/checkpoints/step_00000002"),
}


@pytest.mark.multiproc
def test_zb_h1_early_run_traces_b_w_and_early_recompute_and_resumes_bit_exactly(case_runs, shared_runs):
    straight, resumed = case_runs["straight"], case_runs["resumed"]
    events = json.loads((straight / "trace.json").read_text())["traceEvents"]
    spans = [e for e in events if e.get("ph") == "X"]
    for stage in (0, 1):
        names = [e["name"] for e in spans if e["pid"] == stage]
        assert names.count("BackwardInput") == names.count("BackwardWeight") == 4 and "BackwardPass" not in names
        assert names.count("RecomputeEarly") == (4 if stage == 0 else 0)  # the last stage recomputes inside B
    first = sorted((e for e in spans if e["pid"] == 0), key=lambda e: e["ts"])
    order = [e["name"] for e in first if e["name"] in ("RecomputeEarly", "RecvGrad")]
    assert order == ["RecomputeEarly", "RecvGrad"] * 4  # each micro-batch's recompute right before its wait

    assert f"resuming from {straight / 'checkpoints' / 'step_00000002'} after step 2" in shared_runs.case_output()
    assert [r["loss"] for r in metrics(resumed)] == [r["loss"] for r in metrics(straight)][2:]
