"""Preemption: SIGTERM, SIGUSR1 or SIGINT (Ctrl-C) on any rank asks the whole run to checkpoint and exit.

The handler only records the request; the step loop turns it into a decision at the next step
boundary, where every rank takes part in one all-reduce (MAX) of the flag, so all ranks save the same
step and exit together with faults.EXIT_PREEMPTED (75). See docs/preemption.md for the contract with
the batch script (SLURM `--signal=B:USR1@...`, forwarding, `scontrol requeue`).

Later signals while a request is pending are ignored: SLURM sends SIGTERM at the time limit after the
warning USR1, and the deepspeed launcher sends SIGTERM to the other ranks when one rank exits; neither
may interrupt a save in progress (the launcher and SLURM follow up with SIGKILL on their own). A SIGINT after
a first one is the exception: a second Ctrl-C means "stop now", so the rank quits at once with 130, saving
nothing.
"""

import os
import signal
import threading

SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)
EXIT_INTERRUPTED = 130  # 128 + SIGINT, what a shell reports for a command ended by Ctrl-C

_requested: int | None = None
_rank = 0


def _handler(signum, frame) -> None:
    global _requested
    if _requested == signal.SIGINT and signum == signal.SIGINT:  # the second Ctrl-C
        os.write(2, f"stagecheck: rank {_rank} got SIGINT again: quitting now, without a checkpoint\n".encode())
        os._exit(EXIT_INTERRUPTED)  # no traceback, no wait on peers or on the save this interrupts
    if _requested is None:
        _requested = signum
        # os.write, not print: the handler may interrupt a print to the same stream.
        os.write(
            2,
            f"stagecheck: rank {_rank} got {signal.Signals(signum).name}: saving a checkpoint at the "
            f"end of this step, then exiting\n".encode(),
        )


def quit_on_interrupt() -> None:
    """Until `install`: Ctrl-C quits at once with 130 and one line (rank 0's), not a KeyboardInterrupt traceback
    from wherever start-up was; nothing has been trained, so nothing is lost."""

    def quit_now(signum, frame) -> None:
        if os.environ.get("RANK", "0") == "0":
            os.write(2, b"stagecheck: interrupted (SIGINT) during start-up: nothing was trained\n")
        os._exit(EXIT_INTERRUPTED)

    signal.signal(signal.SIGINT, quit_now)


def install(rank: int) -> None:
    """Catch SIGTERM, SIGUSR1 and SIGINT in this process (the main thread; a no-op elsewhere)."""
    global _rank
    _rank = rank
    if threading.current_thread() is not threading.main_thread():
        return
    for signum in SIGNALS:
        signal.signal(signum, _handler)


def ignore_from_now(signums: tuple[signal.Signals, ...] = SIGNALS) -> None:
    """SIG_IGN for `signums` (SIGTERM, SIGUSR1 and SIGINT) for the rest of this process, once it is exiting on purpose.

    The Python handler above is not enough then: interpreter shutdown resets handlers written in Python
    to the default before it frees the modules (torch, the process group: seconds), while
    `srun --kill-on-bad-exit=1` sends SIGTERM to the other ranks as soon as the first one has exited 75.
    A slower rank then died by that SIGTERM and srun reported 143, not 75, so the job was not requeued
    (seen with launch/slurm.sbatch on the 2-node test Slurm). SIG_IGN survives shutdown."""
    if threading.current_thread() is not threading.main_thread():
        return
    for signum in signums:
        signal.signal(signum, signal.SIG_IGN)


def requested() -> int | None:
    """The first preemption signal received by this rank, or None."""
    return _requested
