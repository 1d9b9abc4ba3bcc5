"""Hydra's submitit SLURM launcher, waiting in a way that cannot hang on a failed multi-rank job.

    python train.py -m hydra/launcher=slurm +recompute=none,full,selective

`conf/hydra/launcher/slurm.yaml` selects the launcher class, hydra_plugins/stagecheck_launcher.py (Hydra
instantiates launchers only from the `hydra_plugins` namespace), with stagecheck's defaults: nodes, one
task per GPU, `srun --kill-on-bad-exit` through SLURM_KILL_BAD_EXIT. Each sweep combination is one element
of a SLURM job array; srun starts `nodes x tasks_per_node` tasks and every task unpickles the launcher and
runs train.py's task function as one rank (ranks from SLURM_PROCID/SLURM_NTASKS, MASTER_ADDR/PORT from the
node list and the job id: parallel/runtime/dist_env.py).

All ranks of a job agree on its directory, `<sweep dir>/<job num>`, and so do all jobs of a sweep: the
sweep dir `multirun/${stagecheck_stamp:}` is resolved once, by the launcher before submission, and the pickle each
job loads carries Hydra's singleton state (which includes OmegaConf's resolvers) and the config's resolver
cache, which `load_sweep_config` copies into the job's config; so a job does not compute its own
`slurm-<job id>` stamp. (Checked by tests/test_slurm_launch.py: three jobs, one sweep directory.)

What differs from hydra-submitit-launcher 1.2.0's SlurmLauncher is the wait. The plugin calls submitit's
`job.results()`, which learns that a job has ended from its result files or from `sacct`. A stagecheck rank
that fails ends its process at once with `os._exit(1)` (harness/faults.py, so that it can never hang in a
collective) and writes no result file; where `sacct` does not answer (no accounting database, as on the
test cluster of launch/local_slurm.sh) submitit then never sees the job end and the sweep waits forever.
Here the submitting process polls the result files and `squeue`: a job that has left the queue without a
result from every task is reported as failed, naming the job, its exit code and its ranks' messages,
RESULT_GRACE_S after it ended. The sweep waits for every job before reporting a failure, so no job is
left unwatched; a failed job then stops the sweep with that message (its `FAILED` file, from
sweep/job.py, is in its directory; `python report.py SWEEP_DIR` reports the jobs that finished).
"""

import getpass
import logging
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path

from hydra.core.utils import JobReturn, JobStatus
from omegaconf import OmegaConf, open_dict

from sweep.job import FAILED, finished_in

log = logging.getLogger(__name__)

RESULT_GRACE_S = 15.0
"""After a job has left the queue: how long its result files may take to appear (a shared file system)."""
POLL_MIN_S, POLL_MAX_S = 2.0, 30.0
"""`squeue` is asked every POLL_MIN_S at first, less often for long jobs (at most every POLL_MAX_S)."""


def _tasks(job) -> list:
    return [job.task(t) for t in range(job.num_tasks)]


def _has_results(job) -> bool:
    return all(task.paths.result_pickle.exists() for task in _tasks(job))


def queued_job_ids() -> set[str] | None:
    """This user's jobs that SLURM still lists (pending, running, completing, requeued), array elements one
    by one (`123_4`); None when squeue does not answer."""
    try:
        out = subprocess.run(
            ["squeue", "-h", "-r", "-o", "%i", "-u", getpass.getuser()], capture_output=True, text=True, timeout=60
        )
    except (OSError, subprocess.TimeoutExpired) as error:
        log.warning(f"squeue failed ({error}); still waiting")
        return None
    if out.returncode != 0:
        log.warning(f"squeue exited {out.returncode} ({out.stderr.strip()}); still waiting")
        return None
    return set(out.stdout.split())


def finished_jobs(
    config_loader, config, job_overrides: Sequence[Sequence[str]], first_idx: int, sweep_dir: Path
) -> dict[int, Path]:
    """The jobs of a sweep submitted again into its directory (to finish it) that already finished there with the
    same config: job number -> its directory. They are not submitted: their ranks would wait in the queue, start,
    and only then skip them (sweep/job.py). A sweep directory that holds no finished job is answered without
    composing any job's config (one composition per job: seconds for a large sweep's first submission)."""
    if not any(sweep_dir.rglob("summary.json")):
        return {}
    done = {}
    for idx, overrides in enumerate(job_overrides, start=first_idx):
        job_config = config_loader.load_sweep_config(config, list(overrides))
        with open_dict(job_config):
            job_config.hydra.job.num = idx
            run_dir = sweep_dir / str(job_config.hydra.sweep.subdir)
            del job_config["hydra"]  # what the task function is given, as Hydra's run_job passes it
        if finished_in(run_dir, job_config):
            done[idx] = run_dir
    return done


def skipped_return(overrides: Sequence[str], run_dir: Path) -> JobReturn:
    """A finished job's result when it is not submitted again: completed, as its ranks would have returned."""
    return JobReturn(
        overrides=list(overrides), status=JobStatus.COMPLETED, _return_value=None, working_dir=str(run_dir)
    )


def wait_until_ended(jobs: Sequence, clock=time.monotonic, sleep=time.sleep, queued=queued_job_ids) -> None:
    """Return once every job has a result file from each task, or has left SLURM's queue."""
    pending = list(jobs)
    start = clock()
    while pending:
        pending = [job for job in pending if not _has_results(job)]
        if pending:
            listed = queued()
            if listed is not None:
                pending = [job for job in pending if job.job_id in listed]
        if pending:
            sleep(min(POLL_MAX_S, POLL_MIN_S + (clock() - start) / 20))


def final_state(job_id: str) -> str:
    """`STATE exit N` from accounting: `sacct`, else (not for array elements, which the job completion log
    does not tell apart) `sacct -c`; `unknown` when neither answers."""
    for extra in ([],) if "_" in job_id else ([], ["-c"]):
        try:
            out = subprocess.run(
                ["sacct", *extra, "-X", "-n", "-P", "-o", "JobID,State,ExitCode", "-j", job_id],
                capture_output=True,
                text=True,
                timeout=60,
            )
        except (OSError, subprocess.TimeoutExpired):
            continue
        rows = [line.split("|") for line in out.stdout.splitlines() if line.split("|")[0] == job_id]
        if out.returncode == 0 and rows and len(rows[-1]) >= 3:
            _, state, code = rows[-1][:3]
            return f"{state} exit {code.split(':')[0]}"
    return "state unknown"


def _messages(task) -> list[str]:
    """The rank's own messages (`stagecheck: ...`) from its error log, else the log's last lines."""
    try:
        lines = task.paths.stderr.read_text(errors="replace").splitlines()
    except OSError:
        return []
    ours = [line for line in lines if line.startswith("stagecheck:")]
    return ours[-3:] if ours else lines[-5:]


def job_return(job, idx: int, overrides: Sequence[str], clock=time.monotonic, sleep=time.sleep) -> JobReturn:
    """Task 0's JobReturn when every task returned; else a FAILED JobReturn whose error names the job."""
    deadline = clock() + RESULT_GRACE_S
    while not _has_results(job) and clock() < deadline:
        sleep(1.0)
    if _has_results(job):
        try:
            ret = job.results()[0]
        except Exception as error:  # noqa: BLE001 - a task raised inside the job (submitit re-raises it here)
            return JobReturn(overrides=list(overrides), status=JobStatus.FAILED, _return_value=error)
        # A job that failed at start-up (bad config) or stopped on a non-finite loss returns normally and
        # leaves a FAILED file in its directory (sweep/job.py); the sweep must not end with 0.
        job_dir = OmegaConf.select(ret.hydra_cfg, "hydra.runtime.output_dir") if ret.hydra_cfg is not None else None
        marker = Path(str(job_dir)) / FAILED if job_dir else None
        if ret.status == JobStatus.COMPLETED and marker is not None and marker.is_file():
            message = marker.read_text(errors="replace").strip()
            return JobReturn(
                overrides=list(overrides),
                status=JobStatus.FAILED,
                _return_value=RuntimeError(f"sweep job {idx} (SLURM job {job.job_id}) failed; {marker}:\n{message}"),
            )
        return ret
    missing = [task for task in _tasks(job) if not task.paths.result_pickle.exists()]
    lines = [
        f"sweep job {idx} (SLURM job {job.job_id}, {final_state(job.job_id)}): task(s) "
        f"{', '.join(str(t.task_id) for t in missing)} of {job.num_tasks} ended without a result"
    ]
    for task in missing:
        lines += [f"  task {task.task_id}: {line}" for line in _messages(task)]
    lines.append(f"  logs: {job.paths.folder}")
    return JobReturn(overrides=list(overrides), status=JobStatus.FAILED, _return_value=RuntimeError("\n".join(lines)))
