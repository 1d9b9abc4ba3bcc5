"""Launch real stagecheck runs from tests: the deepspeed launcher or plain python, on CPU.

`make test-quick` (QUICK_TIER set) leaves out the tests marked `multiproc`: every launch, and every `python
train.py` that trains, starts a process group. A test that starts one without the marker fails here, naming it."""

import atexit
import itertools
import json
import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEEPSPEED = Path(sys.executable).with_name("deepspeed")
TINY = ["model=tiny", "data=synthetic", "train.device=cpu", "train.prices=curves"]
"""train.prices=curves: tests that assert plans get deterministic prices (no cached profile in tests: analytic)."""
QUICK_TIER = "STAGECHECK_QUICK_TIER"
"""Set by `make test-quick`: nothing may start a process group."""


def refuse_in_quick_tier(what: str) -> None:
    if os.environ.get(QUICK_TIER):
        raise AssertionError(
            f"{what} starts a process group, and {QUICK_TIER} is set (make test-quick): mark the test "
            "@pytest.mark.multiproc so that the quick tier leaves it out"
        )


TEST_PORTS = range(30000, 32768)
"""Where the tests' launches rendezvous: below Linux's ephemeral range (32768-60999), from which every gloo connection
of every other launch takes its own port, so that none can take a launch's port between its choice and its bind (seen
with three xdist workers: EADDRINUSE); above the local Slurm's job ports (10000-29999, parallel/runtime/dist_env.py's
slurm_master_port). Each xdist worker draws from a slice of its own."""
_drawn = itertools.count()


def free_port() -> int:
    """A port of this worker's slice of TEST_PORTS that nothing listens on now, never the same twice in a row."""
    worker = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw"))
    share = len(TEST_PORTS) // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    first = TEST_PORTS.start + worker * share
    for _ in range(share):
        port = first + next(_drawn) % share
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue  # in use, or a finished launch's connection waits out TIME_WAIT on it
        return port
    raise RuntimeError(f"no free port in {first}-{first + share - 1} for this test worker")


def cpu_env(tmp: Path, **extra: str) -> dict:
    """CPU accelerator, W&B offline with its own config/cache dirs, no inherited rank variables."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("WANDB_", "SLURM_"))
        and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    }
    env.update(
        DS_ACCELERATOR="cpu",
        WANDB_MODE="offline",
        WANDB_CONFIG_DIR=str(tmp / ".wandb-config"),
        WANDB_CACHE_DIR=str(tmp / ".wandb-cache"),
        WANDB_DATA_DIR=str(tmp / ".wandb-data"),
        PYTHONUNBUFFERED="1",
        **extra,
    )
    return env


def deepspeed_command(nproc: int, *args: str, script: str = "train.py") -> list[str]:
    """The deepspeed launcher on `nproc` local ranks, on a port of its own (launches in parallel never meet)."""
    return [str(DEEPSPEED), "--num_gpus", str(nproc), "--master_port", str(free_port()), script, *args]


def launch(
    run_dir: Path, *overrides: str, nproc: int = 2, timeout: float = 600, check: bool = True, env: dict | None = None
) -> subprocess.CompletedProcess:
    """`deepspeed --num_gpus N train.py hydra.run.dir=RUN_DIR ...` as a user types it."""
    refuse_in_quick_tier("a deepspeed launch")
    return _run(deepspeed_command(nproc, f"hydra.run.dir={run_dir}", *overrides), run_dir, timeout, check, env)


def launch_multirun(
    sweep_dir: Path, *overrides: str, nproc: int = 2, timeout: float = 600, check: bool = True, env: dict | None = None
) -> subprocess.CompletedProcess:
    """`deepspeed --num_gpus N train.py -m hydra.sweep.dir=SWEEP_DIR ...`: a Hydra sweep inside one launch."""
    refuse_in_quick_tier("a deepspeed launch")
    return _run(
        deepspeed_command(nproc, "-m", f"hydra.sweep.dir={sweep_dir}", *overrides), sweep_dir, timeout, check, env
    )


def python_run(
    run_dir: Path | None,
    *overrides: str,
    timeout: float = 300,
    check: bool = True,
    env: dict | None = None,
    tmp: Path | None = None,
) -> subprocess.CompletedProcess:
    """`python train.py ...`: a 1-rank run, or a dry run / start-up failure (`check=False`). Only the latter two
    start no process group. A run expected to fail (`check=False`) runs in a child of the start-up server."""
    dry_run = "dry_run=true" in overrides
    if check and not dry_run:
        refuse_in_quick_tier("python train.py without dry_run=true (a 1-rank training run)")
    before = _metrics_written(run_dir)
    cmd = [sys.executable, "train.py", *([f"hydra.run.dir={run_dir}"] if run_dir else []), *overrides]
    if check:
        result = _run(cmd, run_dir or tmp, timeout, check, env)
    else:
        scratch = run_dir or tmp
        result = _START_UP.run(cmd, env or cpu_env(scratch.parent if scratch is not None else REPO), timeout)
    if _metrics_written(run_dir) != before:  # it trained a step
        refuse_in_quick_tier("python train.py that trained")
    return result


class StartUpServer:
    """tests/start_up_server.py, started on first use: `python train.py` runs, each in a forked child."""

    def __init__(self):
        self.proc: subprocess.Popen | None = None
        self.pending = b""
        """What the server wrote that no answer has taken yet (its pid and exit-code lines can come together)."""

    def run(self, cmd: list[str], env: dict, timeout: float) -> subprocess.CompletedProcess:
        if self.proc is None or self.proc.poll() is not None:
            server = [sys.executable, "-u", str(REPO / "tests" / "start_up_server.py")]
            env_of_server = {**os.environ, "PYTHONPATH": str(REPO)}
            self.proc = subprocess.Popen(
                server, cwd=REPO, env=env_of_server, stdin=subprocess.PIPE, stdout=subprocess.PIPE
            )
            self.pending = b""
        with tempfile.TemporaryDirectory() as out:
            stdout, stderr = Path(out) / "stdout", Path(out) / "stderr"
            request = {"argv": cmd[1:], "env": env, "cwd": str(REPO), "stdout": str(stdout), "stderr": str(stderr)}
            self.proc.stdin.write(json.dumps(request).encode() + b"\n")
            self.proc.stdin.flush()
            pid = self._answer(60)["pid"]
            try:
                code = self._answer(timeout)["code"]
            except subprocess.TimeoutExpired:
                os.kill(pid, signal.SIGKILL)
                self._answer(60)
                raise
            return subprocess.CompletedProcess(cmd, code, stdout.read_text(), stderr.read_text())

    def _answer(self, timeout: float) -> dict:
        """The server's next line, read straight from its pipe (no buffer that select cannot see)."""
        fd = self.proc.stdout.fileno()
        deadline = time.monotonic() + timeout
        while b"\n" not in self.pending:
            if not select.select([fd], [], [], max(0.0, deadline - time.monotonic()))[0]:
                raise subprocess.TimeoutExpired("tests/start_up_server.py", timeout)
            chunk = os.read(fd, 4096)
            if not chunk:
                raise AssertionError(f"tests/start_up_server.py exited {self.proc.wait()}")
            self.pending += chunk
        line, self.pending = self.pending.split(b"\n", 1)
        return json.loads(line)

    def close(self) -> None:
        if self.proc is not None:
            self.proc.kill()


_START_UP = StartUpServer()
atexit.register(_START_UP.close)


def _metrics_written(run_dir: Path | None) -> int | None:
    """When the run's metrics.jsonl was last written (ns), None if it has none."""
    path = run_dir / "metrics.jsonl" if run_dir is not None else None
    return path.stat().st_mtime_ns if path is not None and path.exists() else None


def launch_script(
    script: Path, *args: str, env: dict, nproc: int = 2, timeout: float = 600, check: bool = True
) -> subprocess.CompletedProcess:
    """`deepspeed --num_gpus N SCRIPT ARGS...`: a test fixture script on `nproc` local ranks."""
    refuse_in_quick_tier(f"a deepspeed launch of {script.name}")
    return _run(deepspeed_command(nproc, *args, script=str(script)), None, timeout, check, env)


def _run(cmd: list[str], scratch: Path, timeout: float, check: bool, env: dict | None) -> subprocess.CompletedProcess:
    scratch_root = scratch.parent if scratch is not None else REPO
    result = subprocess.run(
        cmd, cwd=REPO, env=env or cpu_env(scratch_root), capture_output=True, text=True, timeout=timeout
    )
    if check and result.returncode != 0:
        raise AssertionError(
            f"{' '.join(cmd)} exited {result.returncode}\nSTDOUT:\n{result.stdout[-4000:]}\n"
            f"STDERR:\n{result.stderr[-6000:]}"
        )
    return result


def summary(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
