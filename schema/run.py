"""The top-level run config, and the registration of every group's schema with Hydra.

Each group option's YAML starts from its schema (`defaults: [<option>_schema, _self_]`), so a typo
or a wrong type fails when Hydra composes the config, not at step 500.
"""

from dataclasses import dataclass, field
from typing import Any

from hydra.core.config_store import ConfigStore

from data import MemmapDataConfig, SyntheticDataConfig, TextDataConfig
from model import GPTConfig
from parallel.planning.config import (
    AutoRecompute,
    FullRecompute,
    GivenRecompute,
    NoRecompute,
    ParallelConfig,
    SelectiveRecompute,
)
from schema.logger import NoLoggerConfig, WandbLoggerConfig
from schema.training import TrainConfig

GROUP_SCHEMAS: dict[str, dict[str, type]] = {
    "data": {"synthetic": SyntheticDataConfig, "text": TextDataConfig, "memmap": MemmapDataConfig},
    "logger": {"wandb": WandbLoggerConfig, "none": NoLoggerConfig},
    "recompute": {
        "none": NoRecompute,
        "full": FullRecompute,
        "selective": SelectiveRecompute,
        "auto": AutoRecompute,
        "plan": GivenRecompute,
    },
}


@dataclass
class RunConfig:
    model: GPTConfig = field(default_factory=GPTConfig)
    """The GPT shape: a preset of conf/model/ (`model=NAME`), any of whose fields can be overridden."""
    train: TrainConfig = field(default_factory=TrainConfig)
    """Steps, batch shape, optimizer, precision, device, checkpoints and fault handling of the run."""
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """How the world is split into pipeline stages and data-parallel replicas, and ZeRO."""
    data: Any = None
    """One of the `data` group schemas."""
    logger: Any = None
    """One of the `logger` group schemas."""
    recompute: Any = None
    """One of the `recompute` group schemas; absent (no `+recompute=...`) means none."""
    seed: int = 1234
    """Seeds weights (per layer), dropout and data sampling."""
    dry_run: bool = False
    """Validate, plan and print the per-stage memory table without training."""
    round: int = 0
    """Which repetition of a sweep's setting this job is; training ignores it. `-m round=0,1,2 +recompute=none,full`
    runs every setting three times, the rounds one after another (Hydra varies the first option slowest), and the
    sweep report gives each setting's median throughput over its rounds and their spread (docs/sweeps.md)."""


def register_schemas() -> None:
    store = ConfigStore.instance()
    store.store(name="run_schema", node=RunConfig)
    for group, options in GROUP_SCHEMAS.items():
        for option, schema in options.items():
            store.store(group=group, name=f"{option}_schema", node=schema)
