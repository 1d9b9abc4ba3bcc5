"""The launch contract: `--local_rank` stripped, one run directory per launch agreed on by every rank,
rank variables from torch or SLURM, and `python train.py` alone as a 1-rank run."""

import os
import subprocess
import sys

import pytest

from harness.launcher_args import strip_launcher_args
from harness.relaunch import with_ranks
from harness.resume_check import ResumeCommand
from harness.run_dir import run_stamp
from parallel.runtime.dist_env import read_dist_env
from tests.runs import REPO, TINY, python_run, summary


@pytest.mark.parametrize(
    "argv",
    [
        ["train.py", "--local_rank=1", "a=1"],
        ["train.py", "--local_rank", "1", "a=1"],
        ["train.py", "a=1", "--local-rank=1"],
    ],
)
def test_the_launchers_local_rank_never_reaches_hydra(argv, monkeypatch):
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    assert strip_launcher_args(argv) == ["train.py", "a=1"]
    assert os.environ["LOCAL_RANK"] == "1"


def test_ranks_started_by_one_launcher_agree_on_the_run_directory():
    """Two children of one parent, as the deepspeed launcher or torchrun start them, a second apart."""
    code = "import time, sys; time.sleep(float(sys.argv[1])); from harness.run_dir import run_stamp; print(run_stamp())"
    env = {"LOCAL_RANK": "0", "PATH": "/usr/bin:/bin"}
    first = subprocess.Popen([sys.executable, "-c", code, "0"], cwd=REPO, env=env, stdout=subprocess.PIPE, text=True)
    second = subprocess.Popen([sys.executable, "-c", code, "1.2"], cwd=REPO, env=env, stdout=subprocess.PIPE, text=True)
    assert first.communicate(timeout=60)[0] == second.communicate(timeout=60)[0]


def test_a_slurm_job_finds_its_own_run_directory_again():
    assert run_stamp({"SLURM_JOB_ID": "4242"}) == "slurm-4242"
    assert run_stamp({"SLURM_JOB_ID": "9", "SLURM_ARRAY_JOB_ID": "8", "SLURM_ARRAY_TASK_ID": "3"}) == "slurm-8_3"


def test_the_same_command_with_a_run_name_finds_the_same_run_directory(tmp_path):
    """train.run_name names the run directory: the dry run of the same command, twice, writes into one folder,
    where two launches without a name get one each."""
    named = ["model=tiny", "data=synthetic", "train.run_name=ft-1", "dry_run=true"]
    for _ in range(2):
        result = subprocess.run(
            [sys.executable, str(REPO / "train.py"), *named], cwd=tmp_path, capture_output=True, text=True, timeout=120
        )
        assert result.returncode == 0, result.stderr
    assert [p.name for p in (tmp_path / "outputs").iterdir()] == ["ft-1"]
    bad = subprocess.run(
        [sys.executable, str(REPO / "train.py"), "model=tiny", "train.run_name=../up", "dry_run=true"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert bad.returncode == 2 and "train.run_name='../up' is invalid: it must be a plain name" in bad.stderr
    assert [p.name for p in tmp_path.iterdir()] == ["outputs"]


def test_the_relaunch_command_keeps_the_launcher_and_script_as_typed(tmp_path):
    """What a preemption prints: the launcher's words as the user typed them, read from the process tree (here a
    wrapper script in front of a Python process, as launch/local_deepspeed.sh is in front of the ranks)."""
    wrapper = tmp_path / "my launcher.sh"
    probe = "from harness.relaunch import typed_launcher; print(typed_launcher('/x/train.py'))"
    wrapper.write_text(f'#!/bin/bash\n{sys.executable} -c "{probe}"\n')
    wrapper.chmod(0o755)
    argv = [str(wrapper), "--num_gpus", "2", "--master_port", "29600", "/x/train.py", "model=tiny"]
    shown = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=60, env={"PYTHONPATH": str(REPO)})
    assert shown.stdout.strip() == repr(argv[:-1]), shown.stderr
    typed = ["deepspeed", "--num_gpus", "2", "--master_port", "29600", "train.py"]
    assert with_ranks(typed, 4) == ["deepspeed", "--num_gpus", "4", "--master_port", "29600", "train.py"]
    assert with_ranks(["torchrun", "--nproc-per-node=2", "t.py"], 1) == ["torchrun", "--nproc-per-node=1", "t.py"]
    assert with_ranks(["python", "train.py"], 2) == ["deepspeed", "--num_gpus", "2", "train.py"]


def test_the_relaunch_continues_in_the_run_directory(tmp_path):
    """A preemption's command: the run directory added when the run has no name, and neither a typed checkpoint
    path nor train.overwrite=true (either would start the run from elsewhere, or delete it)."""
    typed = ResumeCommand(["deepspeed", "--num_gpus", "2", "train.py"], ["model=tiny", "train.resume=/x"], None)
    typed.overrides.append("train.overwrite=true")
    run_dir = tmp_path / "outputs" / "2026-12-02_03-00-00-1234"
    assert typed.relaunch(run_dir, named=False) == f"deepspeed --num_gpus 2 train.py hydra.run.dir={run_dir} model=tiny"
    assert typed.relaunch(run_dir, named=True) == "deepspeed --num_gpus 2 train.py model=tiny"


def test_turning_off_the_shared_memory_op_runs_no_compiler_probe():
    """DeepSpeed probes every op (gcc builds of test programs, each printing its command) when its table of
    compatible ops is first read; the CPU engine only needs one entry of it off."""
    code = (
        "from parallel.runtime.accelerator import use_accelerator; use_accelerator('cpu')\n"
        "import deepspeed\n"
        "from parallel.runtime.engine import _skip_shm_inference_allreduce\n"
        "_skip_shm_inference_allreduce()\n"
        "print(deepspeed.ops.__compatible_ops__)\n"
    )
    env = {**os.environ, "DS_ACCELERATOR": "cpu"}
    command = [sys.executable, "-c", code]
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 0, result.stderr
    assert result.stdout == "{'deepspeed_shm_comm': False}\n"
    assert "gcc" not in result.stderr


def test_rank_variables_come_from_torch_then_slurm():
    torch_env = read_dist_env(
        {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "MASTER_ADDR": "h", "MASTER_PORT": "123"}
    )
    assert (torch_env.rank, torch_env.world_size, torch_env.local_rank, torch_env.source) == (1, 2, 1, "torch")
    slurm = read_dist_env(
        {"SLURM_PROCID": "3", "SLURM_NTASKS": "4", "SLURM_LOCALID": "1", "MASTER_ADDR": "n1", "MASTER_PORT": "2000"}
    )
    assert (slurm.rank, slurm.world_size, slurm.local_rank, slurm.source) == (3, 4, 1, "slurm")
    assert read_dist_env({}).world_size == 1


@pytest.mark.multiproc
def test_python_train_py_alone_is_a_one_rank_run(tmp_path):
    python_run(tmp_path / "run", *TINY, "train.steps=2", "train.micro_batches=2", "train.trace_step=0", "logger=none")
    s = summary(tmp_path / "run")
    assert (s["world_size"], s["pipeline_stages"], len(s["losses"])) == (1, 1, 2)
