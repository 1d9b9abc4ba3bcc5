"""One real 2-rank run through the deepspeed launcher: summary.json, metrics.jsonl and the offline W&B run
hold the measured activation bytes per stage (equal to the planner's), the 1F1B peak, peak memory per
stage and achieved FLOP/s. Full recompute with interval=stage: stage 0 keeps, for its blocks, only the stage input
the pipeline already holds; stage 1 holds one micro-batch, whose backward would remake all that `none` keeps (its
peak would not fall), so it runs without recompute."""

import pytest

from model import GPTConfig
from parallel.planning.config import NoRecompute
from parallel.planning.layout import build_layout
from parallel.planning.run_plan import plan_run
from parallel.planning.shapes import RunShape, Target, Topology
from tests import wandb_file
from tests.runs import TINY, metrics, summary
from tests.shared_runs import case

pytestmark = pytest.mark.multiproc
KEYS = ("activation_bytes_per_stage", "peak_activation_bytes_per_stage", "peak_memory_bytes_per_stage")
CASES = {
    "full-stage": case(
        *TINY,
        "train.steps=3",
        "train.micro_batches=4",
        "train.micro_batch_size=2",
        "train.trace_step=0",
        "model.dropout=0.1",
        "model.attention=math",
        "+recompute=full",
        "recompute.interval=stage",
    )
}


@pytest.fixture(scope="module")
def run_dir(case_runs):
    return case_runs["full-stage"]


def test_the_run_builds_no_op_and_leaves_no_shared_memory(run_dir, shared_runs):
    """DeepSpeed's CPU shm all-reduce (inference only) would JIT-build an op and leak 66 MB of /dev/shm per
    rank per launch, enough to fill a test machine's memory over a test session. Checked on the whole launch that
    trained this run (every case of the session), with its own torch extensions directory, empty at start."""
    launch = shared_runs.launch("cases", 2)
    assert not launch.shared_memory_added
    assert not launch.extensions.exists() or not any(launch.extensions.iterdir())


def test_measured_activation_bytes_equal_the_plan(run_dir):
    s = summary(run_dir)
    assert s["activation_measured_at_step"] == 2
    assert s["activation_bytes_per_stage"] == s["planned_activation_bytes_per_stage"]
    b, t, h = 2, 128, 128
    # stage 0: token ids; stage 1: the hidden states it receives (fp32), kept by the one stage-wide segment
    assert s["stage_input_bytes_per_stage"] == [b * t * 8, b * t * h * 4]
    # stage 1 runs without recompute: it keeps what the planner's `none` plan keeps there
    assert [entry["choices"] for entry in s["layout"]] == [["full", "full"], ["none", "none"]]
    cfg = GPTConfig(n_layer=4, n_head=4, n_embd=h, seq_len=t, vocab_size=256, dropout=0.1, attention="math")
    run = RunShape(Topology(2), Target("cpu", "fp32"), micro_batches=4, micro_batch_size=b)
    none = plan_run(cfg, NoRecompute(), build_layout(cfg, NoRecompute(), run, "balanced", 1234), run)
    assert s["activation_bytes_per_stage"][1] == none.stages[1].activation_bytes_per_microbatch


def test_peaks_follow_the_1f1b_schedule(run_dir):
    s = summary(run_dir)
    assert s["in_flight_microbatches_per_stage"] == [2, 1]
    assert s["peak_activation_bytes_per_stage"] == [a * n for a, n in zip(s["activation_bytes_per_stage"], [2, 1])]
    assert s["peak_memory_kind"] == "cpu_max_rss"
    assert all(100 * 2**20 < m < 8 * 2**30 for m in s["peak_memory_bytes_per_stage"])


def test_flops_are_logged_per_rank_without_mfu_on_cpu(run_dir):
    s = summary(run_dir)
    assert len(s["tflops_per_rank"]) == 2 and all(v > 0 for v in s["tflops_per_rank"])
    assert s["peak_tflops"] is None and "mfu_per_rank" not in s
    # one extra forward of stage 0's blocks, and of the LM head (the fused loss makes its logits again)
    assert 1.15 < s["hardware_flops_per_step"] / s["model_flops_per_step"] < 1.19
    assert all(r["tflops_per_rank"] > 0 and "mfu" not in r for r in metrics(run_dir))


def test_offline_wandb_summary_holds_the_accounting(run_dir):
    (path,) = wandb_file.find_run_files(run_dir / "wandb")
    logged = wandb_file.summary(path)
    s = summary(run_dir)
    for key in KEYS:
        assert logged[key] == s[key]
    assert all("tflops_per_rank" in r for r in wandb_file.history(path) if "loss" in r)
