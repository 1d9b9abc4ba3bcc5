"""SLURM launches against the real two-node Slurm of launch/local_slurm.sh (nodes n1, n2 on this machine).

- `sbatch --wait --nodes=2 launch/slurm.sbatch ...` (and the DeepSpeed-launcher variant): a 2-stage pipeline
  with one stage per node writes summary.json with world size 2; a rank that raises fails the job, no hang;
- `python train.py -m hydra/launcher=slurm +recompute=none,full,selective` (and the plugin's own
  `hydra/launcher=submitit_slurm`): three multi-rank jobs, three job directories in one sweep directory; with
  `slurm`, a failing rank fails the sweep instead of leaving it waiting;
- a job that gets its warning signal checkpoints, exits 75, is requeued and finishes (docs/preemption.md).

The failing rank is injected with STAGECHECK_TEST_FAIL=RANK:STEP (docs/preemption.md, "Test and debug hooks"),
which sbatch passes to the ranks like any other environment variable.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import pytest

from parallel.runtime.dist_env import first_host, read_dist_env, slurm_master_port
from sweep import slurm_launcher
from tests.runs import REPO, TINY, cpu_env

JOB_TIMEOUT_S = 420  # a requeue waits up to 120 s (cred_expire) before the job runs again
FAIL_WITHIN_S = 90
"""A failing rank must end the job this soon after submission (start-up here takes ~15-30 s on 2 loaded cores)."""
SWEEP_TIMEOUT_MIN = 10
"""hydra.launcher.timeout_min of the submitit sweeps: a sweep that waited on a failed job would wait this long."""
STAMP = "${stagecheck_stamp:}"
# One rank per node, on one core: the two test nodes share this machine's cores, and a rank runs as many intra-op
# threads as SLURM_CPUS_PER_TASK gives it (parallel/runtime/threads.py). No GPUs (the scripts ask for 8 per node).
TWO_NODES = ["--nodes=2", "--ntasks-per-node=1", "--cpus-per-task=1", "--gpus-per-node=0", "--time=10"]
SCRIPTS = ["slurm.sbatch", "slurm_deepspeed.sbatch"]
PREEMPTED_STEPS = 8


@dataclass
class Job:
    job_id: str
    returncode: int
    stderr: str
    log: str
    elapsed_s: float


def _env(cluster, tmp_path: Path, **extra: str) -> dict:
    # cpu_env drops inherited SLURM_* variables (rank discovery); the cluster's config path must stay.
    return cpu_env(tmp_path, SLURM_CONF=cluster.env["SLURM_CONF"], **extra)


@dataclass
class Submitted:
    proc: subprocess.Popen
    job_id: str
    log: Path
    started: float


def _submit(cluster, tmp_path: Path, script: str, *overrides: str, env: dict) -> Submitted:
    """`sbatch --wait` as a user types it, from the repository root, started in the background."""
    log = tmp_path / "job.out"
    cmd = [
        "sbatch",
        "--wait",
        "--parsable",
        *TWO_NODES,
        f"--output={log}",
        f"launch/{script}",
        *TINY,
        f"hydra.run.dir={tmp_path}/runs/{STAMP}",
        *overrides,
    ]
    start = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    job_id = proc.stdout.readline().strip().split(";")[0]  # sbatch prints the id at submission
    submitted = Submitted(proc, job_id, log, start)
    if not job_id.isdigit():
        _cancel(cluster, submitted)
        raise AssertionError(f"sbatch did not submit: {job_id!r} {proc.stderr.read()}")
    return submitted


def _cancel(cluster, submitted: Submitted) -> None:
    if submitted.job_id.isdigit():
        cluster.run(["scancel", submitted.job_id], timeout=30)
    submitted.proc.kill()


def _sbatch_wait_all(cluster, jobs: dict, while_running=None) -> dict[str, Job]:
    """Submit every job of `jobs` (key -> (tmp_path, script, overrides, env)) at once, so that their start-ups and
    waits overlap; `while_running(key, job_id)` runs for each once all are submitted. Each job's Job by key; every
    job is cancelled if the test gives up."""
    submitted: dict[str, Submitted] = {}
    try:
        for key, (tmp_path, script, overrides, env) in jobs.items():
            submitted[key] = _submit(cluster, tmp_path, script, *overrides, env=env)
        if while_running is not None:
            for key, job in submitted.items():
                while_running(key, job.job_id)
        finished = {}
        for key, job in submitted.items():
            _, err = job.proc.communicate(timeout=JOB_TIMEOUT_S)
            log = job.log.read_text() if job.log.exists() else ""
            finished[key] = Job(job.job_id, job.proc.returncode, err, log, time.monotonic() - job.started)
        return finished
    except BaseException:
        for job in submitted.values():
            _cancel(cluster, job)
        raise


def _why(job: Job, cluster) -> str:
    return f"sbatch exit {job.returncode}: {job.stderr}\n----- job log -----\n{job.log[-6000:]}\n{cluster.log_tail()}"


@pytest.fixture(scope="module")
def preempted_jobs(slurm_cluster, tmp_path_factory, submitit_sweeps) -> dict[str, tuple[Job, Path]]:
    """Each script's 2-stage job of PREEMPTED_STEPS steps, submitted together (their waits for the requeue
    overlap, and the submitit sweeps run meanwhile), preempted after its first step: it checkpoints, exits 75, is
    requeued and finishes. Per script: the job and its run directory."""
    dirs = {script: tmp_path_factory.mktemp("preempted") for script in SCRIPTS}

    def preempt_after_first_step(script: str, job_id: str) -> None:
        metrics = dirs[script] / "runs" / f"slurm-{job_id}" / "metrics.jsonl"
        deadline = time.monotonic() + JOB_TIMEOUT_S
        while not (metrics.exists() and metrics.read_text().strip()):
            assert time.monotonic() < deadline, "the job never logged a step"
            time.sleep(0.5)
        # What SLURM does at `--signal=B:USR1@120`: USR1 to the batch shell only, which forwards it. The requeued
        # job then waits out SLURM's credential lifetime (AuthInfo=cred_expire: 30 s in launch/local_slurm.sh's
        # cluster, 120 s by default) before it starts again; releasing it earlier would fail it.
        slurm_cluster.run(["scancel", "--signal=USR1", "--batch", job_id], timeout=30, check=True)

    jobs = {
        script: (dirs[script], script, [f"train.steps={PREEMPTED_STEPS}"], _env(slurm_cluster, dirs[script]))
        for script in SCRIPTS
    }
    finished = _sbatch_wait_all(slurm_cluster, jobs, while_running=preempt_after_first_step)
    return {script: (job, dirs[script] / "runs" / f"slurm-{job.job_id}") for script, job in finished.items()}


@pytest.mark.slurm
@pytest.mark.parametrize("script", SCRIPTS)
def test_two_stage_pipeline_runs_one_stage_per_node(slurm_cluster, preempted_jobs, script):
    """The preempted job's run (the same directory for both attempts, one stage per node) finished as a local
    run does."""
    job, run_dir = preempted_jobs[script]  # the job id names the run (harness/run_dir.py)
    assert job.returncode == 0, _why(job, slurm_cluster)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert (summary["world_size"], summary["pipeline_stages"], summary["data_parallel_size"]) == (2, 2, 1)
    assert summary["node_per_rank"] == ["n1", "n2"], summary["node_per_rank"]
    assert len(summary["losses"]) == PREEMPTED_STEPS
    # The same outputs as a local run.
    assert (run_dir / "config.yaml").is_file()
    assert len((run_dir / "metrics.jsonl").read_text().splitlines()) == PREEMPTED_STEPS
    assert list((run_dir / "wandb").glob("offline-run-*/run-*.wandb"))
    assert "rendezvous n1:" in job.log


@pytest.fixture(scope="module")
def failing_jobs(slurm_cluster, tmp_path_factory) -> dict[str, tuple[Job, Path]]:
    """Each script's job whose rank 1 (on n2) raises at step 2, submitted together."""
    dirs = {script: tmp_path_factory.mktemp("failing") for script in SCRIPTS}
    jobs = {
        script: (
            dirs[script],
            script,
            ["train.steps=20"],
            _env(slurm_cluster, dirs[script], STAGECHECK_TEST_FAIL="1:2"),
        )
        for script in SCRIPTS
    }
    finished = _sbatch_wait_all(slurm_cluster, jobs)
    return {script: (job, dirs[script]) for script, job in finished.items()}


@pytest.mark.slurm
@pytest.mark.parametrize("script", SCRIPTS)
def test_failing_rank_fails_the_job_without_hanging(slurm_cluster, failing_jobs, script):
    job, tmp_path = failing_jobs[script]
    assert job.returncode == 1, _why(job, slurm_cluster)
    assert job.elapsed_s < FAIL_WITHIN_S, f"the failed job took {job.elapsed_s:.0f} s\n{_why(job, slurm_cluster)}"
    assert "stagecheck: rank 1 failed: RuntimeError: injected failure at step 2" in job.log, _why(job, slurm_cluster)
    assert not (tmp_path / "runs" / f"slurm-{job.job_id}" / "summary.json").exists()
    # No requeue for a failure (only exit 75 is requeued).
    assert "restart 1" not in job.log and "requeueing" not in job.log


@pytest.mark.slurm
@pytest.mark.parametrize("script", SCRIPTS)
def test_preempted_job_checkpoints_requeues_and_finishes(slurm_cluster, preempted_jobs, script):
    job, run = preempted_jobs[script]  # the same directory for both attempts
    assert job.returncode == 0, _why(job, slurm_cluster)
    assert "exiting 75" in job.log and "requeueing job" in job.log, _why(job, slurm_cluster)
    assert f"job {job.job_id} (restart 1)" in job.log, _why(job, slurm_cluster)
    assert "stagecheck: resuming from" in job.log, _why(job, slurm_cluster)

    steps_logged = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps_logged == list(range(1, PREEMPTED_STEPS + 1))  # every step once: resumed after the checkpoint
    assert len(json.loads((run / "summary.json").read_text())["losses"]) == PREEMPTED_STEPS
    assert (run / "checkpoints" / "latest").read_text().strip() == f"step_{PREEMPTED_STEPS:08d}"


def _submitit_command(cluster, tmp_path: Path, *overrides: str, launcher: str = "slurm", sweep_dir: str = "") -> list:
    return [
        sys.executable,
        "train.py",
        "-m",
        f"hydra/launcher={launcher}",
        # The test cluster: 2 nodes, one task per node on one core (as TWO_NODES), no GPUs (conf/hydra/launcher/
        # slurm.yaml asks for 8).
        "hydra.launcher.nodes=2",
        "hydra.launcher.tasks_per_node=1",
        "hydra.launcher.cpus_per_task=1",
        "hydra.launcher.gpus_per_node=null",
        f"hydra.launcher.partition={cluster.partition}",
        f"hydra.launcher.timeout_min={SWEEP_TIMEOUT_MIN}",
        f"hydra.sweep.dir={sweep_dir or f'{tmp_path}/multirun/{STAMP}'}",
        *TINY,
        "train.steps=2",
        *overrides,
    ]


def _submitit_sweep(cluster, tmp_path: Path, *overrides: str, env: dict, sweep_dir: str) -> subprocess.CompletedProcess:
    cmd = _submitit_command(cluster, tmp_path, *overrides, sweep_dir=sweep_dir)
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=JOB_TIMEOUT_S * 2)


@dataclass
class Sweep:
    tmp_path: Path
    env: dict
    proc: subprocess.Popen
    started: float
    ended: list[float] = field(default_factory=list)
    """When the submitting command exited (set by its waiter thread)."""

    def result(self) -> subprocess.CompletedProcess:
        self.proc.wait(timeout=JOB_TIMEOUT_S * 2)
        output = [(self.tmp_path / name).read_text() for name in ("stdout", "stderr")]
        return subprocess.CompletedProcess(self.proc.args, self.proc.returncode, *output)

    @property
    def elapsed_s(self) -> float:
        """From the submitting command's start to its exit."""
        self.proc.wait(timeout=JOB_TIMEOUT_S * 2)
        while not self.ended:
            time.sleep(0.05)
        return self.ended[0] - self.started


SWEEPS = {
    "slurm": (["+recompute=none,full,selective"], {}, "slurm"),
    "submitit_slurm": (["+recompute=none,full,selective"], {}, "submitit_slurm"),
    "failing_rank": (["+recompute=none"], {"STAGECHECK_TEST_FAIL": "1:1"}, "slurm"),
    # pipeline_stages=3 does not divide the world size 2: every rank of job 1 rejects it at start-up
    # (harness/startup.py) and marks the job FAILED; job 0 trains.
    "rejected_job": (["parallel.pipeline_stages=2,3"], {}, "slurm"),
}


@pytest.fixture(scope="module")
def submitit_sweeps(slurm_cluster, tmp_path_factory) -> dict[str, Sweep]:
    """The sweeps of SWEEPS, each `python train.py -m hydra/launcher=...` as a user types it, all submitted at
    once and left running: their jobs queue and run side by side on the test cluster (with the preempted jobs,
    whose fixture asks for this one first), so that their waits overlap. A test reads its sweep's result."""
    running = {}
    try:
        for key, (overrides, extra_env, launcher) in SWEEPS.items():
            tmp_path = tmp_path_factory.mktemp(key)
            env = _env(slurm_cluster, tmp_path, **extra_env)
            cmd = _submitit_command(slurm_cluster, tmp_path, *overrides, launcher=launcher)
            with open(tmp_path / "stdout", "w") as out, open(tmp_path / "stderr", "w") as err:
                proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=out, stderr=err, text=True)
            sweep = running[key] = Sweep(tmp_path, env, proc, time.monotonic())
            threading.Thread(
                target=lambda s=sweep: (s.proc.wait(), s.ended.append(time.monotonic())), daemon=True
            ).start()
        yield running
    finally:
        for sweep in running.values():
            sweep.proc.kill()


# `slurm`: stagecheck's launcher; `submitit_slurm`: hydra-submitit-launcher's own, unchanged, the command as
# issue 5 words it (it polls sacct, which fails here without accounting: harmless while every job succeeds).
@pytest.mark.slurm
@pytest.mark.parametrize("launcher", ["slurm", "submitit_slurm"])
def test_submitit_sweep_runs_three_multi_rank_jobs(slurm_cluster, submitit_sweeps, launcher):
    sweep_run = submitit_sweeps[launcher]
    result, tmp_path = sweep_run.result(), sweep_run.tmp_path
    assert result.returncode == 0, f"{result.stdout[-3000:]}\n{result.stderr[-6000:]}"
    if launcher == "slurm":
        assert "sacct" not in result.stderr  # never asked (it fails without an accounting database)

    sweeps = list((tmp_path / "multirun").iterdir())
    assert len(sweeps) == 1, sweeps  # the submitting process and every rank of every job agree on the stamp
    sweep = sweeps[0]
    assert sorted(p.name for p in sweep.iterdir() if p.is_dir() and p.name.isdigit()) == ["0", "1", "2"]
    for num, mode in enumerate(["none", "full", "selective"]):
        job_dir = sweep / str(num)
        summary = json.loads((job_dir / "summary.json").read_text())
        assert (summary["recompute"], summary["world_size"], summary["pipeline_stages"]) == (mode, 2, 2)
        assert summary["node_per_rank"] == ["n1", "n2"]
        assert (job_dir / "config.yaml").is_file() and (job_dir / "metrics.jsonl").is_file()
        assert list((job_dir / "wandb").glob("offline-run-*/run-*.wandb"))
    assert (sweep / "report.md").is_file()  # the sweep's end (sweep/callback.py) ran in the submitting process

    if launcher == "slurm":  # submitted again into its directory (to finish a sweep), finished jobs are not submitted
        done = {num: (sweep / str(num) / "summary.json").stat().st_mtime_ns for num in range(3)}
        (sweep / "report.md").unlink()
        again = _submitit_sweep(
            slurm_cluster, tmp_path, "+recompute=none,full,selective", env=sweep_run.env, sweep_dir=str(sweep)
        )
        assert again.returncode == 0, f"{again.stdout[-3000:]}\n{again.stderr[-6000:]}"
        said = again.stdout + again.stderr
        assert all(f"#{num} : already finished in {sweep / str(num)}: not submitted" in said for num in range(3)), said
        assert "submitted SLURM job(s)" not in said  # nothing queued: no rank started only to skip its job
        assert {num: (sweep / str(num) / "summary.json").stat().st_mtime_ns for num in range(3)} == done
        assert (sweep / "report.md").is_file()


@pytest.mark.slurm
def test_submitit_sweep_with_a_failing_rank_fails_instead_of_waiting(submitit_sweeps):
    result, elapsed = submitit_sweeps["failing_rank"].result(), submitit_sweeps["failing_rank"].elapsed_s
    assert result.returncode == 1, f"{result.stdout[-3000:]}\n{result.stderr[-6000:]}"
    assert "sweep job 0 (SLURM job" in result.stderr, result.stderr[-6000:]
    assert "ended without a result" in result.stderr, result.stderr[-6000:]
    assert "task 1: stagecheck: rank 1 failed: RuntimeError: injected failure at step 1" in result.stderr
    # Its jobs queue behind the other sweeps' on the two test nodes, which share make test's cores with the other
    # pytest worker: it measured 135-198 s there. Waiting on the failed job instead would take the job's time limit.
    assert elapsed < SWEEP_TIMEOUT_MIN * 60 / 2, f"took {elapsed:.0f} s"


@pytest.mark.slurm
def test_submitit_sweep_reports_a_job_rejected_at_start_up_after_the_others_finish(submitit_sweeps):
    # The sweep must not exit 0.
    result, tmp_path = submitit_sweeps["rejected_job"].result(), submitit_sweeps["rejected_job"].tmp_path
    assert result.returncode == 1, f"{result.stdout[-3000:]}\n{result.stderr[-6000:]}"
    assert "sweep job 1 (SLURM job" in result.stderr, result.stderr[-6000:]
    assert "parallel.pipeline_stages=3 does not divide the world size 2" in result.stderr, result.stderr[-6000:]
    (sweep,) = (tmp_path / "multirun").iterdir()
    assert json.loads((sweep / "0" / "summary.json").read_text())["world_size"] == 2  # the other job finished


# ---- without a cluster ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "nodelist, host",
    [
        ("n1", "n1"),
        ("n[1-2]", "n1"),
        ("gpu[007-008,012],cpu1", "gpu007"),
        ("a,b", "a"),
        ("rack[3-4]-node[09-10]", "rack3-node09"),
    ],
)
def test_first_host_matches_scontrol_show_hostnames(nodelist, host):
    assert first_host(nodelist) == host


def test_srun_without_a_wrapper_finds_rank_zero_and_a_job_port():
    env = {
        "SLURM_PROCID": "1",
        "SLURM_NTASKS": "2",
        "SLURM_LOCALID": "0",
        "SLURM_JOB_ID": "4242",
        "SLURM_JOB_NODELIST": "n[1-2]",
        "SLURM_STEP_NODELIST": "n[1-2]",
    }
    dist = read_dist_env(env)
    assert (dist.rank, dist.world_size, dist.master_addr, dist.master_port) == (1, 2, "n1", slurm_master_port(4242))
    assert read_dist_env({**env, "MASTER_ADDR": "head", "MASTER_PORT": "1234"}).master_addr == "head"  # explicit wins
    assert read_dist_env({**env, "MASTER_ADDR": "head", "MASTER_PORT": "1234"}).master_port == 1234


def test_wait_ends_when_a_job_left_the_queue_without_results(tmp_path):
    """A job whose ranks died (no result files) is over once squeue no longer lists it: no sacct needed."""
    err = tmp_path / "task1.err"
    err.write_text("Traceback ...\nstagecheck: rank 1 failed: RuntimeError: boom\n")
    tasks = [
        SimpleNamespace(
            task_id=t,
            paths=SimpleNamespace(result_pickle=tmp_path / f"{t}.pkl", stderr=err if t else tmp_path / "none.err"),
        )
        for t in range(2)
    ]
    job = SimpleNamespace(job_id="7_0", num_tasks=2, task=lambda t: tasks[t], paths=SimpleNamespace(folder=tmp_path))
    listings = iter([{"7_0"}, {"7_0"}, set()])
    slept = []
    slurm_launcher.wait_until_ended([job], clock=lambda: 0.0, sleep=slept.append, queued=lambda: next(listings))
    assert len(slept) == 2

    ret = slurm_launcher.job_return(job, 0, ["+recompute=none"], clock=iter(range(100)).__next__, sleep=lambda s: None)
    with pytest.raises(RuntimeError, match=r"sweep job 0 \(SLURM job 7_0.*task\(s\) 0, 1 of 2 ended without a result"):
        _ = ret.return_value  # raises the job's error
    assert "task 1: stagecheck: rank 1 failed: RuntimeError: boom" in str(ret._return_value)


def test_slurm_launcher_config_names_a_discoverable_hydra_plugin():
    """Hydra instantiates only launchers found in the `hydra_plugins` namespace: the preset must name one."""
    from hydra import compose, initialize_config_dir
    from hydra.core.plugins import Plugins
    from hydra.plugins.launcher import Launcher

    from harness.run_dir import register_run_stamp_resolver
    from schema import register_schemas

    register_schemas()  # as train.py does
    register_run_stamp_resolver()
    with initialize_config_dir(str(REPO / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=["hydra/launcher=slurm"], return_hydra_config=True)
    launchers = {f"{cls.__module__}.{cls.__name__}" for cls in Plugins.instance().discover(Launcher)}
    assert cfg.hydra.launcher._target_ in launchers
    assert (cfg.hydra.launcher.nodes, cfg.hydra.launcher.tasks_per_node) == (2, 8)
    assert "export SLURM_KILL_BAD_EXIT=1" in cfg.hydra.launcher.setup
