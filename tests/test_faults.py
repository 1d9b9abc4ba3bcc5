"""Faults end a run quickly and cleanly: a dead rank takes the run down within 60 s and is named, a
non-finite loss stops the run (exit 3) without touching the last good checkpoint, and an output
directory that cannot hold a checkpoint is refused at start-up."""

import errno
import json
import os
import shlex
import signal
import subprocess
import sys
import time

import pytest

from harness import faults
from harness.checkpoint import LATEST, META
from schema.training import TrainConfig
from tests.live_runs import LiveRun, start
from tests.runs import DEEPSPEED, REPO, TINY, cpu_env, free_port, launch, metrics, python_run, refuse_in_quick_tier

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


def _start_in(cwd, argv: list[str], run_dir) -> LiveRun:
    """`argv` typed at a terminal in `cwd`: its own process group, which a Ctrl-C signals as a whole."""
    log = cwd / f"{run_dir.name}.{time.monotonic_ns()}.log"
    env = cpu_env(cwd, PATH=f"{DEEPSPEED.parent}:{os.environ['PATH']}")
    # A terminal's shell starts a command with Ctrl-C at its default. This process may ignore it (started by `cmd &`
    # in a script), and bash can never trap a signal ignored when it started: launch/local_deepspeed.sh would then
    # pass no Ctrl-C on.
    argv = ["env", "--default-signal=INT", *argv]
    with open(log, "w") as handle:
        proc = subprocess.Popen(argv, cwd=cwd, env=env, stdout=handle, stderr=subprocess.STDOUT, start_new_session=True)
    return LiveRun(proc, run_dir, log, time.monotonic())


def _end_tree(live: LiveRun) -> None:
    """After a failed test: the wrapper, and the launcher it started in a session of its own, with every rank."""
    import psutil

    try:
        tree = [psutil.Process(live.proc.pid), *psutil.Process(live.proc.pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        return
    for process in tree:
        try:
            process.kill()
        except psutil.NoSuchProcess:
            pass


@pytest.mark.multiproc
def test_ctrl_c_saves_exits_75_and_the_printed_command_resumes_the_named_run(tmp_path):
    """Ctrl-C at the terminal of `launch/local_deepspeed.sh --num_gpus 2 ... /abs/train.py train.run_name=...`:
    every rank saves and exits 75, and so does the launcher (plain `deepspeed` exits 1 there); no traceback, and
    none of DeepSpeed's and torch's start-up noise that stagecheck can keep out. The
    command it prints keeps the launcher, its options and the script path as typed, and running it exactly, from
    the same directory, finds the run by its name and resumes it."""
    refuse_in_quick_tier("a deepspeed launch")
    typed = [str(REPO / "launch" / "local_deepspeed.sh"), "--num_gpus", "2", "--master_port", str(free_port())]
    typed += [str(REPO / "train.py"), *TINY, "train.steps=16", "train.save_every=0", "train.trace_step=0"]
    typed += ["logger=none", "train.run_name=ctrl-c"]
    run_dir = tmp_path / "outputs" / "ctrl-c"
    live = _start_in(tmp_path, typed, run_dir)
    try:
        live.wait_until(lambda: live.steps_logged() >= 3, "step 3")
        os.killpg(live.proc.pid, signal.SIGINT)  # what the terminal does on Ctrl-C
        code = live.finish(timeout=120)
    finally:
        _end_tree(live)
    out = live.output()
    assert code == faults.EXIT_PREEMPTED, out[-4000:]
    assert "stagecheck: rank 0 got SIGINT" in out and "stagecheck: preempted (SIGINT on rank" in out
    assert "Traceback" not in out and "KeyboardInterrupt" not in out
    # Start-up and the metered step are quiet: no compiler probe, no PipelineModule prints, no optimizer-override
    # warning, no Kineto lines from the tensor-peak profiler.
    for noise in ("gcc ", "SEED_LAYERS=", "Using topology:", "has been overridden", "USDT:"):
        assert noise not in out, noise
    k = len(metrics(run_dir))
    assert 3 <= k < 16 and (run_dir / "checkpoints" / LATEST).read_text().strip() == f"step_{k:08d}"
    (line,) = [line for line in out.splitlines() if "To continue, relaunch (train.resume=auto): " in line]
    command = line.split("To continue, relaunch (train.resume=auto): ")[1]
    assert shlex.split(command) == typed  # the name finds the run: no hydra.run.dir to add

    relaunched = _start_in(tmp_path, shlex.split(command), run_dir)
    try:
        code = relaunched.finish(timeout=300)
    finally:
        _end_tree(relaunched)
    assert code == 0, relaunched.output()[-4000:]
    assert f"resuming from {run_dir / 'checkpoints' / f'step_{k:08d}'} after step {k}" in relaunched.output()
    assert [row["step"] for row in metrics(run_dir)] == list(range(1, 17))


@pytest.mark.multiproc  # a 1-rank run
def test_a_relaunch_into_a_run_killed_before_its_first_checkpoint_starts_it_again(tmp_path):
    """The requeued job of a run preempted before its first save: train.resume=auto finds no complete checkpoint,
    starts again, and keeps what the first attempt wrote, where every later relaunch would have been refused."""
    run_dir = tmp_path / "run"
    (run_dir / "checkpoints" / "step_00000002").mkdir(parents=True)  # a save cut short: no `latest`
    (run_dir / "metrics.jsonl").write_text('{"step": 1, "loss": 5.5}\n')
    result = python_run(run_dir, *[o for o in COMMON if not o.startswith("train.steps")], "train.steps=2")
    aside = run_dir / "earlier_attempts" / "1"
    assert "holds no complete checkpoint to resume (train.resume=auto): starting the run again" in result.stdout
    assert (aside / "metrics.jsonl").read_text() == '{"step": 1, "loss": 5.5}\n'
    assert (aside / "checkpoints" / "step_00000002").is_dir()
    assert [row["step"] for row in metrics(run_dir)] == [1, 2]
    assert (run_dir / "checkpoints" / LATEST).read_text().strip() == "step_00000002"


def test_a_second_ctrl_c_quits_at_once_without_a_traceback():
    """The first SIGINT asks for a checkpoint at the end of the step; a second one, before it, quits with 130."""
    code = (
        "import os, signal, time\n"
        "from harness import preemption\n"
        "preemption.install(0)\n"
        "os.kill(os.getpid(), signal.SIGINT)\n"
        "time.sleep(0.1)\n"
        "assert preemption.requested() == signal.SIGINT\n"
        "os.kill(os.getpid(), signal.SIGTERM)  # the launcher's, after the terminal's Ctrl-C: ignored\n"
        "time.sleep(0.1)\n"
        "print('still here', flush=True)\n"
        "os.kill(os.getpid(), signal.SIGINT)\n"
        "time.sleep(5)\n"
        "print('not reached')\n"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 130
    assert result.stdout == "still here\n"
    assert "stagecheck: rank 0 got SIGINT: saving a checkpoint at the end of this step" in result.stderr
    assert "stagecheck: rank 0 got SIGINT again: quitting now, without a checkpoint" in result.stderr
    assert "Traceback" not in result.stderr


def test_ctrl_c_during_start_up_quits_without_a_traceback(tmp_path):
    """Before training starts there is nothing to save: Ctrl-C quits with 130 and one line."""
    proc = subprocess.Popen(
        [sys.executable, str(REPO / "train.py"), "model=tiny", "dry_run=true"],
        cwd=tmp_path,
        env=cpu_env(tmp_path),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    time.sleep(1.0)  # inside the imports
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    assert err == "stagecheck: interrupted (SIGINT) during start-up: nothing was trained\n"


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
        ("gc_interval", -1, "train.gc_interval=-1 is invalid: it must be steps >= 1, or 0 for Python's collector"),
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
