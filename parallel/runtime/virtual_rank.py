"""A rank's programme of a virtual-stage schedule (parallel/planning/virtual_schedules.py) run through the one
interpreter of a stage's programme (parallel/runtime/stage_interpreter.py), one interpreter per chunk: each
instruction goes to the interpreter of its chunk, with the micro-batch as the buffer, and the once-per-step
instructions to every chunk of the rank. The engine (parallel/runtime/virtual_engine.py), the stage replay and the
in-process pipeline (parallel/measurement/virtual_replay.py, virtual_local.py) all dispatch through `execute`."""

from collections.abc import Sequence
from contextlib import AbstractContextManager, ExitStack, nullcontext
from typing import Protocol

from parallel.planning import schedules
from parallel.planning.virtual_program import ChunkCommand, VirtualProgram
from parallel.planning.virtual_sim import EXCHANGE, RECEIVE_WAIT
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
    """Every instruction of the rank's `program` for the training step after `step` optimizer steps: each step's
    messages posted as one `batch` at its boundary, each received message waited for by the computation that reads it
    (parallel/runtime/boundary_links.py), every message complete before the once-per-step instructions. `observer`
    times, on a traced step, each computation and once-per-step instruction, each boundary's post (EXCHANGE) and each
    wait for a message (RECEIVE_WAIT); a communication instruction only notes its message for the batch."""

    def timed(name: str, micro_batch: int | None = None, stage: int | None = None) -> AbstractContextManager:
        return observer.instruction(name, micro_batch, virtual_stage=stage) if observer else nullcontext()

    completed = False
    with ExitStack() as stack:
        for interpreter in interpreters:
            if interpreter is not None:
                stack.enter_context(interpreter.training_step(step))
        for step in program.steps:
            for command in step:
                if command.kind in schedules.COMMUNICATION:
                    with batch.noting(command.message()):
                        execute(program, interpreters, command)
                    continue
                if command.micro_batch is None and not completed:  # the once-per-step ones follow the last boundary
                    if batch.pending:
                        with timed(EXCHANGE):
                            batch.post()
                    with timed(EXCHANGE):
                        batch.complete()
                    completed = True
                message = program.message_read(command)
                if message is not None:
                    with timed(RECEIVE_WAIT, command.micro_batch, command.stage):
                        batch.wait_for(message)
                with timed(command.name, command.micro_batch, command.stage):
                    execute(program, interpreters, command)
            if batch.pending:
                with timed(EXCHANGE):
                    batch.post()
