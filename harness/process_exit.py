"""How a train.py process ends: its Python exit handlers run (the process group destroyed, W&B and the logs closed),
stdio is flushed, and the process then exits with its code, skipping the interpreter's finalization and the C
library's exit handlers, where torch's C++ statics are torn down.

Why: in that teardown a thread a library left joinable (gloo's, or kineto's after the tensor-peak meter's profiler
window: pytorch#195837 fixes two such exit-time lifetime bugs of the profiler) can abort a process that has finished
and written everything ("terminate called without an active exception", SIGABRT): seen in 4 of about 230 launches of
bench/planner_regret.py and in one launch of a make test run on 2026-12-04, each a finished run that the launcher, a
SLURM job or a test then counted as failed. Destroying the process group at exit (parallel/runtime/engine.py) made it
rarer, not gone."""

import atexit
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager

import torch.distributed as dist


@contextmanager
def exit_after_cleanup() -> Iterator[None]:
    """Around the entry point: once a process group exists (the run trained), a normal return or a SystemExit ends the
    process as described above, with the same exit code and message Python would give. Before (a dry run, a start-up
    refusal) the process ends as Python ends it: a refusal's message comes from rank 0 alone, and a rank that exited at
    once would have the launcher kill rank 0 before it printed. Any other exception passes through, as Python reports
    it."""
    try:
        yield
        code = 0
    except SystemExit as stop:
        if not dist.is_initialized():
            raise
        code = stop.code
    if not dist.is_initialized():
        return
    if code is None:
        code = 0
    elif not isinstance(code, int):  # sys.exit("message"): Python prints it and exits 1
        print(code, file=sys.stderr)
        code = 1
    atexit._run_exitfuncs()  # what a normal exit runs first: every handler registered so far, in reverse order
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(code)
