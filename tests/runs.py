"""Launch real stagecheck runs from tests: the deepspeed launcher or plain python, on CPU."""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEEPSPEED = Path(sys.executable).with_name("deepspeed")
TINY = ["model=tiny", "data=synthetic", "train.device=cpu"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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


def deepspeed_command(nproc: int, *args: str) -> list[str]:
    """The deepspeed launcher on `nproc` local ranks, on a port of its own (launches in parallel never meet)."""
    return [str(DEEPSPEED), "--num_gpus", str(nproc), "--master_port", str(free_port()), "train.py", *args]


def launch(
    run_dir: Path, *overrides: str, nproc: int = 2, timeout: float = 600, check: bool = True, env: dict | None = None
) -> subprocess.CompletedProcess:
    """`deepspeed --num_gpus N train.py hydra.run.dir=RUN_DIR ...` as a user types it."""
    return _run(deepspeed_command(nproc, f"hydra.run.dir={run_dir}", *overrides), run_dir, timeout, check, env)


def launch_multirun(
    sweep_dir: Path, *overrides: str, nproc: int = 2, timeout: float = 600, check: bool = True, env: dict | None = None
) -> subprocess.CompletedProcess:
    """`deepspeed --num_gpus N train.py -m hydra.sweep.dir=SWEEP_DIR ...`: a Hydra sweep inside one launch."""
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
    """`python train.py ...`: a 1-rank run, or a dry run / start-up failure."""
    cmd = [sys.executable, "train.py", *([f"hydra.run.dir={run_dir}"] if run_dir else []), *overrides]
    return _run(cmd, run_dir or tmp, timeout, check, env)


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
