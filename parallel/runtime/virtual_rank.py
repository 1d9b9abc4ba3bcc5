"""A rank's programme of a virtual-stage schedule (parallel/planning/virtual_schedules.py) run through the one
interpreter of a stage's programme (parallel/runtime/stage_interpreter.py), one interpreter per chunk: each
instruction goes to the interpreter of its chunk, with the micro-batch as the buffer, and the once-per-step
instructions to every chunk of the rank. The engine (parallel/runtime/virtual_engine.py), the stage replay and the
in-process pipeline (parallel/measurement/virtual_replay.py, virtual_local.py) all dispatch through `execute`."""

from collections.abc import Sequence
from contextlib import AbstractContextManager, ExitStack, nullcontext
from typing import Protocol

from parallel.planning import schedules
from parallel.planning.virtual_schedules import ChunkCommand, VirtualProgram
from parallel.planning.virtual_sim import EXCHANGE
from parallel.runtime.boundary_links import BoundaryBatch
from parallel.runtime.stage_interpreter import StageInterpreter


class ProgrammeObserver(Protocol):
    """Times a traced step's instructions (parallel/measurement/trace.py's StepRecorder)."""

    def instruction(
        self, name: str, micro_batch: int | None, buffer_id: int | None = None, virtual_stage: int | None = None
    ) -> AbstractContextManager: ...


def execute(program: VirtualProgram, interpreters: Sequence[StageInterpreter | None], command: ChunkCommand) -> None:
    """A rank's instruction on its chunk's interpreter (`interpreters` by virtual stage), with the micro-batch as the
    buffer; a once-per-step instruction on each of the rank's chunks."""
    if command.stage is None:  # once per step: on every chunk of the rank
        for chunk in range(program.chunks):
            interpreters[program.placement.virtual_stage(program.rank, chunk)].execute(command.kind())
        return
    interpreters[command.stage].execute(command.kind(command.micro_batch))


def backward_kind(program: VirtualProgram) -> str:
    """The interpreter's schedule for a chunk of `program`: zb-h1 where the programme splits the backward into B and
    W (its forwards then run the Linear layers through the Function whose weight gradient B can defer), else 1f1b."""
    return "zb-h1" if any(c.kind is schedules.BackwardWeight for c in program.commands()) else "1f1b"


def run_training_step(
    program: VirtualProgram,
    interpreters: Sequence[StageInterpreter | None],
    batch: BoundaryBatch,
    step: int,
    observer: ProgrammeObserver | None = None,
) -> None:
    """Every instruction of the rank's `program` for the training step after `step` optimizer steps, each boundary's
    messages posted as one `batch`: flushed at the end of each step and before the once-per-step instructions, which
    follow the last boundary's messages. `observer` times each computation and once-per-step instruction, and each
    boundary's batch (EXCHANGE), on a traced step: a communication instruction only notes its message for the batch."""

    def timed(name: str, micro_batch: int | None = None, stage: int | None = None) -> AbstractContextManager:
        return observer.instruction(name, micro_batch, virtual_stage=stage) if observer else nullcontext()

    def flush() -> None:
        if batch.pending:
            with timed(EXCHANGE):
                batch.flush()

    with ExitStack() as stack:
        for interpreter in interpreters:
            if interpreter is not None:
                stack.enter_context(interpreter.training_step(step))
        for step in program.steps:
            for command in step:
                if command.kind in schedules.COMMUNICATION:
                    execute(program, interpreters, command)
                    continue
                flush()
                with timed(command.name, command.micro_batch, command.stage):
                    execute(program, interpreters, command)
            flush()
