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
import time
from functools import partial
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from torch.nn.attention import SDPBackend, sdpa_kernel

from harness.faults import TEST_FAIL_ENV
from model import Block, GPTConfig
from model.attention import AttentionCore
from model.llama_layers import LlamaBlock
from model.weight_grad import WeightGradStore, linear, split_backward
from parallel.measurement import profile_kernels
from parallel.measurement.device_profile import free_memory, size_grid
from parallel.measurement.local_stages import LocalPipeline
from parallel.measurement.sdpa_backend import BACKEND_OF_NODE, check_planned_backend
from parallel.measurement.step_clock import CudaEventClock
from parallel.measurement.trace import StepRecorder
from parallel.planning.config import FullRecompute, NoRecompute, SelectiveRecompute
from parallel.planning.layout import build_layout
from parallel.planning.memory_model import selective_combinations
from parallel.planning.run_plan import plan_run
from parallel.planning.shapes import RunShape, Shape, Target, Topology
from tests.fixtures.p2p_pair import batched_meets_unbatched
from tests.runs import REPO, cpu_env, free_port, launch, metrics, summary
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


def metered_on_cuda(cfg: GPTConfig, recompute, precision: str):
    """Every stage of a 2-stage layout in this process on the GPU, two micro-batches metered by each stage's
    saved-tensor meter; returns the pipeline and its plan."""
    run = RunShape(Topology(2), Target("cuda", precision), micro_batches=2, micro_batch_size=2)
    layout = build_layout(cfg, recompute, run, "type:Block", seed=0)
    plan = plan_run(cfg, recompute, layout, run)
    pipe = LocalPipeline(layout, precision)
    for stage in pipe.stages:
        stage.cuda()
    g = torch.Generator().manual_seed(0)
    tokens = (2, cfg.seq_len)
    batches = [tuple(torch.randint(0, cfg.vocab_size, tokens, generator=g).cuda() for _ in range(2)) for _ in range(2)]
    pipe.step(batches, measure=True)
    return pipe, plan


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
    pipe, plan = metered_on_cuda(cfg, recompute, precision)
    slack = RNG_BYTES_PER_BLOCK if attention == "sdpa" and dropout else 0
    for stage, planned, stage_range in zip(pipe.stages, plan.stages, pipe.layout.stages):
        blocks = sum(pipe.layout.recipes[i].module_class is Block for i in stage_range.layers)
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


# ---- the Llama family: grouped-query attention, the untied head ----------------------------------------------

SDPA_BACKENDS = {
    SDPBackend.FLASH_ATTENTION: "flash",
    SDPBackend.EFFICIENT_ATTENTION: "efficient",
    SDPBackend.CUDNN_ATTENTION: "cudnn",
    SDPBackend.MATH: "math",
}


def llama_gpu_config(**overrides) -> GPTConfig:
    """Grouped-query attention (8 query heads, 2 KV heads) at head size 64, which every fused kernel takes."""
    fields = dict(arch="llama", n_layer=4, n_head=8, n_kv_head=2, n_embd=512, intermediate_size=1376, seq_len=64)
    fields.update(vocab_size=256, activation="silu", bias=False, dropout=0.0, tie_embeddings=False)
    return GPTConfig(**{**fields, **overrides})


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("backend", list(SDPA_BACKENDS), ids=lambda b: SDPA_BACKENDS[b])
def test_llama_grouped_query_attention_through_each_sdpa_backend(backend, dtype):
    """Forced onto one SDPA kernel, grouped-query attention (enable_gqa) either refuses to run (flash takes no
    fp32) or runs that kernel and matches the explicit ops (KV heads repeated) within the dtype's rounding; and the
    plan of model.attention=sdpa takes the fused kernels' tensors and refuses cuDNN's and the math fallback's."""
    cfg = llama_gpu_config()
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 8, 64, 64, generator=gen).to("cuda", dtype).requires_grad_()  # (B, nh, T, hs)
    k, v = (torch.randn(2, 2, 64, 64, generator=gen).to("cuda", dtype).requires_grad_() for _ in range(2))
    grad = torch.randn(2, 8, 64, 64, generator=gen).to("cuda", dtype)
    reference = AttentionCore(GPTConfig(**{**vars(cfg), "attention": "math"})).cuda()
    expected = reference(q, k, v)
    expected_grads = torch.autograd.grad(expected, (q, k, v), grad)
    core = AttentionCore(cfg).cuda()
    name = SDPA_BACKENDS[backend]
    with sdpa_kernel([backend]):
        if name == "flash" and dtype == torch.float32:
            with pytest.raises(RuntimeError):
                core(q, k, v)
            return
        out = core(q, k, v)
    assert BACKEND_OF_NODE.get(out.grad_fn.name(), "math") == name
    tolerance = {"atol": 2e-2, "rtol": 2e-2} if dtype == torch.bfloat16 else {"atol": 1e-4, "rtol": 1e-4}
    torch.testing.assert_close(out, expected, **tolerance)
    for got, want in zip(torch.autograd.grad(out, (q, k, v), grad), expected_grads, strict=True):
        torch.testing.assert_close(got, want, **tolerance)
    shape, target = Shape.of(cfg, 2), Target("cuda", "bf16" if dtype == torch.bfloat16 else "fp32")
    if name in ("flash", "efficient"):
        check_planned_backend(name, shape, target)
    else:
        with pytest.raises(RuntimeError, match="Set model.attention=math"):
            check_planned_backend(name, shape, target)


@pytest.mark.parametrize(
    "attention, precision, tied", [("sdpa", "bf16", False), ("math", "fp32", False), ("sdpa", "bf16", True)], ids=str
)
@pytest.mark.parametrize("recompute", MODES, ids=mode_id)
def test_planned_llama_activation_bytes_equal_measured_on_cuda(recompute, attention, precision, tied):
    """The Llama family with grouped-query attention and its untied head (the last stage's own weight) on the GPU:
    the saved-tensor meter against the planner, per micro-batch, every stage in this process."""
    cfg = llama_gpu_config(attention=attention, tie_embeddings=tied)
    pipe, plan = metered_on_cuda(cfg, recompute, precision)
    for stage, planned in zip(pipe.stages, plan.stages):
        assert stage.meter.bytes_per_micro_batch() == [planned.activation_bytes_per_microbatch] * 2
        assert stage.meter.stage_input_bytes() == [planned.stage_input_bytes] * 2
    # A tied head runs as a function of its stage's embedding; an untied one is a module with a weight of its own.
    assert isinstance(pipe.stages[-1].funcs[-1], partial) is tied
    head = pipe.head_weight  # (V, C)
    assert head.is_cuda and head.grad is not None and torch.isfinite(head.grad).all()


def test_a_llama_blocks_forward_and_backward_make_the_host_wait_for_nothing():
    """The rotary angles cross to the GPU once per device (model/rotary.py): after a first step, a block's forward
    and backward (recompute included: it reruns the forward) queue kernels without a single synchronizing call."""
    cfg = llama_gpu_config()
    block = LlamaBlock(cfg, seed=0, layer_index=0).to("cuda", torch.bfloat16)
    x = torch.randn(2, 64, 512, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    block(x).sum().backward()  # builds the angle table: the one copy from the host
    torch.cuda.set_sync_debug_mode("error")
    try:
        block(x).sum().backward()
    finally:
        torch.cuda.set_sync_debug_mode(0)


# ---- the measurement machinery on CUDA ---------------------------------------------------------------------


def test_the_cuda_event_clock_times_the_queued_work_without_waiting_for_it():
    """An instruction's edges are events read after the step: the host leaves the instruction while its kernels
    still run, and the interval read afterwards spans them (parallel/measurement/step_clock.py)."""
    clock = CudaEventClock()
    recorder = StepRecorder(clock)
    clock.start()
    a = torch.randn(8192, 8192, device="cuda")

    def forward(engine, buffer_id):
        for _ in range(20):
            a @ a

    host = time.perf_counter()
    recorder.timed("ForwardPass", forward)(None, buffer_id=0)
    host = time.perf_counter() - host
    queued = torch.cuda.Event()
    queued.record()
    assert not queued.query()  # the device is still computing: no edge waited for it
    (interval,), recomputes, end_s = recorder.finish()
    assert recomputes == [] and 0 <= interval.start_s < interval.end_s <= end_s
    assert interval.duration_s > host


def test_each_profile_familys_largest_size_that_fits_stays_within_its_byte_bound():
    """parallel/measurement/profile_kernels.py's bounds against the allocator: one size built and every workload
    run once, at the largest size the free memory admits."""
    grid = size_grid("cuda", quick=False)
    for family in profile_kernels.families("cuda", torch.bfloat16, grid["points"], grid):
        torch.cuda.empty_cache()
        size = profile_kernels.sizes_that_fit(family, free_memory("cuda"))[-1]
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        workloads = family.build(size)
        for by_x in workloads.values():
            for run in by_x.values():
                run()
        torch.cuda.synchronize()
        held = torch.cuda.max_memory_allocated() - base
        del workloads
        assert 0 < held <= family.bytes_at(size), (family.name, size, held)


@pytest.mark.multiproc
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two visible GPUs")
def test_batched_sends_meet_unbatched_receives_over_nccl():
    """18 MiB messages sent batched and received unbatched, both ways, in a default group bound to each rank's GPU
    (parallel/runtime/dist_env.py's default_group_options): on one communicator they match instead of hanging."""
    mp.start_processes(batched_meets_unbatched, args=("cuda", free_port()), nprocs=2, join=True, start_method="spawn")


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
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two visible GPUs")
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_the_virtual_schedules_train_on_two_gpus_as_1f1b_does(tmp_path, precision):
    """Interleaved 1F1B, ZB-V and V-Half over NCCL (their boundary batches posted with batch_isend_irecv, each message
    waited for where it is read; on CPU only gloo has run them), 2 GPUs x 2 chunks, selective recompute with early
    recompute in bf16: each run's losses 1F1B's, to fp32's rounding with math attention (CUDA may pick other kernels
    for a chunk than for a stage), within bf16's epsilon in bf16 (docs/gpu.md's bound)."""
    tiny = ["model=tiny", "data=synthetic", "model.attention=math", f"train.precision={precision}", "logger=none"]
    tiny += ["train.steps=3", "train.micro_batches=4", "train.trace_step=0", "+recompute=selective"]
    tiny += [f"recompute.early={str(precision == 'bf16').lower()}"]
    losses = {}
    for schedule in ("1f1b", "interleaved-1f1b", "zb-v", "v-half"):
        run_dir = tmp_path / schedule
        launch(run_dir, *tiny, "train.device=cuda", f"parallel.schedule={schedule}", env=cuda_env(tmp_path))
        assert summary(run_dir)["schedule"] == schedule
        losses[schedule] = [row["loss"] for row in metrics(run_dir)]
    tolerance = 1e-5 if precision == "fp32" else 2**-8
    for schedule in ("interleaved-1f1b", "zb-v", "v-half"):
        assert losses[schedule] == pytest.approx(losses["1f1b"], rel=tolerance), schedule


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
def test_a_rank_bound_to_one_gpu_trains_on_it_whatever_its_local_rank(tmp_path):
    """srun --gpus-per-task=1 shows each task one GPU while SLURM_LOCALID runs on: start-up, the process group and
    DeepSpeed's engine all take the one visible GPU (parallel/runtime/dist_env.py's cuda_device_index)."""
    slurm = dict(SLURM_PROCID="0", SLURM_NTASKS="1", SLURM_LOCALID="5", MASTER_PORT=str(free_port()))
    run_dir = tmp_path / "run"
    steps = [*TINY_CUDA[:5], "train.steps=2", "train.save_every=0", "train.micro_batches=2", "train.trace_step=1"]
    train_on_cuda(run_dir, *steps, env=cuda_env(tmp_path, CUDA_VISIBLE_DEVICES="0", **slurm))
    assert len(metrics(run_dir)) == 2 and (run_dir / "trace.json").exists()


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
