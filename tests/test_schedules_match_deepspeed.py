"""parallel/planning/schedules.py's 1F1B is DeepSpeed 0.19.8's `TrainSchedule`, step by step and instruction by
instruction, with the same pipe buffers; parallel/runtime/ds_schedule.py hands every planned programme to DeepSpeed
unchanged, in DeepSpeed's own classes (so `1f1b` without early recompute runs DeepSpeed's own schedule), and the
engine has a handler for each instruction it can be given. In-process: no process group."""

import itertools

import pytest
from deepspeed.runtime.pipe import schedule as ds

from parallel.planning import schedules as planned
from parallel.runtime.ds_schedule import DEEPSPEED_INSTRUCTION, deepspeed_schedule
from parallel.runtime.zero_bubble_engine import ZeroBubblePipelineEngine


def deepspeed_steps(schedule: ds.PipeSchedule) -> list[list[tuple[type, dict]]]:
    return [[(type(command), command.kwargs) for command in step] for step in schedule.steps()]


def planned_steps(program: planned.StageProgram) -> list[list[tuple[str, dict]]]:
    return [
        [
            (type(command).__name__, {"buffer_id": command.buffer_id} if hasattr(command, "buffer_id") else {})
            for command in step
        ]
        for step in program.steps
    ]


@pytest.mark.parametrize("stages", range(1, 9))
def test_our_1f1b_is_deepspeeds_train_schedule_step_by_step(stages):
    for micro_batches, stage in itertools.product(range(1, 13), range(stages)):
        theirs = ds.TrainSchedule(micro_batches=micro_batches, stages=stages, stage_id=stage)
        ours = planned.one_f_one_b(micro_batches, stages, stage)
        expected = [[(kind.__name__, kwargs) for kind, kwargs in step] for step in deepspeed_steps(theirs)]
        assert planned_steps(ours) == expected, (micro_batches, stages, stage)
        assert ours.pipe_buffers == theirs.num_pipe_buffers(), (micro_batches, stages, stage)
        assert planned.train_schedule("1f1b", False, micro_batches, stages, stage) == ours


@pytest.mark.parametrize("stages", range(1, 9))
def test_deepspeeds_own_1f1b_runs_through_the_adapter_unchanged(stages):
    """DeepSpeed's classes themselves (its handlers run them), the same buffer ids, the same buffers to allocate."""
    for micro_batches, stage in itertools.product(range(1, 13), range(stages)):
        theirs = ds.TrainSchedule(micro_batches=micro_batches, stages=stages, stage_id=stage)
        adapted = deepspeed_schedule("1f1b", False, micro_batches, stages, stage)
        assert deepspeed_steps(adapted) == deepspeed_steps(theirs), (micro_batches, stages, stage)
        assert adapted.num_pipe_buffers() == theirs.num_pipe_buffers()


@pytest.mark.parametrize("kind, early", itertools.product(planned.SCHEDULES, (False, True)))
def test_every_adapted_schedule_is_its_planned_programme(kind, early):
    """Every kind x early x deferral on 1..5 stages with 1..8 micro-batches: the adapter yields the planned steps,
    each instruction as a class of its name that the engine handles, with its buffer id and nothing else; iterating
    the schedule (as DeepSpeed's `_exec_schedule` does) gives the same steps."""
    handled = ZeroBubblePipelineEngine._INSTRUCTION_MAP
    for stages, micro_batches in itertools.product(range(1, 6), range(1, 9)):
        for stage, deferred in itertools.product(range(stages), (None, *range(stages + 1))):
            program = planned.train_schedule(kind, early, micro_batches, stages, stage, deferred)
            adapted = deepspeed_schedule(kind, early, micro_batches, stages, stage, deferred)
            steps = deepspeed_steps(adapted)
            assert [[(k.__name__, kwargs) for k, kwargs in step] for step in steps] == planned_steps(program)
            assert all(k in handled for step in steps for k, _ in step)
            assert [[(type(c), c.kwargs) for c in step] for step in adapted] == steps
            assert adapted.num_pipe_buffers() == program.pipe_buffers


def test_every_planned_instruction_has_a_deepspeed_class_and_a_handler():
    kinds = {
        kind
        for kind in vars(planned).values()
        if isinstance(kind, type)
        and issubclass(kind, planned.Command)
        and kind not in (planned.Command, planned.BufferCommand)
    }
    assert set(DEEPSPEED_INSTRUCTION) == kinds
    assert all(DEEPSPEED_INSTRUCTION[kind].__name__ == kind.__name__ for kind in kinds)
    assert set(DEEPSPEED_INSTRUCTION.values()) <= set(ZeroBubblePipelineEngine._INSTRUCTION_MAP)
