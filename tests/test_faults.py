"""Faults end a run quickly and cleanly: a dead rank takes the run down within 60 s and is named, a
non-finite loss stops the run (exit 3) without touching the last good checkpoint, and an output
directory that cannot hold a checkpoint is refused at start-up."""

import errno
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from harness import faults
from harness.checkpoint import LATEST, META
from schema.training import TrainConfig
from tests.live_runs import start
from tests.runs import REPO, TINY, launch, metrics, python_run

COMMON = [*TINY, "train.steps=6", "train.save_every=2", "train.micro_batches=2", "train.trace_step=0", "logger=none"]


@pytest.mark.multiproc
def test_injected_nans_are_skipped_then_stop_the_run_keeping_the_last_checkpoint(tmp_path):
    """train.nan_policy=skip with a limit of 1: the NaN of step 3 drops that update, the one of step 5
    stops the run (as the default policy `stop` does at once): exit 3, a message, and the step-4
    checkpoint still the latest, nothing saved after the NaN."""
    run_dir = tmp_path / "nan"
    result = launch(
        run_dir,
        *COMMON,
        "train.inject_nan_at_steps=[3,5]",
        "train.nan_policy=skip",
        "train.nan_skip_limit=1",
        check=False,
    )
    assert result.returncode == faults.EXIT_NONFINITE, result.stderr[-3000:]
    assert "step 3: non-finite loss or gradients, update skipped (1/1, train.nan_policy=skip)" in result.stderr
    assert (
        "stagecheck: non-finite loss at step 5 (loss=nan): stopping (2 skipped steps > "
        "train.nan_skip_limit=1); nothing was saved after it; the last good checkpoint is "
        f"{run_dir / 'checkpoints' / 'step_00000004'} (step 4). Exit code 3."
    ) in result.stderr
    rows = {r["step"]: r for r in metrics(run_dir)}
    assert sorted(rows) == [1, 2, 3, 4, 5]
    assert rows[3]["skipped"] is True and rows[3]["loss"] != rows[3]["loss"]  # NaN, logged
    assert rows[4]["loss"] == rows[4]["loss"] and "skipped" not in rows[4]  # the weights stayed finite
    assert rows[4]["lr"] == rows[3]["lr"]  # a skipped step does not advance the LR schedule
    checkpoints = run_dir / "checkpoints"
    assert (checkpoints / LATEST).read_text().strip() == "step_00000004"
    assert sorted(p.name for p in checkpoints.iterdir() if p.is_dir()) == ["step_00000002", "step_00000004"]
    assert json.loads((checkpoints / "step_00000004" / META).read_text())["step"] == 4
    assert not (run_dir / "summary.json").exists()


@pytest.mark.multiproc
def test_a_rank_killed_mid_step_ends_the_run_within_60_s_and_is_named(tmp_path):
    run_dir = tmp_path / "killed"
    live = start(run_dir, *TINY, "train.steps=500", "train.save_every=0", "train.trace_step=0", "logger=none")
    try:
        live.wait_until(lambda: live.steps_logged() >= 2, "step 2")
        victim = live.rank_pid(1)
        killed_at = time.monotonic()
        os.kill(victim, signal.SIGKILL)
        code = live.finish(timeout=120)
        elapsed = time.monotonic() - killed_at
    finally:
        live.kill()
    out = live.output()
    assert code != 0
    assert elapsed < 60, f"the launcher took {elapsed:.0f} s to exit after a rank died"
    assert "stagecheck: rank 0 failed:" in out
    assert f"rank 1 (pid {victim}) died first" in out


def test_a_raising_rank_prints_its_rank_and_exits_1():
    code = (
        "from harness.faults import run_guarded\n"
        "def body():\n    raise OSError('disk on fire')\n"
        "run_guarded(3, body)\n"
        "print('not reached')\n"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == faults.EXIT_FAILED
    assert "stagecheck: rank 3 failed: OSError: disk on fire" in result.stderr
    assert "not reached" not in result.stdout


def test_an_output_dir_too_small_for_a_checkpoint_fails_at_start_up(tmp_path):
    run_dir = tmp_path / "run"
    # gpt3-175b: about 2 TiB of weights and Adam state per checkpoint, more than this disk has.
    result = python_run(run_dir, "model=gpt3-175b", "data=synthetic", "train.device=cpu", check=False, timeout=120)
    assert result.returncode == 2, result.stderr[-3000:]
    assert "less than one checkpoint" in result.stderr and "174,604,259,328 parameters" in result.stderr
    assert "Traceback" not in result.stderr
    assert not run_dir.exists()


def test_a_read_only_output_dir_fails_at_start_up_with_the_reason(tmp_path, monkeypatch):
    def read_only(*args, **kwargs):
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(faults.os, "open", read_only)
    with pytest.raises(ValueError, match=r"is not writable \(Read-only file system\): choose a writable"):
        faults.probe_writable(tmp_path)


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only directories")
def test_a_directory_without_write_permission_is_refused(tmp_path):
    run_dir = tmp_path / "ro"
    run_dir.mkdir()
    run_dir.chmod(0o555)
    try:
        result = python_run(run_dir, *TINY, check=False, timeout=120)
    finally:
        run_dir.chmod(0o755)
    assert result.returncode == 2
    assert "is not writable" in result.stderr


def test_free_space_check_refuses_and_warns():
    with pytest.raises(ValueError, match="has 0.0 GiB free, less than one checkpoint"):
        faults.check_free_space(REPO, 10**9, "fp32", keep=2, free_bytes=10**6)
    need = faults.checkpoint_bytes(10**9, "bf16")
    assert need == 14 * 10**9
    assert "train.keep_checkpoints=2" in faults.check_free_space(REPO, 10**9, "bf16", keep=2, free_bytes=2 * need)
    assert faults.check_free_space(REPO, 10**9, "bf16", keep=2, free_bytes=3 * need) is None


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("nan_policy", "ignore", "train.nan_policy='ignore' is unknown: allowed values are stop, skip"),
        ("keep_checkpoints", 0, "train.keep_checkpoints=0 is invalid: it must be >= 1"),
        ("save_every", -1, "train.save_every=-1 is invalid"),
        ("collective_timeout_s", 0, "train.collective_timeout_s=0 is invalid"),
        ("inject_nan_at_steps", [0], "train.inject_nan_at_steps=[0] is invalid"),
    ],
)
def test_new_train_options_are_validated(field, value, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        TrainConfig(**{field: value})


@pytest.mark.parametrize(
    "value, expected",
    [(False, "false"), ("False", "false"), ("auto", "auto"), ("AUTO", "auto"), ("/x/checkpoints", "/x/checkpoints")],
)
def test_resume_values(value, expected):
    assert TrainConfig(resume=value).resume == expected


@pytest.mark.multiproc  # a process group of one, in this process
def test_the_fp32_guard_skips_an_update_with_non_finite_gradients():
    from types import SimpleNamespace

    import torch
    import torch.distributed as dist

    from tests.runs import free_port

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        weight = torch.nn.Parameter(torch.ones(3))
        optimizer = torch.optim.AdamW([weight], lr=0.1)
        assert faults.install_nonfinite_guard(SimpleNamespace(optimizer=optimizer))
        weight.grad = torch.tensor([1.0, float("nan"), 1.0])
        optimizer.step()
        assert optimizer.overflow and torch.equal(weight.detach(), torch.ones(3)) and not optimizer.state
        weight.grad = torch.ones(3)
        optimizer.step()
        assert not optimizer.overflow and not torch.equal(weight.detach(), torch.ones(3))
    finally:
        dist.destroy_process_group()
