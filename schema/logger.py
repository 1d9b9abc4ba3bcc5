"""Schemas of the `logger` group: W&B (offline by default) or none."""

from dataclasses import dataclass, field

WANDB_MODES = ("offline", "online", "disabled")


@dataclass
class WandbLoggerConfig:
    name: str = "wandb"
    """Option of the `logger` config group; must stay "wandb"."""
    project: str = "stagecheck"
    """W&B project the runs are logged to."""
    entity: str | None = None
    """W&B entity (user or team) that owns the project; null: the logged-in user's default entity."""
    mode: str = "offline"
    """offline (default: no network, `wandb sync` later), online, or disabled."""
    group: str | None = None
    """W&B group; sweeps set it so their jobs appear together."""
    tags: list[str] = field(default_factory=list)
    """W&B tags of the run, besides the two stagecheck adds: the model shape (`model:<n_layer>L-<n_embd>h`)
    and the stage count (`stages:<n>`)."""
    init_timeout_s: float = 30.0
    """Online only: how long to wait for the W&B server before falling back to offline."""

    def __post_init__(self) -> None:
        if self.mode not in WANDB_MODES:
            raise ValueError(f"logger.mode={self.mode!r} is unknown: allowed values are {', '.join(WANDB_MODES)}")


@dataclass
class NoLoggerConfig:
    """Only metrics.jsonl and summary.json."""

    name: str = "none"
    """Option of the `logger` config group; must stay "none"."""
