"""Pytest plugin: a real two-node Slurm cluster (n1, n2) on this machine.

Load it from tests/conftest.py with::

    pytest_plugins = ["tests.slurm_cluster"]

Then request the session-scoped ``slurm_cluster`` fixture and pass
``slurm_cluster.env`` to every subprocess that calls sbatch/srun/squeue.
The cluster is started by ``launch/local_slurm.sh up`` and stopped at the end of
the session only if this session started it. Tests are skipped when the
script says the cluster cannot run here (exit 77: not root, or no packages).
The ``slurm`` marker is registered in pytest.ini.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
SCRIPT = REPO_ROOT / "launch" / "local_slurm.sh"
DEFAULT_STATE_DIR = "/tmp/stagecheck-slurm"
SKIP_EXIT_CODE = 77
# A first `up` may apt-get install the packages (~10 s here); otherwise ~1 s.
UP_TIMEOUT_S = 600
DOWN_TIMEOUT_S = 120


@dataclass(frozen=True)
class SlurmCluster:
    state_dir: Path
    env: dict[str, str]
    nodes: tuple[str, ...] = ("n1", "n2")
    partition: str = "debug"

    @property
    def conf(self) -> Path:
        return self.state_dir / "slurm.conf"

    def run(
        self, args: Sequence[str], timeout: float = 120, check: bool = False, **kwargs
    ) -> subprocess.CompletedProcess[str]:
        """Run a Slurm client command against this cluster, capturing text output."""
        return subprocess.run(
            list(args),
            env=self.env,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=check,
            **kwargs,
        )

    def log_tail(self, lines: int = 30) -> str:
        """Tails of the daemon logs, for assertion messages."""
        parts = []
        for log in sorted((self.state_dir / "log").glob("slurm*.log")):
            text = log.read_text(errors="replace").splitlines()[-lines:]
            parts.append(f"----- {log} -----\n" + "\n".join(text))
        return "\n".join(parts)


def _script(cmd: str, env: dict[str, str], timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", str(SCRIPT), cmd],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.fixture(scope="session")
def slurm_cluster() -> Iterator[SlurmCluster]:
    state_dir = Path(os.environ.get("STAGECHECK_SLURM_DIR", DEFAULT_STATE_DIR))
    env = dict(os.environ, STAGECHECK_SLURM_DIR=str(state_dir))

    if os.name != "posix" or not Path("/proc").is_dir():
        pytest.skip("local Slurm cluster needs Linux")

    up = _script("up", env, timeout=UP_TIMEOUT_S)
    if up.returncode == SKIP_EXIT_CODE:
        pytest.skip(f"local Slurm cluster unavailable: {up.stderr.strip()}")
    if up.returncode != 0:
        # Leave no half-started daemons behind; the logs are in the message.
        _script("down", env, timeout=DOWN_TIMEOUT_S)
        pytest.fail(
            f"launch/local_slurm.sh up failed (exit {up.returncode}):\n{up.stdout}\n{up.stderr}",
            pytrace=False,
        )

    cluster = SlurmCluster(
        state_dir=state_dir,
        env=dict(env, SLURM_CONF=str(state_dir / "slurm.conf")),
    )
    # Code under test may shell out to sbatch without passing env (submitit
    # does), so expose SLURM_CONF process-wide for the session as well.
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SLURM_CONF", str(cluster.conf))
        yield cluster

    # `up` prints "started" or "already-up" under its lock, so two sessions
    # racing to start the cluster cannot both think they own it.
    if up.stdout.strip() == "started":
        down = _script("down", env, timeout=DOWN_TIMEOUT_S)
        if down.returncode != 0:
            # Teardown errors would hide the real test outcome; say it loudly instead.
            print(f"launch/local_slurm.sh down failed ({down.returncode}):\n{down.stderr}")
