"""On a CUDA device (`gpu` marker; skipped without one; `make gpu-check` runs them): planned = measured activation
bytes; the predicted peak against `max_memory_allocated` over the step window; exactness as docs/gpu.md defines it
(fp32 with math attention and deterministic algorithms: bit-identical across recompute modes, early recompute and
ZB-H1's deferred W; bf16 with SDPA: within the stated bound of no recompute); the weight-gradient store and early
recompute; an fp16 loss-scale overflow skipped, not a fault; a resume, also under another device visibility. NCCL
refuses two ranks on one GPU: multi-stage checks here run every stage in this process; the 2-rank NCCL run is
`make gpu-check`'s (two GPUs or more)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from harness.faults import TEST_FAIL_ENV
from model import Block, GPTConfig
from model.weight_grad import WeightGradStore, linear, split_backward
from parallel.measurement.local_stages import LocalPipeline
from parallel.planning.config import FullRecompute, NoRecompute, SelectiveRecompute
from parallel.planning.layout import build_layout
from parallel.planning.memory_model import selective_combinations
from parallel.planning.run_plan import plan_run
from parallel.planning.shapes import RunShape, Target, Topology
from tests.runs import REPO, cpu_env, metrics, summary
from tests.test_activation_planner import MODES, mode_id
from tests.test_zero_bubble import gpt_grads

# Deterministic cuBLAS (its workspace config must be set before cuBLAS starts in this process).
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

BF16_GRAD_BOUND = 2**-6
"""bf16 with SDPA: every gradient within this relative L2 distance of no recompute's (docs/gpu.md)."""
BF16_LOSS_BOUND = 2**-8
"""bf16 with SDPA: every loss within this relative distance of no recompute's (bf16's own epsilon)."""
RNG_BYTES_PER_BLOCK = 64
"""SDPA's fused kernels with dropout keep their RNG seed and offset: a few bytes per block the model leaves out."""

RECOMPUTES = [
    *[SelectiveRecompute(modules=list(c)) for c in selective_combinations()],
    FullRecompute(interval="1"),
    FullRecompute(interval="2"),
]


@pytest.mark.parametrize(
    "attention, dropout, precision",
    [("math", 0.1, "fp32"), ("math", 0.1, "bf16"), ("sdpa", 0.1, "bf16"), ("sdpa", 0.0, "bf16"), ("sdpa", 0.1, "fp32")],
    ids=str,
)
@pytest.mark.parametrize("recompute", MODES, ids=mode_id)
def test_planned_activation_bytes_equal_measured_on_cuda(recompute, attention, dropout, precision):
    """Every stage in this process (parallel/measurement/local_stages.py), on the GPU: the saved-tensor meter
    against the planner, per micro-batch. seq_len 64: flash's log-sum-exp rows and the efficient kernel's padded
    ones agree."""
    cfg = GPTConfig(n_layer=6, n_head=4, n_embd=64, seq_len=64, vocab_size=64, dropout=dropout, attention=attention)
    run = RunShape(Topology(2), Target("cuda", precision), micro_batches=2, micro_batch_size=2)
    layout = build_layout(cfg, recompute, run, "type:Block", seed=0)
    plan = plan_run(cfg, recompute, layout, run)
    pipe = LocalPipeline(layout, precision)
    for stage in pipe.stages:
        stage.cuda()
    g = torch.Generator().manual_seed(0)
    batches = [tuple(torch.randint(0, 64, (2, 64), generator=g).cuda() for _ in range(2)) for _ in range(2)]
    pipe.step(batches, measure=True)
    slack = RNG_BYTES_PER_BLOCK if attention == "sdpa" and dropout else 0
    for stage, planned, stage_range in zip(pipe.stages, plan.stages, layout.stages):
        blocks = sum(layout.recipes[i].module_class is Block for i in stage_range.layers)
        for measured in stage.meter.bytes_per_micro_batch():
            assert 0 <= measured - planned.activation_bytes_per_microbatch <= slack * blocks
        assert stage.meter.stage_input_bytes() == [planned.stage_input_bytes] * 2


def deterministic(on: bool) -> None:
    torch.use_deterministic_algorithms(on)
    torch.backends.cudnn.benchmark = False


@pytest.mark.parametrize("recompute", RECOMPUTES, ids=lambda r: getattr(r, "interval", None) or "+".join(r.modules))
def test_fp32_math_attention_is_bit_identical_across_modes_early_and_deferred_w(recompute):
    deterministic(True)
    try:
        base_losses, base_grads = gpt_grads(NoRecompute(), "math", False, False, "cuda", width=64)
        for early, defer in ((False, False), (True, False), (False, True), (True, True)):
            losses, grads = gpt_grads(recompute, "math", early, defer, "cuda", width=64)
            assert all(torch.equal(a, b) for a, b in zip(losses, base_losses)), (early, defer)
            assert all(torch.equal(g, b) for g, b in zip(grads, base_grads)), (early, defer)
    finally:
        deterministic(False)


@pytest.mark.parametrize("recompute", RECOMPUTES, ids=lambda r: getattr(r, "interval", None) or "+".join(r.modules))
def test_bf16_sdpa_stays_within_the_stated_bound_of_no_recompute(recompute):
    base_losses, base_grads = gpt_grads(NoRecompute(), "sdpa", False, False, "cuda", torch.bfloat16, width=64)
    for early, defer in ((False, False), (True, False), (False, True), (True, True)):
        losses, grads = gpt_grads(recompute, "sdpa", early, defer, "cuda", torch.bfloat16, width=64)
        for a, b in zip(losses, base_losses):
            assert abs(a.float() - b.float()) <= BF16_LOSS_BOUND * abs(b.float()), (early, defer)
        for g, b in zip(grads, base_grads):
            distance = (g.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)
            assert distance <= BF16_GRAD_BOUND, (early, defer, float(distance))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_deferred_weight_gradient_is_nn_linears_on_cuda(dtype):
    """W's g^T x against autograd's own weight gradient of F.linear, under deterministic cuBLAS."""
    deterministic(True)
    try:
        gen = torch.Generator().manual_seed(0)
        x = torch.randn(4, 64, 256, generator=gen).to("cuda", dtype).requires_grad_()
        weight = torch.randn(768, 256, generator=gen).to("cuda", dtype).requires_grad_()
        grad = torch.randn(4, 64, 768, generator=gen).to("cuda", dtype)
        torch.nn.functional.linear(x, weight).backward(grad)
        expected = (x.grad, weight.grad)
        x.grad = weight.grad = None
        store = WeightGradStore()
        with split_backward(), store.deferring():
            linear(x, weight, None).backward(grad)
        assert weight.grad is None
        store.apply_oldest()
        assert torch.equal(x.grad, expected[0]) and torch.equal(weight.grad, expected[1])
    finally:
        deterministic(False)


# ---- real runs on one GPU: python train.py (one rank, NCCL) --------------------------------------------------


def cuda_env(tmp: Path, **extra: str) -> dict:
    env = cpu_env(tmp, **extra)
    env["DS_ACCELERATOR"] = "cuda"
    return env


def train_on_cuda(run_dir: Path, *overrides: str, env: dict, check: bool = True) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "train.py", f"hydra.run.dir={run_dir}", "train.device=cuda", *overrides]
    result = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    if check:
        assert result.returncode == 0, f"STDOUT:\n{result.stdout[-3000:]}\nSTDERR:\n{result.stderr[-5000:]}"
    return result


GPT2_STEPS = ["model=gpt2", "data=synthetic", "train.steps=4", "train.micro_batches=2", "train.micro_batch_size=4"]
GPT2_STEPS += ["train.measure_step=2", "train.trace_step=0", "logger=none", "train.precision=bf16"]


@pytest.mark.multiproc
@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
def test_predicted_peak_is_within_10_percent_of_the_step_windows_max_allocated(tmp_path, recompute):
    """gpt2 on one GPU: the planner's one predicted peak against the most the allocator held in any step (reset
    before each), the reserve reported beside it, and the SDPA kernel the run recorded."""
    run_dir = tmp_path / "run"
    train_on_cuda(run_dir, *GPT2_STEPS, f"+recompute={recompute}", env=cuda_env(tmp_path))
    s = summary(run_dir)
    (predicted,), (measured,), (reserved,) = (
        s["predicted_peak_bytes_per_stage"],
        s["peak_memory_bytes_per_stage"],
        s["peak_reserved_bytes_per_stage"],
    )
    assert s["peak_memory_kind"] == "cuda_max_allocated_per_step"
    assert abs(measured - predicted) <= 0.10 * measured, (predicted, measured)
    assert reserved >= measured
    assert s["sdpa_backend"] in ("flash", "efficient")


TINY_CUDA = ["model=tiny", "data=synthetic", "model.attention=math", "train.precision=fp32", "logger=none"]
TINY_CUDA += ["train.steps=6", "train.save_every=2", "train.micro_batches=2", "train.trace_step=0"]


@pytest.mark.multiproc
def test_a_run_resumed_on_cuda_repeats_the_uninterrupted_losses(tmp_path):
    """fp32, math attention: a run failing at step 5 resumes from its step-4 checkpoint (the CUDA RNG state of its
    own device with it) and gives the uninterrupted run's losses for steps 5 and 6."""
    reference, resumed = tmp_path / "reference", tmp_path / "resumed"
    train_on_cuda(reference, *TINY_CUDA, env=cuda_env(tmp_path))
    failed = train_on_cuda(resumed, *TINY_CUDA, env=cuda_env(tmp_path, **{TEST_FAIL_ENV: "0:5"}), check=False)
    assert failed.returncode != 0
    train_on_cuda(resumed, *TINY_CUDA, env=cuda_env(tmp_path))
    losses = [row["loss"] for row in metrics(reference)]
    assert [row["loss"] for row in metrics(resumed)][-2:] == losses[-2:]


@pytest.mark.multiproc
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two visible GPUs")
def test_a_resume_under_another_device_visibility_finds_its_rng_state(tmp_path):
    """Saved with GPUs 0 and 1 visible (the rank on cuda:0), resumed with only GPU 1 visible (its cuda:0): one
    device's RNG state, restored on the rank's own device."""
    reference, resumed = tmp_path / "reference", tmp_path / "resumed"
    train_on_cuda(reference, *TINY_CUDA, env=cuda_env(tmp_path, CUDA_VISIBLE_DEVICES="0,1"))
    failing = cuda_env(tmp_path, CUDA_VISIBLE_DEVICES="0,1", **{TEST_FAIL_ENV: "0:5"})
    assert train_on_cuda(resumed, *TINY_CUDA, env=failing, check=False).returncode != 0
    train_on_cuda(resumed, *TINY_CUDA, env=cuda_env(tmp_path, CUDA_VISIBLE_DEVICES="1"))
    assert [row["loss"] for row in metrics(resumed)][-2:] == [row["loss"] for row in metrics(reference)][-2:]


@pytest.mark.multiproc
def test_an_fp16_loss_scale_overflow_skips_the_step_and_the_run_goes_on(tmp_path):
    """A real overflow (tests/fixtures/gpu_fp16_overflow.py: one gradient scaled past fp16's range in the first
    step): DeepSpeed skips that update and halves its loss scale; the loss stays finite, the step is no fault, and
    the next step applies."""
    out = tmp_path / "overflow.json"
    script = REPO / "tests" / "fixtures" / "gpu_fp16_overflow.py"
    env = cuda_env(tmp_path, PYTHONPATH=str(REPO))
    result = subprocess.run([sys.executable, str(script), str(out)], cwd=REPO, env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-5000:]
    steps = json.loads(out.read_text())
    assert [s["applied"] for s in steps] == [False, True]
    assert [s["fault"] for s in steps] == [False, False]
    assert steps[0]["grad_norm"] is None or steps[0]["grad_norm"] == float("inf")
    assert steps[1]["loss_scale"] < steps[0]["loss_scale_before"]
