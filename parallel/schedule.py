"""What DeepSpeed's 1F1B training schedule keeps per stage, read from its own TrainSchedule (pure:
no process group)."""

from deepspeed.runtime.pipe.schedule import BackwardPass, ForwardPass, TrainSchedule


def in_flight_micro_batches(micro_batches: int, stages: int, stage_id: int) -> int:
    """The most micro-batches whose activations stage `stage_id` holds at once: walk DeepSpeed's own
    1F1B TrainSchedule (forward passes not yet matched by their backward pass)."""
    live = peak = 0
    for commands in TrainSchedule(micro_batches=micro_batches, stages=stages, stage_id=stage_id).steps():
        for command in commands:
            if isinstance(command, ForwardPass):
                live += 1
                peak = max(peak, live)
            elif isinstance(command, BackwardPass):
                live -= 1
    return peak


def pipe_buffers(micro_batches: int, stages: int, stage_id: int) -> int:
    """Pipe buffers DeepSpeed allocates on the stage (at least 2, even when fewer are in flight)."""
    return TrainSchedule(micro_batches=micro_batches, stages=stages, stage_id=stage_id).num_pipe_buffers()
