"""Every stage of a pipeline layout in one process, for the recompute benchmark and tests.

Each stage builds its own layers and applies its StagePlan (parallel/measurement/in_process.py's LocalStage) and runs
its own programme of the layout's schedule through the interpreter the engine runs
(parallel/runtime/stage_interpreter.py), with what DeepSpeed's engine keeps around each instruction; the stages talk
over in-process links. A step runs every stage's instructions, each stage as far as its messages allow, until all
are done. The optimizer step is the caller's: the gradients accumulate over the step's micro-batches, and each stage
keeps its own copy of a tied weight, with its own gradient.
"""

from collections import defaultdict, deque
from collections.abc import Sequence
from contextlib import ExitStack

import torch

from model import head_module
from model.fused_loss import HeadLoss
from parallel.measurement.in_process import LinkedNeighbours, LocalStage, LocalStageWork
from parallel.planning import schedules
from parallel.planning.layout import PipelineLayout
from parallel.planning.shapes import TORCH_DTYPES
from parallel.runtime.dropout_keys import DropoutKeys
from parallel.runtime.stage_interpreter import StageInterpreter


class LocalPipeline:
    def __init__(self, layout: PipelineLayout, precision: str = "fp32", compile: bool = False):
        self.layout = layout
        self.stages = [
            LocalStage(layout.recipes, s, p, precision, compile) for s, p in zip(layout.stages, layout.plans)
        ]
        self.loss = HeadLoss.of(layout.recipes)
        self.head_weight = head_module(self.stages[-1].funcs[-1]).head_weight
        self.dtype = TORCH_DTYPES[precision]
        self.steps = 0
        """Training steps run (each the caller's optimizer step): the next one's dropout key."""

    def parameters(self):
        return [p for stage in self.stages for p in stage.parameters()]

    def step(self, micro_batches: Sequence[tuple[torch.Tensor, torch.Tensor]], measure: bool = False) -> torch.Tensor:
        """Forward and backward of every (tokens, labels) micro-batch; gradients accumulate. Returns
        the mean loss. With `measure`, each stage's meter records every micro-batch."""
        layout, count = self.layout, len(micro_batches)
        stages = len(self.stages)
        config = layout.recipes[0].args[0]  # the token embedding's GPTConfig
        hidden = (micro_batches[0][0].shape[0], config.seq_len, config.n_embd)
        posted = schedules.posts_sends(layout.schedule, [p.early for p in layout.plans])
        pipes: defaultdict[tuple[int, int], deque[torch.Tensor]] = defaultdict(deque)
        runs = []
        for index, stage in enumerate(self.stages):
            early = stage.plan.early and index < stages - 1
            program = schedules.train_schedule(
                layout.schedule, early, count, stages, index, stage.plan.deferred_weights
            )
            work = LocalStageWork(
                stage, index, stages, self.loss, hidden, self.dtype, program.pipe_buffers, micro_batches.__getitem__
            )
            work.measure = measure
            work.start_step()
            links = LinkedNeighbours(pipes, index)
            interpreter = StageInterpreter(
                work,
                links,
                index,
                stages,
                count,
                layout.schedule,
                early,
                posted_sends=posted,
                dropout=DropoutKeys(layout.seed),
            )
            runs.append((interpreter, links, deque(program.steps), deque()))
        with ExitStack() as stack:
            for interpreter, *_ in runs:
                stack.enter_context(interpreter.training_step(self.steps))
            _run_until_done(runs)
        self.steps += 1
        return torch.stack(runs[-1][0].work.losses).mean()


def _run_until_done(runs: list[tuple[StageInterpreter, LinkedNeighbours, deque, deque]]) -> None:
    """Run each stage's instructions as far as its messages allow, round after round, until every stage is done."""
    while any(steps or commands for _, _, steps, commands in runs):
        progressed = False
        for index, (interpreter, links, steps, commands) in enumerate(runs):
            while commands or steps:
                if not commands:  # the next step (some steps of a stage have nothing to run)
                    interpreter.step = steps.popleft()
                    commands.extend(interpreter.step)
                    continue
                command = commands[0]
                if isinstance(command, schedules.RecvActivation) and not links.ready(index - 1):
                    break
                if isinstance(command, schedules.RecvGrad) and not links.ready(index + 1):
                    break
                interpreter.execute(commands.popleft())
                progressed = True
        if not progressed:
            raise RuntimeError("the local pipeline's stages wait for each other: a schedule that cannot run")
