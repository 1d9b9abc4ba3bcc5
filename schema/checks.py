"""Start-up checks: typed conversion of the composed config and the checks that span groups.

Everything here runs before any process group or file exists, and raises ValueError with one
message that names the option to change and its allowed values.
"""

from collections.abc import Callable

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from data import check_data_files, check_vocab, data_has_val
from parallel.planning.compression import check_compress
from parallel.planning.config import AutoRecompute, NoRecompute
from parallel.planning.shapes import RunShape, Target, Topology
from parallel.runtime.compile_blocks import compile_refusal, compiled_auto
from parallel.runtime.dist_env import cuda_device_index
from schema.run import RunConfig
from schema.training import resolve_device


def to_run_config(cfg: DictConfig) -> RunConfig:
    """The composed config as typed dataclasses; each one's __post_init__ validates its fields."""
    try:
        run = OmegaConf.to_object(cfg)
    except OmegaConfBaseException as error:
        # OmegaConf wraps the ValueError raised in __post_init__; keep only its message.
        cause = error.__cause__ or error
        raise ValueError(str(cause).split("\n    full_key:")[0]) from None
    if run.recompute is None:
        run.recompute = NoRecompute()
    refusal = compile_refusal(run.parallel.schedule, run.recompute) if run.train.compile else None
    if refusal:
        raise ValueError(refusal)
    if run.train.compile and isinstance(run.recompute, AutoRecompute):
        run.recompute = compiled_auto(run.recompute)
    k = getattr(run.recompute, "micro_batches", None)
    if k is not None and k > run.train.micro_batches:
        raise ValueError(
            f"recompute.micro_batches={k} exceeds train.micro_batches={run.train.micro_batches}: it must be from 1 "
            f"to {run.train.micro_batches}, or null (all)"
        )
    return run


def run_shape(run: RunConfig, world_size: int, cuda_available: bool) -> RunShape:
    """What the run is planned for: the process grid, device and precision, batch, ZeRO stage and clipping."""
    return RunShape(
        topology(run, world_size),
        target(run, cuda_available),
        run.train.micro_batches,
        run.train.micro_batch_size,
        run.parallel.zero_stage,
        run.train.grad_clip,
    )


def topology(run: RunConfig, world_size: int) -> Topology:
    p = run.parallel
    stages = p.pipeline_stages or (world_size // p.data_parallel_size if p.data_parallel_size else world_size)
    if stages == 0 or world_size % stages != 0:
        raise ValueError(
            f"parallel.pipeline_stages={stages} does not divide the world size {world_size}: "
            f"choose a divisor of {world_size} (world = stages x data-parallel)"
        )
    if p.data_parallel_size and stages * p.data_parallel_size != world_size:
        raise ValueError(
            f"parallel.data_parallel_size={p.data_parallel_size} x {stages} stages != the world size {world_size}: "
            f"set parallel.data_parallel_size={world_size // stages} or null"
        )
    if stages > run.model.n_layer:
        raise ValueError(
            f"parallel.pipeline_stages={stages} exceeds model.n_layer={run.model.n_layer}: "
            f"use at most {run.model.n_layer} stages, or more layers"
        )
    return Topology(stages, world_size // stages)


def target(run: RunConfig, cuda_available: bool) -> Target:
    """train.device and train.precision with `auto` resolved."""
    device = resolve_device(run.train.device, cuda_available, "train.device")
    precision = run.train.precision
    if precision == "auto":
        precision = "bf16" if device == "cuda" else "fp32"
    if precision == "fp16" and device == "cpu":
        raise ValueError("train.precision='fp16' needs train.device=cuda: on cpu use fp32 or bf16")
    check_compress(getattr(run.recompute, "compress", "none"), precision)
    return Target(device, precision)


def check_cuda_device(
    target: Target,
    precision_option: str,
    local_rank: int,
    local_ranks: int,
    visible: int,
    capability: Callable[[int], tuple[int, int]],
) -> None:
    """A CUDA run's own device: this rank must have a GPU of its own (parallel/runtime/dist_env.py's
    cuda_device_index: NCCL refuses two ranks on one), and bf16 needs a GPU of compute capability 8.0 or newer.
    `local_ranks`: the ranks on this node; `capability`: a visible GPU's index -> its (major, minor);
    `precision_option`: train.precision as set (auto resolves to bf16 on cuda)."""
    if target.device != "cuda":
        return
    device = cuda_device_index(visible, local_rank, local_ranks)
    if target.precision == "bf16" and tuple(capability(device)) < (8, 0):
        major, minor = capability(device)
        raise ValueError(
            f"train.precision={precision_option!r} means bf16, which this GPU (compute capability {major}.{minor}) "
            f"does not support (8.0 or newer does): set train.precision=fp16 or fp32"
        )


def check_data(run: RunConfig) -> None:
    run.data.validate()
    check_vocab(run.data, run.model.vocab_size)
    check_data_files(run.data, run.model.seq_len)  # too short for a window, ids the model cannot embed
    if run.train.eval_every and not data_has_val(run.data):
        raise ValueError(
            f"train.eval_every={run.train.eval_every} needs a held-out split, and this data has none: "
            f"set data.val_path=FILE (tokens of data.path's dtype), prepare the data with a validation split "
            f"(prepare_data.py val_fraction=...), or set train.eval_every=0"
        )
