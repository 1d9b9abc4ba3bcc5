"""One job of a Hydra multirun, as the run sees it: the `JobHooks` that mark a failed job, skip a finished one
when a sweep is relaunched into its own directory, and put the job in the sweep's W&B group.

    deepspeed --num_gpus 2 train.py -m +recompute=none,full,selective

What fails how (ranks must stay in lockstep: a rank that skips a collective its peers are in hangs them):

- bad configuration found at start-up (`stagecheck: error: ...`, exit code 2 in a single run): every rank
  validates the same config before any collective and fails identically. Rank 0 writes `FAILED`, every
  rank goes on with the next job.
- a composition error (a typo, a wrong type, an unknown option) in any combination: Hydra's sweeper
  composes every job before the first runs, so the whole sweep stops at once with Hydra's message and
  nothing runs.
- a non-finite loss or gradient under `train.nan_policy=stop` (exit 3): all ranks agree on it through
  the step's all-reduce (harness/run_control.py) and stop together; rank 0 marks the job and the sweep
  goes on.
- anything else inside training (an exception on one rank, a lost rank, preemption): the sweep ends as a
  single run would (harness/faults.py: the failing rank exits with code 1, its peers lose their
  connection and exit too; preemption saves a checkpoint and exits 75). Each failing rank appends its
  message to the job's `FAILED`; jobs already done keep their outputs; `python report.py SWEEP_DIR`
  reports them. Going on would need every peer to leave the collective it is blocked in and a fresh
  process group, which a gloo/NCCL group cannot do short of its timeout. To finish the sweep, relaunch
  the same command with `hydra.sweep.dir=<that sweep dir>`: jobs that finished there are skipped
  (`finished_earlier`), the failed job runs again (from its checkpoint, or from the start with the earlier
  attempt's files set aside where it left none; its earlier FAILED is kept as FAILED.1), and the report covers
  every job.
"""

import sys
from collections.abc import Callable
from pathlib import Path

from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from harness.faults import EXIT_CONFIG, EXIT_FAILED, EXIT_NONFINITE
from harness.job import JobHooks
from harness.resume_check import absolute_paths

FAILED = "FAILED"
"""A failed job's marker in its directory: one line per message (`stagecheck: ...`)."""
RELAUNCH_KEYS = ("resume", "overwrite")
"""`train` keys that say how a launch treats existing outputs, not what a job computes."""

failures: dict[int, int] = {}
"""This process's failed jobs of the current sweep: job number -> exit code (sweep/callback.py reads it)."""


def in_multirun() -> bool:
    return HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN


def job_hooks() -> JobHooks:
    """The hooks of the run Hydra is starting: a sweep's job under `-m`, else a single run."""
    return SweepJob() if in_multirun() else JobHooks()


def _job_num() -> int:
    return int(HydraConfig.get().job.num)


def mark_failed(run_dir: Path, message: str, code: int, write: bool = True) -> None:
    """Record job failure `code` for this process; with `write`, append `message` to <run_dir>/FAILED."""
    failures.setdefault(_job_num(), code)
    if write:
        with open(run_dir / FAILED, "a") as f:  # one write per line: ranks appending never interleave
            f.write(message.rstrip("\n") + "\n")


def _job_config(config: dict) -> dict:
    """A job's config as config.yaml records it (path options absolute: harness/resume_check.py), less RELAUNCH_KEYS."""
    config = absolute_paths(config)
    return {**config, "train": {k: v for k, v in config.get("train", {}).items() if k not in RELAUNCH_KEYS}}


def finished_in(run_dir: Path, cfg: DictConfig) -> bool:
    """Whether the job of config `cfg` (without its `hydra` node) already finished in `run_dir`: summary.json, no
    FAILED, and the same config.yaml but for RELAUNCH_KEYS."""
    if not (run_dir / "summary.json").is_file() or (run_dir / FAILED).exists():
        return False
    if not (run_dir / "config.yaml").is_file():
        return False
    recorded = OmegaConf.to_container(OmegaConf.load(run_dir / "config.yaml"))
    return _job_config(recorded) == _job_config(OmegaConf.to_container(cfg, resolve=True))


class SweepJob(JobHooks):
    @property
    def holds_partition(self) -> bool:
        return True  # jobs that differ only in recompute options train on one partition

    def finished_earlier(self, run_dir: Path, cfg: DictConfig, rank: int) -> bool:
        """A sweep relaunched into its own directory (the same `hydra.sweep.dir`) to finish what a failure
        ended: a job that already finished there with this config (summary.json, no FAILED, the same
        config.yaml but for RELAUNCH_KEYS) is skipped, so only the others run. Any other job there starts as
        in any run directory: train.resume=auto continues it from its checkpoint, else start-up refuses it.

        A job that did not finish keeps an earlier launch's FAILED as FAILED.<n>, moved by rank 0 before any
        rank can mark this launch's failure (those come after a collective, or from rank 0 itself). Where
        summary.json exists FAILED is left alone, so every rank takes the same decision here."""
        failed = run_dir / FAILED
        if (run_dir / "summary.json").is_file():
            if finished_in(run_dir, cfg):
                if rank == 0:
                    print(f"stagecheck: sweep job {_job_num()} already finished in {run_dir}: skipped", flush=True)
                return True
        elif failed.exists() and rank == 0:
            earlier = next(
                run_dir / f"{FAILED}.{n}" for n in range(1, 10**6) if not (run_dir / f"{FAILED}.{n}").exists()
            )
            failed.rename(earlier)
        return False

    def startup_failed(self, run_dir: Path, message: str, rank: int) -> bool:
        """Marks the job (rank 0 writes: every rank failed the same way); the sweep goes on."""
        mark_failed(run_dir, message, EXIT_CONFIG, write=rank == 0)
        if rank == 0:
            print(
                f"stagecheck: sweep job {_job_num()} failed at start-up; marked {run_dir / FAILED}; going on",
                file=sys.stderr,
                flush=True,
            )
        return True

    def guard(self, run_dir: Path, rank: int, body: Callable[[], None]) -> Callable[[], None]:
        """A non-finite stop (agreed by all ranks) marks the job and returns; anything else marks the job and
        propagates to harness/faults.run_guarded, which ends the process."""

        def job() -> None:
            try:
                body()
            except SystemExit as stop:
                code = stop.code if isinstance(stop.code, int) else EXIT_FAILED
                if code == 0:
                    return
                if code == EXIT_NONFINITE:
                    mark_failed(
                        run_dir,
                        "stagecheck: non-finite loss or gradients: the job stopped with exit code 3 "
                        "(train.nan_policy); see the log",
                        code,
                        write=rank == 0,
                    )
                    return
                mark_failed(
                    run_dir, f"stagecheck: rank {rank} stopped with exit code {code}; the sweep stopped here", code
                )
                raise
            except BaseException as error:  # noqa: BLE001 - marked, then handed on to run_guarded
                mark_failed(
                    run_dir,
                    f"stagecheck: rank {rank} failed: {type(error).__name__}: {error}; the sweep stopped here",
                    EXIT_FAILED,
                )
                raise

        return job

    def wandb_fields(self, run_dir: Path, group: str | None) -> dict:
        """The jobs of a sweep share a group (logger.group, else the sweep directory's name); each is named
        after sweep and job."""
        sweep = Path(HydraConfig.get().sweep.dir).name
        return {"group": group or sweep, "name": f"{sweep}-{run_dir.name}"}
