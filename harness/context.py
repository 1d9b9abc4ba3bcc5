"""The run as start-up validated it, in one frozen value that every part of a run takes (torchtitan's typed
trainer state): the typed config, where outputs go, this rank, and what the run is planned for."""

from dataclasses import dataclass, field
from pathlib import Path

from harness.job import JobHooks
from parallel.planning.shapes import RunShape, Target, Topology
from parallel.runtime.dist_env import DistEnv
from parallel.runtime.lr_schedule import CosineSegment
from schema.run import RunConfig


@dataclass(frozen=True)
class Resume:
    """A launch that continues from a checkpoint, as start-up checked it (harness/resume_check.py)."""

    checkpoint: Path
    step: int
    """The step the checkpoint was taken after."""
    in_place: bool
    """The checkpoint is this run directory's own (else: a new run from another run's weights)."""
    changed: dict[str, list] = field(default_factory=dict)
    """Options this launch changed, each [saved value, new value]: only those a resume may change."""
    lr_segment: CosineSegment | None = None
    """The learning-rate decay from here on (parallel/runtime/lr_schedule.py)."""
    saved_partition: list[int] | None = None
    """The checkpoint's stage boundaries (each stage's first layer, then one past the last); None: not recorded."""
    saved_schedule: str = "1f1b"
    """The schedule the checkpoint was trained with (parallel.schedule=auto's choice; older checkpoints: its
    config's parallel.schedule)."""


@dataclass(frozen=True)
class RunContext:
    run: RunConfig
    """The typed config (schema/run.py), validated."""
    resolved: dict
    """The same config as Hydra resolved it: config.yaml and W&B's run config."""
    run_dir: Path
    env: DistEnv
    """This rank and the rendezvous, from the launcher's variables."""
    shape: RunShape
    """Stages x data-parallel, device and precision, batch: what the layout is planned for."""
    job: JobHooks
    """A single run, or one job of a sweep."""
    resume: Resume | None = None
    """Where this launch continues from; None: a fresh start."""
    relaunch: str = ""
    """The command that continues this run, as typed, with its run directory (harness/relaunch.py)."""

    @property
    def topology(self) -> Topology:
        return self.shape.topology

    @property
    def target(self) -> Target:
        return self.shape.target
