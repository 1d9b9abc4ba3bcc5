"""Schemas of the `train` node and of the `logger` group."""
from dataclasses import dataclass, field
from typing import Optional

PRECISIONS = ("auto", "fp32", "bf16", "fp16")
DEVICES = ("auto", "cpu", "cuda")
WANDB_MODES = ("offline", "online", "disabled")


@dataclass
class TrainConfig:
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
    """Linear warm-up steps from 0 to `lr`."""
    weight_decay: float = 0.1
    """AdamW decoupled weight decay, applied to weight matrices and embeddings only (not to biases or
    LayerNorm gains)."""
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0
    """Global gradient-norm clipping threshold; 0 disables it."""
    precision: str = "auto"
    """fp32, bf16, fp16, or auto (bf16 on cuda, fp32 on cpu)."""
    device: str = "auto"
    """cpu, cuda, or auto (cuda when available)."""
    log_every: int = 1
    """Steps between progress lines (every step is written to metrics.jsonl and W&B)."""

    def __post_init__(self) -> None:
        for name in ("steps", "micro_batches", "micro_batch_size", "log_every"):
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
        if self.precision not in PRECISIONS:
            raise ValueError(f"train.precision={self.precision!r} is unknown: allowed values are {', '.join(PRECISIONS)}")
        if self.device not in DEVICES:
            raise ValueError(f"train.device={self.device!r} is unknown: allowed values are {', '.join(DEVICES)}")


@dataclass
class WandbLoggerConfig:
    name: str = "wandb"
    project: str = "stagecheck"
    entity: Optional[str] = None
    mode: str = "offline"
    """offline (default: no network, `wandb sync` later), online, or disabled."""
    group: Optional[str] = None
    """W&B group; sweeps set it so their jobs appear together."""
    tags: list[str] = field(default_factory=list)
    init_timeout_s: float = 30.0
    """Online only: how long to wait for the W&B server before falling back to offline."""

    def __post_init__(self) -> None:
        if self.mode not in WANDB_MODES:
            raise ValueError(f"logger.mode={self.mode!r} is unknown: allowed values are {', '.join(WANDB_MODES)}")


@dataclass
class NoLoggerConfig:
    """Only metrics.jsonl and summary.json."""

    name: str = "none"
