"""Schemas of the `parallel` node, of the `recompute` group (one class per mode), and of the part of the
`train` node that DeepSpeed is configured with (`OptimConfig`, extended by schema/training.py's TrainConfig)."""

from dataclasses import dataclass, field

PARTITION_METHODS = ("balanced", "parameters", "uniform", "type:Block")
RECOMPUTE_MODULES = ("core_attn", "mlp_act", "layernorm", "mlp")
INTERVAL_WORDS = ("stage", "sqrt")
SCHEDULE_CHOICES = ("1f1b", "zb-h1", "auto", "interleaved-1f1b", "zb-v", "v-half")


@dataclass
class OptimConfig:
    """Batch shape, AdamW, learning-rate schedule and clipping: what parallel/runtime/ds_config.py and
    parallel/runtime/lr_schedule.py build DeepSpeed's engine from. The `train` node's schema extends it."""

    steps: int = 20
    """Optimizer steps (one pipeline batch each)."""
    micro_batches: int = 4
    """Micro-batches per step and data-parallel rank (gradient accumulation through the 1F1B schedule)."""
    micro_batch_size: int = 2
    """Sequences per micro-batch."""
    lr: float = 6e-4
    """Peak learning rate after warm-up."""
    min_lr_ratio: float = 0.1
    """Final learning rate of the cosine decay, as a fraction of `lr`."""
    warmup_steps: int = 2
    """Linear warm-up steps: step s (1-based) trains with lr * s / warmup_steps (parallel/runtime/lr_schedule.py)."""
    weight_decay: float = 0.1
    """AdamW decoupled weight decay, applied to weight matrices and embeddings only (not to biases or
    LayerNorm gains)."""
    beta1: float = 0.9
    """AdamW decay rate of the running mean of gradients (first moment)."""
    beta2: float = 0.95
    """AdamW decay rate of the running mean of squared gradients (second moment)."""
    eps: float = 1e-8
    """AdamW term added to the denominator (square root of the second moment), for numerical stability."""
    grad_clip: float = 1.0
    """Global gradient-norm clipping threshold; 0 disables it."""

    def __post_init__(self) -> None:
        for name in ("steps", "micro_batches", "micro_batch_size"):
            value = getattr(self, name)
            if value <= 0:
                raise ValueError(f"train.{name}={value} is invalid: it must be a positive integer")
        if self.warmup_steps < 0:
            raise ValueError(f"train.warmup_steps={self.warmup_steps} is invalid: it must be >= 0")
        if self.lr <= 0:
            raise ValueError(f"train.lr={self.lr} is invalid: it must be > 0")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ValueError(f"train.min_lr_ratio={self.min_lr_ratio} is invalid: it must be in [0, 1]")
        if self.grad_clip < 0:
            raise ValueError(f"train.grad_clip={self.grad_clip} is invalid: it must be >= 0 (0 disables it)")


@dataclass
class ParallelConfig:
    pipeline_stages: int | None = None
    """Pipeline stages; null means one stage per rank. The remaining factor of the world size is
    data parallelism (world = stages x data-parallel)."""
    data_parallel_size: int | None = None
    """Data-parallel replicas; null means world size / stages. Given, stages x data-parallel must equal
    the world size; a dry run (no launcher) plans for that many ranks."""
    partition_method: str = "balanced"
    """How the flat layer list is split into stages: `balanced` (every stage at least one block, chosen
    together with each stage's recompute plan to minimise the predicted step time, every stage within
    the budget of `recompute=auto`), or DeepSpeed's own `parameters` (balance parameter counts: the
    embeddings weigh like several blocks, so end stages may get no block), `uniform` (balance layer
    counts) or `type:Block` (balance transformer blocks)."""
    zero_stage: int = 0
    """ZeRO optimizer-state sharding over data-parallel ranks: 0 or 1 (pipelines forbid 2 and 3)."""
    schedule: str = "1f1b"
    """Pipeline schedule of a training step: `1f1b` (DeepSpeed's TrainSchedule), `zb-h1` (Zero Bubble H1: each
    backward split into the input gradient, sent upstream at once, and the weight gradient, deferred into the
    bubbles within 1F1B's activation memory), `interleaved-1f1b` (Megatron's interleaved 1F1B), `zb-v` (ZB-V) or
    `v-half` (V-Half), or `auto` (the planner picks the schedule with the shortest simulated step time: 1f1b, zb-h1
    and the three with virtual stages where the run can run them, under `+recompute=auto` each within the budget).
    Those three hold `parallel.chunks` model chunks per rank (docs/virtual_stages.md) and train through the virtual
    engine (parallel/runtime/virtual_engine.py): fp32 or bf16, with or without recompute.early; under
    `+recompute=auto` each rank's chunks are planned together against the rank's budget. A resume may change the
    schedule only among those that keep the layers on their ranks (1f1b and zb-h1; zb-v and v-half); `auto` keeps
    the checkpoint's."""
    chunks: int | None = None
    """Model chunks per rank under a schedule with virtual stages (Megatron's virtual pipeline size): 2 for zb-v and
    v-half (a V holds two), 2 or more for interleaved-1f1b (each more chunk divides 1F1B's bubble further and adds a
    boundary's sends to every micro-batch); null lets the planner choose interleaved-1f1b's from 2 to 4 (as the
    blocks allow) by simulated step time, under `parallel.schedule=auto` too. A resume keeps the checkpoint's."""

    def __post_init__(self) -> None:
        if self.pipeline_stages is not None and self.pipeline_stages <= 0:
            raise ValueError(
                f"parallel.pipeline_stages={self.pipeline_stages} is invalid: use a positive integer "
                f"that divides the world size, or null for one stage per rank"
            )
        if self.data_parallel_size is not None and self.data_parallel_size <= 0:
            raise ValueError(
                f"parallel.data_parallel_size={self.data_parallel_size} is invalid: use a positive integer, "
                f"or null for world size / stages"
            )
        if self.partition_method not in PARTITION_METHODS:
            raise ValueError(
                f"parallel.partition_method={self.partition_method!r} is unknown: allowed values are "
                f"{', '.join(PARTITION_METHODS)}"
            )
        if self.zero_stage not in (0, 1):
            raise ValueError(f"parallel.zero_stage={self.zero_stage} is invalid: pipeline parallelism allows 0 or 1")
        if self.schedule not in SCHEDULE_CHOICES:
            raise ValueError(
                f"parallel.schedule={self.schedule!r} is unknown: allowed values are {', '.join(SCHEDULE_CHOICES)}"
            )
        if self.chunks is not None:
            if self.chunks < 2:
                raise ValueError(
                    f"parallel.chunks={self.chunks} is invalid: use 2 or more chunks per rank, or null (the planner "
                    f"chooses)"
                )
            if self.schedule in ("1f1b", "zb-h1"):
                raise ValueError(
                    f"parallel.chunks={self.chunks} needs a schedule with virtual stages: use parallel.schedule="
                    f"interleaved-1f1b, zb-v, v-half or auto, or parallel.chunks=null"
                )
            if self.schedule in ("zb-v", "v-half") and self.chunks != 2:
                raise ValueError(
                    f"parallel.chunks={self.chunks} with parallel.schedule={self.schedule}: a V holds 2 chunks per "
                    f"rank; use parallel.chunks=2 or null, or parallel.schedule=interleaved-1f1b"
                )


COMPRESS_FORMATS = ("none", "bf16", "fp8", "int8")


def check_compress_name(compress: str) -> None:
    if compress not in COMPRESS_FORMATS:
        raise ValueError(
            f"recompute.compress={compress!r} is unknown: allowed values are {', '.join(COMPRESS_FORMATS)}"
        )


def check_micro_batches(value: int | None) -> None:
    """`recompute.micro_batches` on its own; schema/checks.py holds it to train.micro_batches."""
    if value is not None and value < 1:
        raise ValueError(
            f"recompute.micro_batches={value} is invalid: it must be from 1 to train.micro_batches, or null (all)"
        )


@dataclass
class NoRecompute:
    """Store every activation autograd saves."""

    mode: str = "none"
    """Option of the `recompute` config group (`+recompute=none`); must stay "none"."""
    early: bool = False
    """Present only so that `recompute.early=true` is refused with its reason: nothing is recomputed here."""

    def __post_init__(self) -> None:
        if self.early:
            raise ValueError(
                "recompute.early=true is invalid with +recompute=none: nothing is recomputed under "
                "+recompute=none; use full, selective or auto, or recompute.early=false"
            )


@dataclass
class PlannedRecompute:
    """What the modes with a fixed plan (full, selective) share: when the plan's recompute runs, and for which
    micro-batches."""

    early: bool = False
    """Run each micro-batch's recompute as its own pipeline instruction before the stage waits for that
    micro-batch's output gradient (RecvGrad), instead of inside its backward; the last stage never waits there
    and recomputes inside backward."""
    micro_batches: int | None = None
    """Recompute for only this many of each stage's in-flight micro-batches, those whose activations wait
    longest (parallel/planning/stage_plan.py's `StagePlan.recomputes_micro_batch` says which); the others run with no
    recompute. null: all of them. From 1 to train.micro_batches; a stage with fewer in flight recomputes all. Under a
    schedule with virtual stages, of the micro-batches each chunk holds in flight at once."""

    def __post_init__(self) -> None:
        check_micro_batches(self.micro_batches)


@dataclass
class FullRecompute(PlannedRecompute):
    """Store only segment inputs; recompute each segment's forward in backward. A stage whose predicted peak would not
    fall under it runs without recompute (under `stage`, a last stage holding one micro-batch remakes in its backward
    all that `none` keeps); the dry run's stage lines show it."""

    mode: str = "full"
    """Option of the `recompute` config group (`+recompute=full`); must stay "full"."""
    interval: str = "1"
    """Blocks per segment: a positive integer, `stage` (one segment per stage: the stage input the
    pipeline already holds is the only thing stored) or `sqrt` (about sqrt(blocks in the stage)).
    Segments start at each stage's first block and never cross a stage boundary."""
    nested: bool = False
    """Checkpoint each block again inside its segment (a recompute tree): a segment still keeps only its input per
    micro-batch, and its recompute in backward then keeps only its blocks' inputs, each block's interior being
    remade just before that block's backward. The backward holds one micro-batch's block inputs plus one block's
    working set instead of every block's activations, for one more forward of the segment. Exact, like every
    mode. Needs segments of more than one block (`recompute.interval` 2 or more, `stage` or `sqrt`)."""
    compress: str = "none"
    """Store what each segment keeps, its input (the stage's boundary input included), in fewer bits until its
    recompute: `none` (as it is), `bf16` (from an fp32 run: half the bytes), `fp8` (float8 e4m3 with one fp32 scale
    per token: a quarter of fp32's bytes, plus 4 bytes a token) or `int8` (the bytes of fp8, 255 even steps per token's
    range: its error is even across a token's values, fp8's proportional to each). LOSSY, so never on by default:
    the recompute and the backward run on the decompressed input, and the gradients are those of the decompressed
    input. plan.json, summary.json and the start-up print say so."""

    def __post_init__(self) -> None:
        super().__post_init__()
        self.interval = str(self.interval)
        if self.interval not in INTERVAL_WORDS and (not self.interval.isdigit() or int(self.interval) <= 0):
            raise ValueError(
                f"recompute.interval={self.interval!r} is invalid: allowed values are a positive "
                f"integer (blocks per segment), {' or '.join(INTERVAL_WORDS)}"
            )
        check_compress_name(self.compress)
        if self.nested and self.interval == "1":
            raise ValueError(
                "recompute.nested=true is invalid with recompute.interval=1: a one-block segment has nothing to nest; "
                "use recompute.interval=2 or more, stage or sqrt, or recompute.nested=false"
            )


@dataclass
class SelectiveRecompute(PlannedRecompute):
    """Recompute, inside each block, only what is cheap to redo but costly to store; not on a stage whose predicted
    peak would not fall under it."""

    mode: str = "selective"
    """Option of the `recompute` config group (`+recompute=selective`); must stay "selective"."""
    modules: list[str] = field(default_factory=lambda: ["core_attn"])
    """What to recompute: `core_attn` (softmax(QK^T)V with its dropout), `mlp_act` (the GELU output
    read by the second MLP matmul; under model.arch=llama the SwiGLU product read by the down projection),
    `layernorm` (the LayerNorm outputs read by the QKV and first MLP matmuls; under llama the two RMSNorm
    outputs, and with model.qk_norm (Qwen3) the q and k norms' fp32 rstd, made again from their kept input),
    `mlp` (the whole MLP with its dropout)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        unknown = [m for m in self.modules if m not in RECOMPUTE_MODULES]
        if unknown or not self.modules:
            raise ValueError(
                f"recompute.modules={list(self.modules)} is invalid: choose one or more of "
                f"{', '.join(RECOMPUTE_MODULES)}"
            )
        if "mlp" in self.modules and "mlp_act" in self.modules:
            raise ValueError(
                "recompute.modules lists both mlp and mlp_act: mlp already recomputes the activation, keep one of them"
            )


@dataclass
class AutoRecompute:
    """Choose, per stage and per block, the least recompute that fits a memory budget per GPU."""

    mode: str = "auto"
    """Option of the `recompute` config group (`+recompute=auto`); must stay "auto"."""
    budget_gb: float = 80.0
    """Memory one rank may use, in GiB (2^30 bytes), against the stage's predicted peak: parameters, gradients,
    optimizer state, DeepSpeed's buffers and the activations of every micro-batch in flight, plus the backward's
    working set."""
    reserve_gb: float = 2.0
    """Safety margin in GiB subtracted from the budget (allocator fragmentation, CUDA context, kernels'
    workspaces: what the planner does not model)."""
    early: bool | None = None
    """Run each micro-batch's recompute before the stage waits for its output gradient (see
    `+recompute=full`'s `recompute.early`); null: the planner chooses, per run, the setting with the shorter
    simulated step time within the budget (under a schedule with virtual stages, per rank: early where its chunks
    fit at no more recompute)."""
    per_micro_batch: bool = False
    """Also choose, per stage (per chunk under a schedule with virtual stages), for how many of its in-flight
    micro-batches the plan recomputes (the others run with no recompute; see `+recompute=full`'s
    `recompute.micro_batches`): the least recompute time per step that fits, plans between the all-micro-batch ones.
    Under virtual stages a chunk recomputes early only for all its micro-batches, so a rank weighs these where its
    chunks do not recompute early. Off: every micro-batch runs its stage's plan."""
    compress: str = "none"
    """Lossy storage auto may use: `none` (auto stays exact), `bf16`, `fp8` or `int8` (see `+recompute=full`'s
    `recompute.compress`). Allowed, it is one more choice per stage: a stage's full-recompute segments store their
    inputs in it wherever that lets the stage recompute less within the budget (its (de)compression is not priced;
    at equal cost exact storage wins). The run then says LOSSY, and on which stages, at start-up, in plan.json and
    summary.json."""

    def __post_init__(self) -> None:
        check_compress_name(self.compress)
        if self.budget_gb <= 0:
            raise ValueError(f"recompute.budget_gb={self.budget_gb} is invalid: it must be > 0 (GiB per GPU)")
        if not 0 <= self.reserve_gb < self.budget_gb:
            raise ValueError(
                f"recompute.reserve_gb={self.reserve_gb} is invalid: it must be >= 0 and below "
                f"recompute.budget_gb={self.budget_gb}"
            )


@dataclass
class GivenRecompute:
    """Run the per-stage plan a plan.json holds, as it is: each stage's layers and what each of its blocks recomputes
    (segments, nesting, compressed stashes, selective modules, per-micro-batch counts), as a dry run or an earlier run
    planned them, `+recompute=auto`'s included. Every rank then trains that plan whatever its own prices would choose
    (parallel/planning/given_plan.py). Exact, like every mode, unless the plan stores compressed stashes (the start-up
    print, plan.json and summary.json say so)."""

    mode: str = "plan"
    """Option of the `recompute` config group (`+recompute=plan`); must stay "plan"."""
    file: str = ""
    """The plan.json to run: the one `dry_run=true` writes to its run directory, or a run's own. Its stages set the
    stage boundaries (parallel.partition_method is not consulted) and must match parallel.pipeline_stages and the
    model's layers; plans with virtual stages cannot be given yet."""
    early: bool = False
    """Run each stage's recompute before it waits for the gradient (see `+recompute=full`'s `recompute.early`)."""

    def __post_init__(self) -> None:
        if not self.file:
            raise ValueError(
                "recompute.file is required with +recompute=plan: the plan.json of a dry run (dry_run=true) or of a run"
            )


RecomputeConfig = NoRecompute | FullRecompute | SelectiveRecompute | AutoRecompute | GivenRecompute
