"""Runs started in the background, so a test can signal or kill one rank while it trains or saves."""

import os
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import psutil

from tests.runs import REPO, cpu_env, deepspeed_command, refuse_in_quick_tier


@dataclass
class LiveRun:
    proc: subprocess.Popen
    run_dir: Path
    log: Path
    started: float

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def rank_pid(self, rank: int, timeout: float = 120) -> int:
        """The pid of the training process with LOCAL_RANK `rank` (one node: local rank = rank)."""
        flag = f"--local_rank={rank}"
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for child in psutil.Process(self.proc.pid).children(recursive=True):
                try:
                    if flag in child.cmdline() and "train.py" in child.cmdline():
                        return child.pid
                except psutil.NoSuchProcess:
                    pass
            self._check_alive()
            time.sleep(0.2)
        raise AssertionError(f"no rank {rank} process after {timeout} s\n{self.output()[-4000:]}")

    def wait_until(self, condition: Callable[[], bool], what: str, timeout: float = 180) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if condition():
                return
            self._check_alive()
            time.sleep(0.1)
        raise AssertionError(f"timed out waiting for {what}\n{self.output()[-4000:]}")

    def steps_logged(self) -> int:
        path = self.run_dir / "metrics.jsonl"
        return len(path.read_text().splitlines()) if path.exists() else 0

    def finish(self, timeout: float = 300) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"the run did not end within {timeout} s\n{self.output()[-4000:]}") from None

    def kill(self) -> None:
        """Take down the launcher and every rank (cleanup after a failed test)."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def _check_alive(self) -> None:
        if self.proc.poll() is not None:
            raise AssertionError(f"the run ended early with {self.proc.returncode}\n{self.output()[-4000:]}")


def start(run_dir: Path, *overrides: str, nproc: int = 2, env_extra: dict | None = None) -> LiveRun:
    """`deepspeed --num_gpus N train.py ...` in its own process group, output to <run_dir>.log."""
    refuse_in_quick_tier("a deepspeed launch")
    log = run_dir.with_name(run_dir.name + f".{int(time.time() * 1000)}.log")
    env = cpu_env(run_dir.parent, **(env_extra or {}))
    cmd = deepspeed_command(nproc, f"hydra.run.dir={run_dir}", *overrides)
    with open(log, "w") as handle:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=handle, stderr=subprocess.STDOUT, start_new_session=True)
    return LiveRun(proc, run_dir, log, time.monotonic())
