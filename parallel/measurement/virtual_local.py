"""A pipeline with virtual stages in one process: every rank's programme of parallel/planning/virtual_schedules.py run
through the interpreter the engine runs (parallel/runtime/stage_interpreter.py), one interpreter per chunk, over
in-process links between the virtual stages, for tests and benchmarks.

The layout's stages are the virtual stages (ranks x chunks of them, in pipeline order), each built and planned as a
stage of its own (parallel/measurement/in_process.py's LocalStage): a chunk boundary is a stage boundary, so no
full-recompute segment crosses one. Each chunk keeps its micro-batch's tensors in the buffer of that micro-batch. A
rank's instruction goes to the interpreter of its chunk, with the micro-batch as the buffer; the once-per-step
instructions go to every chunk of the rank. Each chunk's work is the engine's own (parallel/runtime/chunk_work.py's
ChunkStageWork, a fresh one per step as the engine makes it), so a chunk keeps here the tensors it keeps on a rank of
the engine (not what the engine's boundary links and DeepSpeed add), and its backward scales the loss by
1 / micro-batches as DeepSpeed's does. As in
parallel/measurement/local_stages.py, the optimizer step is the caller's, and each chunk keeps its own copy of a tied
weight, with its own gradient.
"""

from collections import defaultdict, deque
from collections.abc import Sequence
from contextlib import ExitStack

import torch

from model.fused_loss import HeadLoss
from parallel.measurement.in_process import LinkedNeighbours, LocalStage
from parallel.planning import schedules
from parallel.planning.layout import PipelineLayout
from parallel.planning.shapes import TORCH_DTYPES
from parallel.planning.stage_plan import early_stages
from parallel.planning.virtual_program import ChunkCommand, VirtualProgram
from parallel.planning.virtual_schedules import virtual_schedule
from parallel.runtime.chunk_work import ChunkStageWork, MicroBatchSource
from parallel.runtime.dropout_keys import DropoutKeys
from parallel.runtime.stage_interpreter import StageInterpreter, Transport
from parallel.runtime.virtual_rank import backward_kind, execute


class VirtualLocalPipeline:
    def __init__(self, layout: PipelineLayout, schedule: str, chunks: int, precision: str = "fp32"):
        if len(layout.stages) % chunks:
            raise ValueError(f"{len(layout.stages)} stages do not split into {chunks} chunks per rank")
        self.layout, self.schedule, self.chunks = layout, schedule, chunks
        self.ranks = len(layout.stages) // chunks
        self.stages = [LocalStage(layout.recipes, s, p, precision) for s, p in zip(layout.stages, layout.plans)]
        self.loss = HeadLoss.of(layout.recipes)
        self.dtype = TORCH_DTYPES[precision]
        self.steps = 0
        """Training steps run (each the caller's optimizer step): the next one's dropout key."""

    def parameters(self):
        return [p for stage in self.stages for p in stage.parameters()]

    def step(self, micro_batches: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """Forward and backward of every (tokens, labels) micro-batch; gradients accumulate, each micro-batch's scaled
        by 1 / the micro-batches. Returns the mean loss."""
        count = len(micro_batches)
        programs = virtual_schedule(
            self.schedule, count, self.ranks, self.chunks, self.layout.virtual_slots, early_stages(self.layout.plans)
        )
        pipes: defaultdict[tuple[int, int], deque[torch.Tensor]] = defaultdict(deque)
        interpreters = [
            chunk_interpreter(self, index, programs[0], LinkedNeighbours(pipes, index), micro_batches.__getitem__)
            for index in range(len(self.stages))
        ]
        with ExitStack() as stack:
            for interpreter in interpreters:
                stack.enter_context(interpreter.training_step(self.steps))
            _run_until_done(programs, interpreters)
        self.steps += 1
        return torch.stack(interpreters[-1].work.step_losses).mean()


def chunk_interpreter(
    pipe: "VirtualLocalPipeline", index: int, program: VirtualProgram, transport: Transport, data: MicroBatchSource
) -> StageInterpreter:
    """The interpreter of virtual stage `index` of `pipe` for a step of `program`'s micro-batches, each in a buffer of
    its own, its sends and receives over `transport` (between virtual stages)."""
    config = pipe.layout.recipes[0].args[0]  # the token embedding's GPTConfig
    count, virtual = program.micro_batches, len(pipe.stages)
    hidden = (data(0)[0].shape[0], config.seq_len, config.n_embd)
    work = ChunkStageWork(pipe.stages[index], index, virtual, pipe.loss, hidden, pipe.dtype, count, data, None)
    return StageInterpreter(
        work,
        transport,
        index,
        virtual,
        count,
        backward_kind(program),
        early=index in early_stages(pipe.layout.plans),
        posted_sends=False,  # in-process links queue every send
        dropout=DropoutKeys(pipe.layout.seed),
    )


def _run_until_done(programs: list[VirtualProgram], interpreters: list[StageInterpreter]) -> None:
    """Run each rank's instructions as far as its messages allow, round after round, until every rank is done."""
    queues = [deque(program.commands()) for program in programs]
    while any(queues):
        progressed = False
        for program, queue in zip(programs, queues):
            while queue:
                command = queue[0]
                if command.kind is schedules.RecvActivation and not _arrived(interpreters, command, -1):
                    break
                if command.kind is schedules.RecvGrad and not _arrived(interpreters, command, 1):
                    break
                execute(program, interpreters, queue.popleft())
                progressed = True
        if not progressed:
            raise RuntimeError("the virtual stages wait for each other: a schedule that cannot run")


def _arrived(interpreters: list[StageInterpreter], receive: ChunkCommand, side: int) -> bool:
    return interpreters[receive.stage].transport.ready(receive.stage + side)
