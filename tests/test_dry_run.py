"""`python train.py ... dry_run=true`: no launcher, no process group, plan.json in the run directory, the
same stages as training; bad planner inputs fail at start-up with exit 2 and one message."""

import json
import resource

import pytest

from model import GPTConfig
from parallel.planning.config import NoRecompute
from parallel.planning.layout import build_layout
from parallel.planning.plan_record import RunPlan
from parallel.planning.shapes import RunShape, Target, Topology
from tests.runs import python_run

STAGE_KEYS = {
    "stage",
    "layers",
    "params",
    "activation_bytes_per_microbatch",
    "in_flight_microbatches",
    "peak_activation_bytes",
    "predicted_peak_bytes",
    "param_bytes",
    "grad_bytes",
    "optimizer_bytes",
    "recompute_flops_per_step",
    "stage_input_bytes",
}


def _children_cpu_s() -> float:
    """CPU seconds of this process's finished children so far."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def test_gpt3_175b_on_8_stages_plans_in_seconds_without_a_launcher(tmp_path):
    run_dir = tmp_path / "plan"
    start = _children_cpu_s()
    result = python_run(
        run_dir,
        "model=gpt3-175b",
        "data=synthetic",
        "train.prices=curves",
        "parallel.pipeline_stages=8",
        "dry_run=true",
        timeout=120,
    )
    elapsed = _children_cpu_s() - start  # CPU seconds: load stretches the wall time, not the dry run's work
    assert elapsed < 60, f"dry run took {elapsed:.1f} CPU s"
    plan = json.loads((run_dir / "plan.json").read_text())
    assert plan["target"]["device"] == "cuda" and plan["target"]["precision"] == "bf16"  # auto, planned for CUDA
    assert (plan["pipeline_stages"], plan["world_size"]) == (8, 8)
    assert len(plan["stages"]) == 8 and all(STAGE_KEYS <= s.keys() for s in plan["stages"])
    assert len(plan["per_block_activation_bytes"]) == 96
    assert sum(s["blocks"] for s in plan["stages"]) == 96
    assert [s["in_flight_microbatches"] for s in plan["stages"]] == [4, 4, 4, 4, 4, 3, 2, 1]
    # The same partition training would use (DeepSpeed's routine, on the meta device).
    cfg = GPTConfig(n_layer=96, n_head=96, n_embd=12288, seq_len=2048, vocab_size=50257)
    run = RunShape(Topology(8), Target("cuda", "bf16"), micro_batches=4, micro_batch_size=2)
    layout = build_layout(cfg, NoRecompute(), run, "balanced", seed=1234)
    assert [s["layers"] for s in plan["stages"]] == [[r.start, r.stop] for r in layout.stages]
    assert 170e9 < sum(s["params"] for s in plan["stages"]) < 177e9  # the tied embedding counts on both ends
    out = result.stdout
    assert "stagecheck: plan for cuda bf16" in out and "pred. peak" in out
    # The predicted step, with analytic costs, for the plan, the uniform modes and two GPU targets.
    assert plan["step_time_costs"] == "analytic" and plan["predicted_step_time_s"] > 0
    assert set(plan["by_mode_s"]) == {"none", "selective", "full"} and plan["by_mode_s"]["none"] == pytest.approx(
        plan["predicted_step_time_s"]
    )
    assert plan["by_mode_s"]["full"] > plan["by_mode_s"]["none"]  # full recompute adds a forward to each backward
    h100, a100 = plan["by_gpu"]["H100"], plan["by_gpu"]["A100"]
    assert a100["step_time_s"] > h100["step_time_s"] and 0 < h100["mfu"] < 1 and 0 < a100["mfu"] < 1
    assert len(plan["stage_busy_s"]) == len(plan["stage_idle_s"]) == 8
    assert RunPlan.from_json(plan).to_json() == plan  # the sweep report reads it back, step time included
    for line in ("predicted_step_time_s", "analytic costs", "predicted on H100", "predicted on A100", "MFU"):
        assert line in out
    # Nothing of a training run: no process group, no engine, no outputs but plan.json.
    assert "init_distributed" not in out + result.stderr and "DeepSpeed info" not in out + result.stderr
    assert sorted(p.name for p in run_dir.iterdir()) == ["plan.json"]


def test_gpt3_175b_on_16_stages_matches_the_paper_per_block(tmp_path):
    run_dir = tmp_path / "plan"
    python_run(
        run_dir,
        "model=gpt3-175b",
        "data=synthetic",
        "train.prices=curves",
        "parallel.pipeline_stages=16",
        "dry_run=true",
        "model.dropout=0.1",
        "model.attention=math",
        "train.precision=bf16",
        "train.device=cuda",
        "+recompute=selective",
        timeout=120,
    )
    plan = json.loads((run_dir / "plan.json").read_text())
    paper = plan["korthikanti_per_block_bytes"]
    assert len(plan["stages"]) == 16
    # The last stage holds one micro-batch, and its peak is its optimizer step (BF16_Optimizer's fp32 copy of the
    # gradients): recomputing there would lower nothing, so the planner leaves it out.
    choices = [c for stage in plan["stages"] for c in stage["choices"]]
    assert {c for stage in plan["stages"][:-1] for c in stage["choices"]} == {"selective:core_attn"}
    selective = [b for b, c in zip(plan["per_block_activation_bytes"], choices) if c == "selective:core_attn"]
    assert all(b == pytest.approx(paper["selective"], rel=0.10) for b in selective)
    choices = plan["block_choices"]
    assert choices["none"]["activation_bytes"] == pytest.approx(paper["none"], rel=0.10)
    assert choices["full"]["activation_bytes"] == pytest.approx(paper["full"], rel=0.10)


def test_balanced_gives_gpt2_on_4_stages_a_block_on_every_stage_and_parameters_warns(tmp_path):
    balanced = python_run(
        tmp_path / "b",
        "model=gpt2",
        "data=synthetic",
        "train.prices=curves",
        "parallel.pipeline_stages=4",
        "dry_run=true",
    )
    plan = json.loads((tmp_path / "b" / "plan.json").read_text())
    assert all(s["blocks"] >= 1 for s in plan["stages"]) and sum(s["blocks"] for s in plan["stages"]) == 12
    assert "holds no transformer block" not in balanced.stdout
    by_parameters = python_run(
        tmp_path / "p",
        "model=gpt2",
        "data=synthetic",
        "train.prices=curves",
        "parallel.pipeline_stages=4",
        "parallel.partition_method=parameters",
        "dry_run=true",
    )
    plan = json.loads((tmp_path / "p" / "plan.json").read_text())
    assert [s["blocks"] for s in plan["stages"]] == [0, 6, 6, 0]  # DeepSpeed weighs the embedding like ~5 blocks
    warnings = [line for line in by_parameters.stdout.splitlines() if "holds no transformer block" in line]
    assert len(warnings) == 2 and "stage 0" in warnings[0] and "stage 3" in warnings[1]
    assert "parallel.partition_method=balanced" in warnings[0]


BAD = [
    (
        ["+recompute=selective", "recompute.modules=[core_attn,softmax]"],
        "recompute.modules=['core_attn', 'softmax'] is invalid: choose one or more of core_attn, mlp_act, layernorm, "
        "mlp",
    ),
    (["train.precision=fp8"], "train.precision='fp8' is unknown: allowed values are auto, fp32, bf16, fp16"),
    (["model.attention=flash3"], "model.attention='flash3' is unknown: allowed values are sdpa, math"),
    (["train.device=cpu", "train.precision=fp16"], "train.precision='fp16' needs train.device=cuda"),
    (["train.peak_tflops=-1"], "train.peak_tflops=-1.0 is invalid: it must be > 0"),
    (
        ["+recompute=plan", "recompute.file=no/plan.json"],
        "recompute.file=no/plan.json is not a file: give the plan.json",
    ),
]


@pytest.mark.parametrize("overrides, message", BAD, ids=lambda v: " ".join(v) if isinstance(v, list) else None)
def test_bad_planner_inputs_fail_at_start_up(tmp_path, overrides, message):
    run_dir = tmp_path / "run"
    result = python_run(
        run_dir,
        "model=tiny",
        "data=synthetic",
        "train.prices=curves",
        "dry_run=true",
        *overrides,
        check=False,
        timeout=120,
    )
    assert result.returncode == 2, result.stderr
    assert message in result.stderr
    assert "Traceback" not in result.stderr + result.stdout
    assert not run_dir.exists()
