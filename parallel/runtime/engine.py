"""Process group and DeepSpeed pipeline engine."""

import atexit
import io
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager, redirect_stdout
from datetime import timedelta
from functools import partial

import deepspeed
import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
import torch.nn as nn
from deepspeed.accelerator import get_accelerator
from deepspeed.ops.op_builder.cpu.comm import ShareMemCommBuilder
from deepspeed.runtime.fp16.fused_optimizer import FP16_Optimizer
from deepspeed.runtime.fp16.unfused_optimizer import FP16_UnfusedOptimizer
from deepspeed.utils import safe_set_full_fp32_param
from torch._utils import _flatten_dense_tensors

from parallel.planning.config import OptimConfig, ParallelConfig
from parallel.planning.layout import PipelineLayout
from parallel.runtime.accelerator import use_accelerator
from parallel.runtime.dist_env import DistEnv, cuda_device_index, default_group_options, export_dist_env
from parallel.runtime.ds_config import deepspeed_config
from parallel.runtime.lr_schedule import CosineSegment, warmup_cosine
from parallel.runtime.pipeline import RecomputingPipelineModule
from parallel.runtime.zero_bubble_engine import zero_bubble


def init_process_group(env: DistEnv, device: str, timeout_s: float) -> None:
    # Start-up chose the accelerator before loading this module; a process that loaded DeepSpeed for another
    # device (a script that skipped start-up) stops here rather than train on the wrong one.
    use_accelerator(device)
    cuda_device = None
    if device == "cuda":
        # Before anything touches CUDA (a collective before the engine exists would too): else every
        # rank of the node makes its context, and its NCCL communicators, on cuda:0.
        cuda_device = cuda_device_index(torch.cuda.device_count(), env.local_rank, env.local_world_size)
        torch.cuda.set_device(cuda_device)
    export_dist_env(env, cuda_device)
    _skip_shm_inference_allreduce()
    timeout = timedelta(seconds=timeout_s)
    if not dist.is_initialized():  # a sweep's jobs reuse the group
        dist.init_process_group(**default_group_options(device, env.world_size, cuda_device, timeout))
    # DeepSpeed adopts the group made above. auto_mpi_discovery=False: a missing variable must fail loudly, not
    # silently import mpi4py.
    deepspeed.init_distributed(
        dist_backend="gloo" if device == "cpu" else "nccl", auto_mpi_discovery=False, timeout=timeout
    )
    # Groups created later without a timeout (DeepSpeed's pipeline and data-parallel groups) would take
    # torch's default (30 min gloo, 10 min NCCL), so a hung peer would outlast train.collective_timeout_s.
    c10d.default_pg_timeout = timeout
    c10d.default_pg_nccl_timeout = timeout
    global _destroy_at_exit
    if not _destroy_at_exit:  # once per process (a sweep's jobs reuse the group)
        atexit.register(_destroy_process_group)
        _destroy_at_exit = True


_destroy_at_exit = False


def _skip_shm_inference_allreduce() -> None:
    """DeepSpeed's CPU backend JIT-builds `deepspeed_shm_comm` (about 25 s on a first run) and, when all
    ranks share a node, maps a 66 MB /dev/shm buffer per rank that it never unlinks. Only
    `inference_all_reduce` (tensor-parallel inference) uses it; training never does. Left on, every CPU
    launch leaked 132 MB of RAM (/dev/shm is memory) until a full test run filled the 24 GiB and the OOM
    killer ended it. Marking the op incompatible is the switch `build_shm_op` reads. Other accelerators
    have no such op (and reading the table would run DeepSpeed's compiler probes for nothing)."""
    if get_accelerator().device_name() != "cpu":
        return
    # Reading the table runs DeepSpeed's probe of every op (gcc builds of test programs, each printing its command
    # line: the aio probe's `gcc ... -laio`). Its one reader (deepspeed/comm/torch.py) asks for this op alone,
    # with a default of False, so a table of this op alone is the same answer without the probe.
    ops = vars(deepspeed.ops)
    if "__compatible_ops__" in ops:
        ops["__compatible_ops__"][ShareMemCommBuilder.NAME] = False
    else:
        ops["__compatible_ops__"] = {ShareMemCommBuilder.NAME: False}


def _destroy_process_group() -> None:
    """At a normal exit, and at the exits every rank agreed on (3, 75): destroy the process group while the
    interpreter is whole. Left to interpreter shutdown, gloo's threads can abort the process ("terminate
    called without an active exception", pytorch#190489): seen here once in ~15 two-node SLURM runs, rank 0
    exiting 134 after a finished run, which srun then reported as a failed job (still seen after this: train.py now
    also skips the C++ teardown, harness/process_exit.py). A failing rank ends with
    os._exit (harness/faults.py) and skips this, as it should: a destroy while peers may still be inside a
    collective can block (torchtitan#1342)."""
    if c10d.is_initialized():
        c10d.destroy_process_group()


def param_groups(module: nn.Module, weight_decay: float) -> list[dict]:
    """Decay matrices and embeddings; leave biases and LayerNorm gains alone (as GPT-2/nanoGPT)."""
    params = [p for p in module.parameters() if p.requires_grad]
    return [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]


InitialWeights = Callable[[RecomputingPipelineModule], dict[nn.Parameter, torch.Tensor]]
"""This stage's parameters -> their fp32 initial values, read for the built module."""


DEEPSPEED_START_UP_LINES = ("SEED_LAYERS=", "Using topology:")
"""What PipelineModule prints on rank 0 as it starts: its layer seeding (off: each layer seeds itself from the
model's seed) and the process grid (start-up's line gives stages x data-parallel)."""
DEEPSPEED_OPTIMIZER_LINES = (
    "begin bf16_optimizer",
    "before initializing group",
    "after initializing group",
    "end bf16_ optimizer",
    "MA ",
    "CPU Virtual Memory:",
)
"""What BF16_Optimizer prints on every rank as it is built: its memory at each of its steps (DeepSpeed forces it)."""


@contextmanager
def dropping_lines(prefixes: tuple[str, ...]) -> Iterator[None]:
    """This process's stdout with the lines that start with `prefixes` left out, for the block's duration."""
    captured = io.StringIO()
    try:
        with redirect_stdout(captured):
            yield
    finally:
        kept = [line for line in captured.getvalue().splitlines(keepends=True) if not line.startswith(prefixes)]
        sys.stdout.write("".join(kept))
        sys.stdout.flush()


def build_engine(
    layout: PipelineLayout,
    train: OptimConfig,
    parallel: ParallelConfig,
    data_parallel_size: int,
    precision: str,
    device: str,
    initial_weights: InitialWeights | None = None,
    lr_segment: CosineSegment | None = None,
    compile: bool = False,
):
    """The engine over this stage's layers; `initial_weights`, when given, supplies the fp32 value of every
    parameter of the built stage (model.init_from) instead of the seeded GPT-2 initialisation; `lr_segment`: the
    learning-rate decay of a resume that changed train.steps (parallel/runtime/lr_schedule.py); `compile`: train.compile
    (parallel/runtime/compile_blocks.py)."""
    with dropping_lines(DEEPSPEED_START_UP_LINES):
        module = RecomputingPipelineModule(
            layout.recipes, layout.stages, layout.plans, parallel.partition_method, compile=compile
        )
    counted_on_every_stage(module)
    weights = initial_weights(module) if initial_weights is not None else {}
    with torch.no_grad():
        for param, value in weights.items():
            param.copy_(value)
    params = sum(p.numel() for p in module.parameters())
    config = deepspeed_config(train, parallel, data_parallel_size, precision, device, params)
    with dropping_lines(DEEPSPEED_OPTIMIZER_LINES):
        engine, _, _, _ = deepspeed.initialize(
            model=module,
            model_parameters=param_groups(module, train.weight_decay),
            config=config,
            lr_scheduler=partial(warmup_cosine, train=train, segment=lr_segment),
        )
    _set_fp32_masters(engine.optimizer, weights)
    return zero_bubble(engine, layout)  # every schedule, 1f1b included, through the same engine class


def counted_on_every_stage(module: nn.Module) -> None:
    """Makes an fp32 run without ZeRO clip by the norm of every stage's gradients. DeepSpeed clips it with
    runtime/utils.py's clip_grad_norm_, which, given the pipeline's grid, adds a parameter's gradient norm only on the
    model-parallel group's rank 0 (the first stage) unless the parameter is marked model-parallel: the norm summed over
    the stages was the first stage's alone, so each run clipped by a fraction of its norm. Every parameter but a tied
    weight's later copies (`ds_pipe_replicated`, which ZeRO's and BF16_Optimizer's norms leave out too) is marked; the
    mark changes nothing else at tensor-parallel size 1 (DeepSpeed reads it where a tensor-parallel rank is above 0)."""
    for param in module.parameters():
        if not getattr(param, "ds_pipe_replicated", False):
            param.model_parallel = True


def _set_fp32_masters(optimizer, weights: dict[nn.Parameter, torch.Tensor]) -> None:
    """16-bit runs copy their fp32 master weights from the module after deepspeed.initialize cast it to 16
    bits, so loaded weights would lose their low bits for good: set the masters from the fp32 values. An fp32
    run's optimizer steps the module's own parameters, loaded above."""
    if not weights:
        return
    if isinstance(optimizer, FP16_Optimizer):  # fp16, fused Adam: one flat fp32 copy per param group
        for group, flat in zip(optimizer.fp16_groups, optimizer.fp32_groups_flat):
            flat.data.copy_(_flatten_dense_tensors([weights[param] for param in group]))
    elif isinstance(optimizer, FP16_UnfusedOptimizer):  # fp16, other optimizers: one fp32 copy per param
        for group, masters in zip(optimizer.fp16_groups, optimizer.fp32_groups):
            for param, master in zip(group, masters):
                master.data.copy_(weights[param])
    else:  # BF16_Optimizer and ZeRO 1/2 map each parameter to its fp32 fragment; a no-op without one
        for param, value in weights.items():
            safe_set_full_fp32_param(param, value)
