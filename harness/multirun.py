"""Hydra multirun inside one launch: every rank runs the sweep's jobs one after another, in lockstep.

    deepspeed --num_gpus 2 train.py -m +recompute=none,full,selective
    deepspeed --num_gpus 2 train.py -m +sweep=recompute_modes model=tiny

Each rank runs Hydra's basic sweeper by itself. The jobs are the same on every rank and in the same order
(the sweeper expands the same overrides), and the sweep directory agrees because `${stagecheck_stamp:}` does
(harness/run_dir.py); each job's directory is `<sweep dir>/${hydra.job.num}` and holds what a single run's
does. Per job:

- the process group is made by the first job that trains and reused by the next ones:
  `deepspeed.init_distributed` skips initialisation when its backend is already up (so
  `train.collective_timeout_s` of the first training job holds for the whole sweep);
- the job builds a fresh engine; `on_job_end` collects the previous one (gc, glibc `malloc_trim`, CUDA
  cache) and warns if a DeepSpeed engine survives; `on_job_start` resets the peak-memory counters
  (`torch.cuda.reset_peak_memory_stats`, and peak RSS through `/proc/self/clear_refs`), so each job's
  `peak_memory_bytes_per_stage` is its own;
- a job that fails is marked by a `FAILED` file in its directory holding the message, and the sweep
  goes on where every rank can go on together (below). At the end, after a barrier, rank 0 writes the
  sweep's report (`report.md`, `report.png`, harness/sweep_report.py) and exits 0 when every job
  finished, else with the exit code of the first failed job (the other ranks exit 0, so that the
  launcher does not stop rank 0 while it writes the report; the launcher passes rank 0's code on).

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
  (`finished_earlier`), the failed job runs again (add `train.overwrite=true` if it left outputs and no
  checkpoint to resume from; its earlier FAILED is kept as FAILED.1), and the report covers every job.
"""
import ctypes
import gc
import os
import sys
import time
from pathlib import Path
from typing import Any, Callable, Optional

from hydra.core.hydra_config import HydraConfig
from hydra.experimental.callback import Callback
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from harness.faults import EXIT_CONFIG, EXIT_FAILED, EXIT_NONFINITE

FAILED = "FAILED"
"""A failed job's marker in its directory: one line per message (`stagecheck: ...`)."""


_failures: dict[int, int] = {}
"""This process's failed jobs of the current sweep: job number -> exit code."""


def in_multirun() -> bool:
    return HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN


def _job_num() -> int:
    return int(HydraConfig.get().job.num)


def _rank() -> int:
    """This process's global rank, read the way parallel/dist_env.py does, without raising."""
    for name in ("RANK", "SLURM_PROCID"):
        try:
            return int(os.environ[name])
        except (KeyError, ValueError):
            continue
    return 0


def mark_failed(run_dir: Path, message: str, code: int, write: bool = True) -> None:
    """Record job failure `code` for this process; with `write`, append `message` to <run_dir>/FAILED."""
    _failures.setdefault(_job_num(), code)
    if write:
        with open(run_dir / FAILED, "a") as f:  # one write per line: ranks appending never interleave
            f.write(message.rstrip("\n") + "\n")


RELAUNCH_KEYS = ("resume", "overwrite")
"""`train` keys that say how a launch treats existing outputs, not what a job computes."""


def _job_config(config: dict) -> dict:
    return {**config, "train": {k: v for k, v in config.get("train", {}).items() if k not in RELAUNCH_KEYS}}


def finished_earlier(run_dir: Path, cfg: DictConfig) -> bool:
    """A sweep relaunched into its own directory (the same `hydra.sweep.dir`) to finish what a failure
    ended: a job that already finished there with this config (summary.json, no FAILED, the same
    config.yaml but for RELAUNCH_KEYS) is skipped, so only the others run. Any other job there starts as
    in any run directory: train.resume=auto continues it from its checkpoint, else start-up refuses it.

    A job that did not finish keeps an earlier launch's FAILED as FAILED.<n>, moved by rank 0 before any
    rank can mark this launch's failure (those come after a collective, or from rank 0 itself). Where
    summary.json exists FAILED is left alone, so every rank takes the same decision here."""
    if not in_multirun():
        return False
    failed = run_dir / FAILED
    if (run_dir / "summary.json").is_file():
        if failed.exists() or not (run_dir / "config.yaml").is_file():
            return False
        if (_job_config(OmegaConf.to_container(OmegaConf.load(run_dir / "config.yaml")))
                == _job_config(OmegaConf.to_container(cfg, resolve=True))):
            if _rank() == 0:
                print(f"stagecheck: sweep job {_job_num()} already finished in {run_dir}: skipped", flush=True)
            return True
    elif failed.exists() and _rank() == 0:
        earlier = next(run_dir / f"{FAILED}.{n}" for n in range(1, 10**6) if not (run_dir / f"{FAILED}.{n}").exists())
        failed.rename(earlier)
    return False


def startup_failed(run_dir: Path, message: str) -> bool:
    """Start-up rejected this job's config. In a multirun: mark the job (rank 0 writes, every rank failed
    the same way) and return True, so the caller returns and the sweep goes on. Otherwise False."""
    if not in_multirun():
        return False
    mark_failed(run_dir, message, EXIT_CONFIG, write=_rank() == 0)
    if _rank() == 0:
        print(f"stagecheck: sweep job {_job_num()} failed at start-up; marked {run_dir / FAILED}; going on",
              file=sys.stderr, flush=True)
    return True


def guard_job(run_dir: Path, rank: int, body: Callable[[], None]) -> Callable[[], None]:
    """`body` for harness/faults.run_guarded: unchanged in a single run; in a multirun, a non-finite stop
    (agreed by all ranks) marks the job and returns, anything else marks the job and propagates."""
    if not in_multirun():
        return body

    def job() -> None:
        try:
            body()
        except SystemExit as stop:
            code = stop.code if isinstance(stop.code, int) else EXIT_FAILED
            if code == 0:
                return
            if code == EXIT_NONFINITE:
                mark_failed(run_dir, "stagecheck: non-finite loss or gradients: the job stopped with exit code 3 "
                                     "(train.nan_policy); see the log", code, write=rank == 0)
                return
            mark_failed(run_dir, f"stagecheck: rank {rank} stopped with exit code {code}; the sweep stopped here",
                        code)
            raise
        except BaseException as error:  # noqa: BLE001 - marked, then handed on to run_guarded
            mark_failed(run_dir, f"stagecheck: rank {rank} failed: {type(error).__name__}: {error}; "
                                 f"the sweep stopped here", EXIT_FAILED)
            raise

    return job


def sweep_wandb_fields(run_dir: Path, group: Optional[str]) -> dict:
    """W&B fields of a sweep's job: its group (logger.group when set, else the sweep directory's name for
    a Hydra multirun, `wandb-sweep-<id>` under a W&B agent) and a run name naming sweep and job."""
    if in_multirun():
        sweep = Path(HydraConfig.get().sweep.dir).name
        return {"group": group or sweep, "name": f"{sweep}-{run_dir.name}"}
    sweep_id = os.environ.get("WANDB_SWEEP_ID")
    if sweep_id:
        return {"group": group or f"wandb-sweep-{sweep_id}"}
    return {}


def reset_peak_memory() -> None:
    """Peak-memory counters restart for the next job: CUDA's, and on Linux the process's peak RSS
    (VmHWM, which getrusage's ru_maxrss follows) by writing 5 to /proc/self/clear_refs."""
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.reset_peak_memory_stats()
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass  # not Linux, or not permitted: the peak then covers the earlier jobs too


def _unpin_engines() -> None:
    """Break what keeps a finished DeepSpeed engine alive. Each forward registers a backward hook on its
    output tensors through DeepSpeed's OutputBackwardHookManager, whose callbacks are closures over the
    engine; the tensors stay referenced (pipe buffers, the loss) and, while the autograd graph also refers
    to them, torch does not show their hooks to Python's collector. So the cycle engine -> tensor -> hook
    -> engine is never collected: measured here, one engine with its module and optimizer was left per
    finished job. Dropping the managers' callbacks (every engine is finished when a job ends) cuts it."""
    manager_cls = getattr(sys.modules.get("deepspeed.runtime.utils"), "OutputBackwardHookManager", None)
    if manager_cls is None:
        return
    for obj in gc.get_objects():
        if issubclass(type(obj), manager_cls):
            obj.remove_hooks()
            obj.preprocess_once_fn = obj.preprocess_per_tensor_fn = None


def release_memory() -> int:
    """Free what finished jobs left: collect cycles (the engine, its optimizer and module), hand freed heap
    back to the OS, empty the CUDA cache. Returns how many DeepSpeed engines are still alive."""
    gc.collect()
    _unpin_engines()
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()
    engine_cls = getattr(sys.modules.get("deepspeed.runtime.engine"), "DeepSpeedEngine", None)
    if engine_cls is None:
        return 0
    # type(), not isinstance(): some tracked objects answer __class__ lookups with deprecation warnings.
    return sum(1 for obj in gc.get_objects() if issubclass(type(obj), engine_cls))


def _sweep_dir(config: DictConfig) -> Path:
    return Path(str(config.hydra.sweep.dir))


class SweepCallback(Callback):
    """Registered in conf/config.yaml (`hydra.callbacks`); does nothing outside a multirun."""

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        _failures.clear()
        self.started = time.time()

    def on_job_start(self, config: DictConfig, **kwargs: Any) -> None:
        if in_multirun():
            reset_peak_memory()

    def on_job_end(self, config: DictConfig, job_return: Any = None, **kwargs: Any) -> None:
        if not in_multirun():
            return
        if job_return is not None and getattr(job_return.status, "name", "") == "FAILED":
            # An exception outside training (training's own end the process): every rank saw the same.
            error = job_return._return_value
            mark_failed(Path(config.hydra.runtime.output_dir), f"stagecheck: error: {type(error).__name__}: {error}",
                        EXIT_FAILED, write=_rank() == 0)
        alive = release_memory()
        if alive:
            print(f"stagecheck: warning: {alive} DeepSpeed engine(s) of finished sweep jobs are still referenced; "
                  f"their memory is not freed", file=sys.stderr, flush=True)

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            dist.barrier()  # every job's summary.json is written (by whichever rank held the loss)
        sweep_dir = _sweep_dir(config)
        if _rank() == 0:
            try:
                from harness.sweep_report import write_report

                write_report(sweep_dir, logger=config.get("logger"))
            except Exception as error:  # noqa: BLE001 - the jobs' outputs are there; the report can be redone
                print(f"stagecheck: warning: the sweep report failed ({type(error).__name__}: {error}); "
                      f"run `python report.py {sweep_dir}`", file=sys.stderr, flush=True)
        # Rank 0 alone carries the sweep's exit code: a launcher stops every rank when one exits non-zero,
        # and rank 0 may still be writing the report while the others are done.
        if _failures and _rank() == 0:
            failed = ", ".join(f"{num} (exit {code})" for num, code in sorted(_failures.items()))
            print(f"stagecheck: sweep {sweep_dir}: {len(_failures)} job(s) failed: {failed}; see FAILED in "
                  f"their directories", file=sys.stderr, flush=True)
            raise SystemExit(next(iter(_failures.values())))
