"""The programmes of parallel/planning/schedules.py as DeepSpeed `PipeSchedule`s: the one place where a planned
instruction becomes DeepSpeed's.

Each instruction DeepSpeed has becomes DeepSpeed's own class, so DeepSpeed's handlers run it; B, W and the early
recompute become the three `BufferOpInstruction`s below, which parallel/runtime/zero_bubble_engine.py handles.
An instruction is DeepSpeed's class of the same name with the same `buffer_id`, so a traced step names each one as
the planner and the simulator do (tests/test_schedules_match_deepspeed.py checks it, and that `1f1b` without early
recompute is DeepSpeed's own `TrainSchedule`, instruction for instruction).
"""

from collections.abc import Callable

from deepspeed.runtime.pipe import schedule as ds

from parallel.planning import schedules as planned


class BackwardInput(ds.BufferOpInstruction):
    """DeepSpeed's form of parallel/planning/schedules.py's BackwardInput (B)."""


class BackwardWeight(ds.BufferOpInstruction):
    """DeepSpeed's form of parallel/planning/schedules.py's BackwardWeight (W)."""


class RecomputeEarly(ds.BufferOpInstruction):
    """DeepSpeed's form of parallel/planning/schedules.py's RecomputeEarly."""


DEEPSPEED_INSTRUCTION: dict[type[planned.Command], type[ds.PipeInstruction]] = {
    planned.LoadMicroBatch: ds.LoadMicroBatch,
    planned.ForwardPass: ds.ForwardPass,
    planned.BackwardPass: ds.BackwardPass,
    planned.SendActivation: ds.SendActivation,
    planned.RecvActivation: ds.RecvActivation,
    planned.SendGrad: ds.SendGrad,
    planned.RecvGrad: ds.RecvGrad,
    planned.ReduceTiedGrads: ds.ReduceTiedGrads,
    planned.ReduceGrads: ds.ReduceGrads,
    planned.OptimizerStep: ds.OptimizerStep,
    planned.BackwardInput: BackwardInput,
    planned.BackwardWeight: BackwardWeight,
    planned.RecomputeEarly: RecomputeEarly,
}
"""Each planned instruction's DeepSpeed class."""


def to_deepspeed(command: planned.Command) -> ds.PipeInstruction:
    kind = DEEPSPEED_INSTRUCTION[type(command)]
    return kind(command.buffer_id) if isinstance(command, planned.BufferCommand) else kind()


class PlannedSchedule(ds.PipeSchedule):
    """A stage's planned programme for DeepSpeed's `PipelineEngine._exec_schedule`: its steps in DeepSpeed's
    instructions, and the programme's own pipe buffers (its buffer ids count in them; they are DeepSpeed's
    `TrainSchedule.num_pipe_buffers()`)."""

    def __init__(self, program: planned.StageProgram):
        super().__init__(micro_batches=program.micro_batches, stages=program.stages, stage_id=program.stage_id)
        self.program = program
        self.on_step: Callable[[planned.Step], None] = lambda step: None
        """Told each planned step before the engine runs its instructions (the interpreter reads how the step
        communicates)."""

    def steps(self):
        for step in self.program.steps:
            self.on_step(step)
            yield [to_deepspeed(command) for command in step]

    def num_pipe_buffers(self) -> int:
        return self.program.pipe_buffers


def deepspeed_schedule(
    kind: str, early: bool, micro_batches: int, stages: int, stage_id: int, deferred: int | None = None
) -> PlannedSchedule:
    """parallel/planning/schedules.py's `train_schedule`, for DeepSpeed's engine."""
    return PlannedSchedule(planned.train_schedule(kind, early, micro_batches, stages, stage_id, deferred))
