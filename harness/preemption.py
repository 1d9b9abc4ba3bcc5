"""Preemption: SIGTERM or SIGUSR1 on any rank asks the whole run to checkpoint and exit.

The handler only records the request; the step loop turns it into a decision at the next step
boundary, where every rank takes part in one all-reduce (MAX) of the flag, so all ranks save the same
step and exit together with faults.EXIT_PREEMPTED (75). See docs/preemption.md for the contract with
the batch script (SLURM `--signal=B:USR1@...`, forwarding, `scontrol requeue`).

Later signals while a request is pending are ignored: SLURM sends SIGTERM at the time limit after the
warning USR1, and the deepspeed launcher sends SIGTERM to the other ranks when one rank exits; neither
may interrupt a save in progress (the launcher and SLURM follow up with SIGKILL on their own).
"""

import os
import signal
import threading

SIGNALS = (signal.SIGTERM, signal.SIGUSR1)

_requested: int | None = None
_rank = 0


def _handler(signum, frame) -> None:
    global _requested
    if _requested is None:
        _requested = signum
        # os.write, not print: the handler may interrupt a print to the same stream.
        os.write(
            2,
            f"stagecheck: rank {_rank} got {signal.Signals(signum).name}: saving a checkpoint at the "
            f"end of this step, then exiting\n".encode(),
        )


def install(rank: int) -> None:
    """Catch SIGTERM and SIGUSR1 in this process (the main thread; a no-op elsewhere)."""
    global _rank
    _rank = rank
    if threading.current_thread() is not threading.main_thread():
        return
    for signum in SIGNALS:
        signal.signal(signum, _handler)


def ignore_from_now() -> None:
    """SIG_IGN for SIGTERM and SIGUSR1 for the rest of this process, once it is exiting on purpose.

    The Python handler above is not enough then: interpreter shutdown resets handlers written in Python
    to the default before it frees the modules (torch, the process group: seconds), while
    `srun --kill-on-bad-exit=1` sends SIGTERM to the other ranks as soon as the first one has exited 75.
    A slower rank then died by that SIGTERM and srun reported 143, not 75, so the job was not requeued
    (seen with launch/slurm.sbatch on the 2-node test Slurm). SIG_IGN survives shutdown."""
    if threading.current_thread() is not threading.main_thread():
        return
    for signum in SIGNALS:
        signal.signal(signum, signal.SIG_IGN)


def requested() -> int | None:
    """The first preemption signal received by this rank, or None."""
    return _requested
