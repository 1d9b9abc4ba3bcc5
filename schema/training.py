"""Schema of the `train` node: DeepSpeed's batch and optimizer settings (OptimConfig), then the run's own."""

import re
from dataclasses import dataclass, field

from parallel.planning.config import OptimConfig

PRECISIONS = ("auto", "fp32", "bf16", "fp16")
DEVICES = ("auto", "cpu", "cuda")
PRICES = ("measured", "curves", "corrected", "analytic")
"""train.prices: where the step time's prices come from (its docstring)."""
NAN_POLICIES = ("stop", "skip")
RESUME_OFF = ("false", "no", "off", "none", "")
DEFAULT_TRACE_STEP = 3
RUN_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]*")
"""train.run_name: one folder under outputs/, no path."""
"""Traced when train.trace_step is null: past the first steps' allocator and JIT warm-up."""


def resolve_device(device: str, cuda_available: bool, option: str) -> str:
    """`auto` is cuda when a CUDA device is visible, else cpu; `cuda` without one is refused, naming `option` (the
    option as the command spells it: train.device, or generate.py's device)."""
    if device == "auto":
        return "cuda" if cuda_available else "cpu"
    if device == "cuda" and not cuda_available:
        raise ValueError(f"{option}='cuda' but no CUDA device is visible: use {option}=cpu or {option}=auto")
    return device


def normalize_resume(value) -> str:
    """`train.resume` as auto, false, or a path (YAML/CLI `false` arrives as a bool or as 'False')."""
    text = "false" if value is None or value is False else str(value).strip()
    if text.lower() in RESUME_OFF:
        return "false"
    if text.lower() == "auto":
        return "auto"
    return text


@dataclass
class TrainConfig(OptimConfig):
    """The `train` node: DeepSpeed's batch and optimizer settings (OptimConfig, first), then the run's own."""

    precision: str = "auto"
    """fp32, bf16, fp16, or auto (bf16 on cuda, fp32 on cpu)."""
    device: str = "auto"
    """cpu, cuda, or auto (cuda when available)."""
    compile: bool = False
    """Compile each transformer block with torch.compile (inductor, fullgraph), as torchtitan does; the embeddings,
    the final norm and the loss stay eager. The plan counts what a compiled block keeps, measured at start-up by
    compiling one block at the run's shape per option the plan runs (every option auto weighs: six) (cached per
    shape, like the measured prices). Off by default on every device: on CPU compiling costs tens of seconds and ran
    slower than eager here, and on CUDA, where it usually pays, no compiled run was measured yet (docs/compile.md).
    Runs with 1f1b and +recompute=none, full, selective with core_attn, mlp_act and mlp, or auto (which then chooses
    among those, never nests, and takes recompute.early=null as false); other combinations are refused at start-up
    with the reason."""
    log_every: int = 1
    """Steps between progress lines (every step is written to metrics.jsonl and W&B)."""
    eval_every: int = 0
    """Steps between held-out evaluations (the data's val split, DeepSpeed's eval_batch across all stages);
    the last step is always evaluated when this is on; 0 turns evaluation off."""
    eval_batches: int = 8
    """Batches per evaluation, each train.micro_batches micro-batches per data-parallel rank, drawn from the
    val split by (seed, batch index) alone: every evaluation of a run sees the same tokens."""
    measure_step: int = 2
    """Step whose forward passes are metered for activation bytes per micro-batch (saved-tensor hooks
    cost Python calls per op, so only this one step); a resumed run meters its first step after it;
    0 disables the measurement."""
    gc_interval: int = 0
    """Python's garbage collector. Either way, once train.measure_step has been metered, what the run holds is frozen
    out of later collections, whose full scans paused one rank mid-step while the pipeline's other ranks waited (36 ms
    at a 0.22 s step in docs/step_time_benchmark.md). 0: the collector runs on its own thresholds; N >= 1: it runs only
    after every N-th step, on every rank at once (Megatron-LM's --manual-gc), and metrics.jsonl's gc_s says what it
    took."""
    trace_step: int | None = None
    """Step whose pipeline instructions every rank times (trace.json, timeline.png, the bubble fraction per
    stage in summary.json); null: step 3 (after warm-up), or the last step when train.steps < 3; 0 disables
    the trace. A resumed run that is past that step traces the step as far into its own launch (resumed after
    step 6 with the default: step 9), so its summary.json has the bubbles of what it trained."""
    peak_tflops: float | None = None
    """Peak dense TFLOP/s of one device at train.precision, for MFU and HFU; null looks the GPU up in
    parallel/planning/flops.py's PEAK_TFLOPS table (none on CPU or an unknown GPU: MFU is then not reported)."""
    device_profile: str = "auto"
    """The device profile whose measured costs price the plan (`python -m parallel.measurement.device_profile`
    writes one): auto, this device's cached profile when there is one (a missing, stale, damaged or foreign one
    is said and the analytic costs are used); analytic, the FLOP/byte model at realistic rates; or a profile's
    path (refused at start-up when it cannot price this run)."""
    prices: str = "measured"
    """What prices the plan's step time (auto's choices, balanced's boundaries, the schedule, plan.json's prediction):
    measured, the run's stage replayed in this process at its exact shape (one block per recompute option, the
    embedding and the head timed instruction by instruction, on local rank 0 before any process group, cached per
    shape and device under $STAGECHECK_PRICE_DIR, default ~/.cache/stagecheck/stage_prices; the other ranks read
    that file), used whenever this device can build the stage (fp32 on CPU, all ranks on one node), else curves;
    curves, train.device_profile's kernel curves (else analytic); corrected, those curves corrected by the other
    shapes measured on this device, never this run's own (how measured prices a shape this device cannot build; to
    check that pricing on a shape it can: docs/step_time_benchmark.md), in a dry run or a one-rank run only; analytic,
    FLOPs and bytes at realistic rates. Bytes (what fits) never depend on it."""
    device_memory_gb: float | None = None
    """Memory of one rank's device in GiB, for the dry run's per-stage verdict (fits, or over by how much); null:
    recompute.budget_gb under +recompute=auto, else an 80 GB H100 on cuda, or this machine's memory shared by the
    ranks on it on cpu."""
    save_every: int = 100
    """Steps between checkpoints in <run dir>/checkpoints/; 0 saves only at the end of the run and on
    preemption (a checkpoint is always written at the end)."""
    keep_checkpoints: int = 2
    """Complete checkpoints kept; older ones are deleted once a newer one is complete."""
    run_name: str | None = None
    """Names the run directory, outputs/<run_name> (unless hydra.run.dir is given; a sweep's jobs keep the sweep's
    directories), so that launching the same command again finds its run: with train.resume=auto it continues from
    the latest checkpoint. A plain name: letters, digits, `.`, `_`, `-`. null: outputs/<launch time>-<launcher pid>
    (or outputs/slurm-<job id>), new for every launch outside SLURM."""
    resume: str = "auto"
    """auto: continue from the latest complete checkpoint in the run directory (start fresh when it has
    none); a path (a checkpoint directory, or a `checkpoints/` directory holding `latest`): continue from
    that checkpoint; false: start over."""
    overwrite: bool = False
    """Allow starting over in a run directory that already holds a run (metrics.jsonl, summary.json,
    checkpoints/): those are deleted at start-up. Without it such a directory is refused."""
    collective_timeout_s: float = 600.0
    """Seconds any collective may wait for the other ranks before failing (process-group timeout). A rank
    that dies usually breaks its peers' connections at once; this bounds the wait when it hangs instead
    or its host vanishes. Must exceed the longest checkpoint save."""
    nan_policy: str = "stop"
    """What a non-finite loss or gradient norm does. stop: exit with code 3 without saving (the last good
    checkpoint stays the latest). skip: drop that step's update (weights and Adam state unchanged) and go
    on, up to train.nan_skip_limit skipped steps, then stop."""
    nan_skip_limit: int = 3
    """With train.nan_policy=skip: skipped steps allowed in one run (counted from this launch)."""
    inject_nan_at_steps: list[int] = field(default_factory=list)
    """Debug/test only: make the loss NaN at these steps (all micro-batches), to exercise
    train.nan_policy. Leave empty for real training."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.log_every <= 0:
            raise ValueError(f"train.log_every={self.log_every} is invalid: it must be a positive integer")
        if self.eval_every < 0:
            raise ValueError(f"train.eval_every={self.eval_every} is invalid: it must be steps >= 1, or 0 for no eval")
        if self.eval_batches < 1:
            raise ValueError(f"train.eval_batches={self.eval_batches} is invalid: it must be an integer >= 1")
        if self.precision not in PRECISIONS:
            raise ValueError(
                f"train.precision={self.precision!r} is unknown: allowed values are {', '.join(PRECISIONS)}"
            )
        if self.device not in DEVICES:
            raise ValueError(f"train.device={self.device!r} is unknown: allowed values are {', '.join(DEVICES)}")
        if self.prices not in PRICES:
            raise ValueError(f"train.prices={self.prices!r} is unknown: allowed values are {', '.join(PRICES)}")
        self.resume = normalize_resume(self.resume)
        if self.run_name is not None and not RUN_NAME.fullmatch(self.run_name):
            raise ValueError(
                f"train.run_name={self.run_name!r} is invalid: it must be a plain name of letters, digits, ., _ and - "
                f"(not starting with . or -), or null for a new directory per launch"
            )
        for name in ("save_every", "nan_skip_limit"):
            value = getattr(self, name)
            if value < 0:
                raise ValueError(f"train.{name}={value} is invalid: it must be an integer >= 0")
        if self.keep_checkpoints < 1:
            raise ValueError(f"train.keep_checkpoints={self.keep_checkpoints} is invalid: it must be >= 1")
        if self.collective_timeout_s <= 0:
            raise ValueError(
                f"train.collective_timeout_s={self.collective_timeout_s} is invalid: it must be > 0 (seconds)"
            )
        if self.nan_policy not in NAN_POLICIES:
            raise ValueError(
                f"train.nan_policy={self.nan_policy!r} is unknown: allowed values are {', '.join(NAN_POLICIES)}"
            )
        if self.measure_step < 0:
            raise ValueError(
                f"train.measure_step={self.measure_step} is invalid: it must be a step >= 1, or 0 to disable"
            )
        if self.gc_interval < 0:
            raise ValueError(
                f"train.gc_interval={self.gc_interval} is invalid: it must be steps >= 1, or 0 for Python's collector"
            )
        if self.trace_step is not None and not 0 <= self.trace_step <= self.steps:
            raise ValueError(
                f"train.trace_step={self.trace_step} is invalid: it must be a step in [1, train.steps={self.steps}], "
                f"0 to disable, or null for the default"
            )
        if self.device_memory_gb is not None and self.device_memory_gb <= 0:
            raise ValueError(
                f"train.device_memory_gb={self.device_memory_gb} is invalid: it must be > 0 (GiB per rank), or null"
            )
        if self.peak_tflops is not None and self.peak_tflops <= 0:
            raise ValueError(f"train.peak_tflops={self.peak_tflops} is invalid: it must be > 0 (TFLOP/s), or null")
        bad = [s for s in self.inject_nan_at_steps if s <= 0]
        if bad:
            raise ValueError(f"train.inject_nan_at_steps={list(self.inject_nan_at_steps)} is invalid: steps start at 1")

    @property
    def traced_step(self) -> int | None:
        """The step train.trace_step names (null: the default one), or None when tracing is off."""
        if self.trace_step is None:
            return min(DEFAULT_TRACE_STEP, self.steps)
        return self.trace_step or None
