"""Faults: exit codes, a failing rank that names itself, non-finite steps, and unwritable output.

Exit codes of a rank (the deepspeed launcher and srun pass the first non-zero one on):

    0   the run finished
    1   a rank failed (raised, or lost its peers); it printed `stagecheck: rank N failed: ...`
    2   bad configuration or run directory, found at start-up (nothing was trained)
    3   non-finite loss or gradient norm under train.nan_policy=stop (or past nan_skip_limit)
    75  preempted (SIGTERM/SIGUSR1, or Ctrl-C's SIGINT): a checkpoint was saved; requeue and the run resumes
        (EX_TEMPFAIL)
    130 a second Ctrl-C (SIGINT) while the first one's checkpoint was pending: quit at once, nothing saved

A rank killed by a signal has no exit code of its own: the launcher reports -N (exit status 256-N),
srun reports the signal.
"""

import math
import os
import shutil
import socket
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch

from parallel.planning.shapes import GIB

EXIT_FAILED = 1
EXIT_CONFIG = 2
EXIT_NONFINITE = 3
EXIT_PREEMPTED = 75

# Test hooks, read from the environment so they never appear in a run's config or its W&B record.
TEST_FAIL_ENV = "STAGECHECK_TEST_FAIL"
"""`RANK:STEP`: that rank raises RuntimeError at the start of that step."""
TEST_SAVE_DELAY_ENV = "STAGECHECK_TEST_SAVE_DELAY"
"""`STEP:SECONDS`: rank 0 sleeps this long after writing its part of the checkpoint of that step, before
the barrier after which it moves `latest`, so a test can kill a rank in the middle of a save."""

_cleanups: list[Callable[[], None]] = []
_peers: list[tuple[str, int]] = []
"""(host name, pid) of every rank, by rank: lets a survivor name the rank that died."""


def on_failure(cleanup: Callable[[], None]) -> None:
    """Run `cleanup` (best effort) if this rank fails: e.g. finish the W&B run as failed."""
    _cleanups.append(cleanup)


def register_peers(peers: list[tuple[str, int]]) -> None:
    _peers[:] = peers


_PF_EXITING = 0x4
"""The kernel's flag for a process in its exit: set before its sockets close, while it still shows as running."""


def _alive(pid: int) -> bool:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        state, flags = fields[0], int(fields[6])
    except (OSError, IndexError, ValueError):
        return False
    # A zombie has died and its launcher has not reaped it yet. A killed rank's sockets close before it turns
    # zombie, so the survivor can see the broken connection while the state is still R: its exit flag says it.
    return state not in ("Z", "X") and not flags & _PF_EXITING


def gone_ranks(grace_s: float = 2.0) -> list[str]:
    """Ranks on this host whose process has died (others cannot be checked from here).

    Looks again for up to `grace_s`: a broken connection can reach this rank before the kernel has marked
    the peer that broke it as exiting, on a loaded host.
    """
    host = socket.gethostname()
    deadline = time.monotonic() + grace_s
    while True:
        gone = [
            f"rank {rank} (pid {pid})"
            for rank, (peer_host, pid) in enumerate(_peers)
            if peer_host == host and pid != os.getpid() and not _alive(pid)
        ]
        if gone or time.monotonic() >= deadline:
            return gone
        time.sleep(0.1)


def _describe(error: BaseException) -> str:
    text = f"{type(error).__name__}: {error}".strip()
    lowered = text.lower()
    timed_out = "timed out" in lowered or "timeout" in lowered
    if timed_out or any(word in lowered for word in ("connection closed", "connection reset", "broken pipe", "peer")):
        gone = gone_ranks()
        if gone:
            text += f" (the connection to another rank broke: {', '.join(gone)} died first)"
        elif timed_out:
            text += " (another rank did not answer within train.collective_timeout_s: it hung, or its host is gone)"
        else:
            text += " (the connection to another rank broke: it failed first, on another host: see its message)"
    return text


def run_guarded(rank: int, body: Callable[[], None]) -> None:
    """Run one rank's training; any exception ends this process at once with a message naming the rank.

    `os._exit` rather than a normal exit: after an error the interpreter's shutdown can block on a process
    group whose peers are gone, and a hung rank is what this must never leave behind.
    """
    try:
        body()
    except SystemExit:
        raise
    except KeyboardInterrupt:
        print(f"stagecheck: rank {rank} interrupted", file=sys.stderr, flush=True)
        _run_cleanups()
        os._exit(130)  # 128 + SIGINT, as a shell reports it
    except BaseException as error:  # noqa: BLE001 - every failure must end the process
        traceback.print_exc()
        print(f"stagecheck: rank {rank} failed: {_describe(error)}", file=sys.stderr, flush=True)
        _run_cleanups()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(EXIT_FAILED)


def _run_cleanups() -> None:
    for cleanup in reversed(_cleanups):
        try:
            cleanup()
        except BaseException:  # noqa: BLE001 - best effort on the way out
            pass


def _env_pair(name: str) -> tuple[float, float] | None:
    raw = os.environ.get(name)
    if not raw:
        return None
    first, _, second = raw.partition(":")
    try:
        return float(first), float(second)
    except ValueError:
        raise ValueError(f"environment variable {name}={raw!r} is invalid: expected two numbers A:B") from None


def maybe_fail_for_test(rank: int, step: int) -> None:
    pair = _env_pair(TEST_FAIL_ENV)
    if pair is not None and (int(pair[0]), int(pair[1])) == (rank, step):
        raise RuntimeError(f"injected failure at step {step} ({TEST_FAIL_ENV})")


def save_delay_for_test(rank: int, step: int) -> float:
    pair = _env_pair(TEST_SAVE_DELAY_ENV)
    return pair[1] if pair is not None and rank == 0 and int(pair[0]) == step else 0.0


# ---- non-finite steps ----------------------------------------------------------------------------------


def is_finite(value) -> bool:
    if value is None:
        return True
    return math.isfinite(float(value))


def install_nonfinite_guard(engine) -> bool:
    """Make a plain torch optimizer skip an update whose gradients hold NaN/inf, on every rank alike.

    DeepSpeed's bf16, fp16 and ZeRO optimizers already do this (they set `overflow` and the engine
    skips the step and the LR-scheduler step). The fp32 path hands the gradients straight to
    torch's AdamW, which would write NaN into every weight. The guard gives it the same behaviour:
    one all-reduce (MAX over all ranks, as every stage runs the optimizer step of each batch) of a
    "some gradient is not finite" flag; `overflow=True` tells the engine the step was skipped.
    Returns whether it was installed.
    """
    optimizer = engine.optimizer
    if hasattr(optimizer, "overflow"):
        return False
    real_step = optimizer.step
    device = _flag_device()

    def guarded_step(*args, **kwargs):
        grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        local = any(not bool(torch.isfinite(g).all()) for g in grads)
        flag = torch.tensor([1.0 if local else 0.0], device=device)
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
        optimizer.overflow = bool(flag.item() > 0)
        if optimizer.overflow:
            return None
        return real_step(*args, **kwargs)

    optimizer.step = guarded_step
    optimizer.overflow = False
    return True


def install_nan_injection(engine, steps: list[int]) -> None:
    """Debug/test (train.inject_nan_at_steps): the last stage's loss becomes NaN during those steps,
    so NaN gradients flow back through every stage as a real overflow's would."""
    if not steps or not engine.is_last_stage():
        return
    wanted = set(steps)
    module = engine.module
    real_loss = module.loss_fn

    def loss_fn(*args):  # (outputs, labels); a virtual-stage rank's adds the LM head's weight
        loss = real_loss(*args)
        # global_steps counts finished optimizer steps (restored on resume): this is step +1.
        return loss * float("nan") if engine.global_steps + 1 in wanted else loss

    module.loss_fn = loss_fn


def _flag_device() -> torch.device:
    if torch.distributed.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


# ---- output directory ----------------------------------------------------------------------------------


def checkpoint_bytes(n_params: int, precision: str) -> int:
    """Estimated size of one checkpoint: weights (4 bytes fp32, else 2 plus a 4-byte fp32 master copy)
    and Adam's two fp32 moments (8 bytes)."""
    weights = 4 if precision == "fp32" else 2 + 4
    return n_params * (weights + 8)


def probe_writable(run_dir: Path) -> None:
    """Create, write, sync and delete a small file: catches read-only mounts and full disks that
    os.access cannot see (and root, for whom os.access always says yes)."""
    probe = run_dir / f".stagecheck-probe-{os.getpid()}"
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            os.write(fd, b"\0" * 4096)
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError as error:
        raise ValueError(
            f"hydra.run.dir={str(run_dir)!r} is not writable ({error.strerror}): "
            f"choose a writable hydra.run.dir with free space"
        ) from None
    finally:
        try:
            probe.unlink()
        except OSError:
            pass


def check_free_space(
    run_dir: Path, n_params: int, precision: str, keep: int, free_bytes: int | None = None
) -> str | None:
    """Refuse a run whose first checkpoint cannot fit; return a warning when `keep` + 1 of them (the
    kept ones plus the one being written) may not fit."""
    need = checkpoint_bytes(n_params, precision)
    free = shutil.disk_usage(run_dir).free if free_bytes is None else free_bytes
    if free < need:
        raise ValueError(
            f"hydra.run.dir={str(run_dir)!r} has {free / GIB:.1f} GiB free, less than one checkpoint "
            f"(about {need / GIB:.1f} GiB: {n_params:,} parameters with their Adam state): free space or "
            f"choose another hydra.run.dir"
        )
    if free < need * (keep + 1):
        return (
            f"hydra.run.dir={str(run_dir)!r} has {free / GIB:.1f} GiB free; train.keep_checkpoints={keep} "
            f"plus the one being written need about {need * (keep + 1) / GIB:.1f} GiB"
        )
    return None


def check_output_dir(run_dir: Path, n_params: int, precision: str, keep: int, rank: int) -> None:
    """Start-up check that checkpoints can be written: raises ValueError (exit 2), warns on tight space."""
    probe_writable(run_dir)
    warning = check_free_space(run_dir, n_params, precision, keep)
    if warning and rank == 0:
        print(f"stagecheck: warning: {warning}", file=sys.stderr, flush=True)
