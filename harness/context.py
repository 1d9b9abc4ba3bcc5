"""The run as start-up validated it, in one frozen value that every part of a run takes (torchtitan's typed
trainer state): the typed config, where outputs go, this rank, and what the run is planned for."""

from dataclasses import dataclass
from pathlib import Path

from harness.job import JobHooks
from parallel.planning.shapes import RunShape, Target, Topology
from parallel.runtime.dist_env import DistEnv
from schema.run import RunConfig


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

    @property
    def topology(self) -> Topology:
        return self.shape.topology

    @property
    def target(self) -> Target:
        return self.shape.target
