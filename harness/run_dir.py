"""The run directory: one per launch, agreed on by every rank without talking to each other.

Hydra computes `hydra.run.dir` separately in every process, so the stamp must come from something
all ranks of one launch share: the SLURM job id (a requeued job finds its own run again), else the
launcher process (deepspeed, torchrun) that started all local ranks, else this process.
"""

import os
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from omegaconf import OmegaConf

# Files whose presence means the directory already holds a run that must not be overwritten.
RUN_OUTPUTS = ("metrics.jsonl", "summary.json", "checkpoints")
# What an earlier attempt wrote that a new start would write again: set aside, under ATTEMPTS/N/, when
# train.resume=auto finds no complete checkpoint to continue (its W&B files have names of their own).
ATTEMPT_OUTPUTS = (*RUN_OUTPUTS, "resumes.jsonl", "config.yaml", "plan.json", "trace.json", "timeline.png")
ATTEMPTS = "earlier_attempts"


def _start_time(pid: int) -> float:
    """Wall-clock start time of a process, from /proc (Linux)."""
    ticks = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
    boot = next(
        int(line.split()[1]) for line in Path("/proc/stat").read_text().splitlines() if line.startswith("btime")
    )
    return boot + ticks / os.sysconf("SC_CLK_TCK")


def run_stamp(environ: Mapping[str, str] = os.environ) -> str:
    if "SLURM_JOB_ID" in environ:
        job = environ.get("SLURM_ARRAY_JOB_ID", environ["SLURM_JOB_ID"])
        task = environ.get("SLURM_ARRAY_TASK_ID")
        return f"slurm-{job}" + (f"_{task}" if task else "")
    # deepspeed and torchrun set LOCAL_RANK in the ranks they start; their parent is the launcher.
    pid = os.getppid() if "LOCAL_RANK" in environ else os.getpid()
    try:
        started = _start_time(pid)
    except (OSError, ValueError, IndexError):
        started = time.time()
    return time.strftime("%Y-%m-%d_%H-%M-%S", time.localtime(started)) + f"-{pid}"


def register_run_stamp_resolver() -> None:
    """`${stagecheck_stamp:}` (a sweep's directory) and `${stagecheck_run_name:NAME}` (a run's: NAME, the
    train.run_name, else the stamp)."""
    if not OmegaConf.has_resolver("stagecheck_stamp"):
        OmegaConf.register_new_resolver("stagecheck_stamp", lambda: run_stamp(), use_cache=True)
    if not OmegaConf.has_resolver("stagecheck_run_name"):
        OmegaConf.register_new_resolver(
            "stagecheck_run_name", lambda name: run_stamp() if name is None else str(name), use_cache=True
        )


def run_outputs(run_dir: Path) -> list[str]:
    """The outputs of a run that `run_dir` already holds."""
    return [name for name in RUN_OUTPUTS if (run_dir / name).exists()]


def starts_again(resume: str, overwrite: bool, resuming: bool, run_dir: Path) -> bool:
    """Whether this launch starts the run in `run_dir` again, its earlier attempt set aside: train.resume=auto
    found no complete checkpoint there (killed before its first one), yet the directory holds outputs. Refusing
    would refuse every relaunch (a requeued job) for good; train.overwrite=true deletes them instead."""
    return resume == "auto" and not resuming and not overwrite and bool(run_outputs(run_dir))


def set_aside_earlier_attempt(run_dir: Path) -> Path:
    """Move what the earlier attempt wrote to <run dir>/earlier_attempts/N/ (N = 1, 2, ...); returns that folder."""
    root = run_dir / ATTEMPTS
    number = 1 + sum(1 for child in root.iterdir() if child.name.isdigit()) if root.is_dir() else 1
    folder = root / str(number)
    folder.mkdir(parents=True)
    for name in ATTEMPT_OUTPUTS:
        if (run_dir / name).exists():
            (run_dir / name).rename(folder / name)
    return folder


def check_run_dir(run_dir: Path, continuing: bool = False, overwrite: bool = False) -> None:
    """Refuse a directory that already holds a run's outputs, or that cannot be written. `continuing`:
    this launch resumes that run from one of its own checkpoints, or starts it again (`starts_again`);
    `overwrite` (train.overwrite): it may delete them and start over."""
    existing = run_outputs(run_dir)
    if existing and not (continuing or overwrite):
        raise ValueError(
            f"hydra.run.dir={str(run_dir)!r} already holds a run ({', '.join(existing)}) that this launch does "
            f"not continue: choose a new hydra.run.dir (or leave it unset for a fresh one), continue it with "
            f"train.resume=auto (from its latest checkpoint; without one it starts again, keeping the earlier "
            f"attempt's files in {ATTEMPTS}/), or delete its outputs and start over with train.overwrite=true"
        )
    if not os.access(run_dir, os.W_OK):
        raise ValueError(f"hydra.run.dir={str(run_dir)!r} is not writable: choose a writable hydra.run.dir")


DIRECTORY_OVERRIDES = ("hydra.run.dir", "hydra.sweep.dir")


def check_directory_overrides(overrides: Sequence[str]) -> None:
    """Refuse a hydra.run.dir or hydra.sweep.dir that names a file, or a path under one: Hydra would end in a
    FileExistsError (or NotADirectoryError) traceback when it makes the directory, before any of our code runs.
    Read from the command line before Hydra parses it; a value with an interpolation is left to Hydra."""
    for override in overrides:
        key, assigned, value = override.lstrip("+").partition("=")
        if not assigned or key not in DIRECTORY_OVERRIDES or "${" in value:
            continue
        if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":  # Hydra's quoted value
            value = value[1:-1]
        path = Path(value)
        existing = next((p for p in (path, *path.parents) if p.exists()), None)
        if existing is not None and not existing.is_dir():
            where = "is a file" if existing == path else f"is under {str(existing)!r}, which is a file"
            raise ValueError(f"{key}={value!r} {where}: choose a directory (or leave {key} unset)")


def remove_if_empty(run_dir: Path) -> None:
    """Undo Hydra's mkdir after a start-up error, so bad input leaves nothing behind."""
    try:
        run_dir.rmdir()
    except OSError:
        pass  # not empty (an earlier run's files: keep them) or already removed by another rank
