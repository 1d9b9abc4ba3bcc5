"""W&B's service killed under a run (srun -K kills a job step's process trees when one rank fails) must not fail the
run: harness/wandb_logger.py says so once and goes on without W&B."""

import subprocess
import sys
import textwrap

from tests.runs import REPO, cpu_env

SCRIPT = textwrap.dedent(
    """
    import sys
    from pathlib import Path
    import psutil
    from harness.wandb_logger import WandbLogger, init_wandb_run

    run_dir = Path(sys.argv[1])
    logger = WandbLogger(init_wandb_run("offline", 30, project="p", dir=str(run_dir)))
    logger.log({"loss": 1.0}, step=1)
    services = psutil.Process().children(recursive=True)
    assert services, "no W&B service process"
    for service in services:
        service.kill()
    psutil.wait_procs(services, timeout=30)
    (run_dir / "trace.json").write_text("{}")
    for step in (2, 3):
        logger.log({"loss": 1.0}, step=step)
    logger.save_files([run_dir / "trace.json"], run_dir)
    logger.update_summary({"loss": 1.0})
    logger.finish()
    print("finished", logger.lost is not None)
    """
)


def test_a_dead_wandb_service_is_said_once_and_the_run_goes_on(tmp_path):
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(tmp_path)], cwd=REPO, env=cpu_env(tmp_path), capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == "finished True"
    warnings = [line for line in done.stderr.splitlines() if "stagecheck: warning: W&B" in line]
    assert len(warnings) == 1 and "the run goes on" in warnings[0], done.stderr[-3000:]
