"""The local two-node Slurm cluster runs real multi-node batch jobs."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

# Until tests/conftest.py loads the plugin, load it here (same module name, so
# pytest registers it once either way).
pytest_plugins = ["tests.slurm_cluster"]

pytestmark = pytest.mark.slurm

JOB_TIMEOUT_S = 120


def _write_job(tmp_path: Path, body: str) -> Path:
    script = tmp_path / "job.sh"
    script.write_text("#!/bin/bash\n" + body + "\n")
    script.chmod(0o755)
    return script


def _sbatch_wait(slurm_cluster, tmp_path: Path, script: Path, *args: str):
    out = tmp_path / "job.out"
    result = slurm_cluster.run(
        [
            "sbatch",
            "--wait",
            f"--chdir={tmp_path}",
            f"--output={out}",
            "--time=2",
            *args,
            str(script),
        ],
        timeout=JOB_TIMEOUT_S,
    )
    output = out.read_text() if out.exists() else ""
    return result, output


def test_two_node_job_runs_one_task_per_node(slurm_cluster, tmp_path):
    script = _write_job(
        tmp_path,
        "srun bash -c 'echo TASK $SLURM_PROCID $SLURM_NTASKS $SLURM_LOCALID $SLURMD_NODENAME'",
    )
    result, output = _sbatch_wait(slurm_cluster, tmp_path, script, "--nodes=2", "--ntasks-per-node=1")
    assert result.returncode == 0, f"{result.stderr}\n{output}\n{slurm_cluster.log_tail()}"

    tasks = sorted(line.split()[1:] for line in output.splitlines() if line.startswith("TASK "))
    assert tasks == [["0", "2", "0", "n1"], ["1", "2", "0", "n2"]], output


def test_failing_task_fails_sbatch_wait(slurm_cluster, tmp_path):
    script = _write_job(tmp_path, "srun bash -c 'exit 3'")
    result, output = _sbatch_wait(slurm_cluster, tmp_path, script, "--nodes=2", "--ntasks-per-node=1", "--parsable")
    assert result.returncode == 3, f"{result.stderr}\n{output}"
    assert "exit code 3" in output

    # The controller forgets the job after MinJobAge; the completion log keeps it.
    job_id = result.stdout.split()[0].split(";")[0]
    sacct = slurm_cluster.run(
        ["sacct", "-c", "-j", job_id, "-o", "JobID,State,ExitCode", "--parsable2", "-n"],
        timeout=30,
    )
    assert sacct.stdout.split() == [f"{job_id}|FAILED|3:0"], sacct.stdout + sacct.stderr


def test_sbatch_wait_returns_soon_after_job_ends(slurm_cluster, tmp_path):
    # MinJobAge=4 keeps sbatch --wait polling every 2 s; with Slurm's default
    # it backs off 2, 8, 32 s and every short test job costs up to 32 s extra.
    script = _write_job(tmp_path, "true")
    start = time.monotonic()
    result, output = _sbatch_wait(slurm_cluster, tmp_path, script, "--nodes=1")
    elapsed = time.monotonic() - start
    assert result.returncode == 0, f"{result.stderr}\n{output}"
    assert elapsed < 8, f"sbatch --wait took {elapsed:.1f}s for a no-op job"
