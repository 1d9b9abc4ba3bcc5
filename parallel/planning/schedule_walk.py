"""What a stage's training schedule keeps, read by walking the schedule itself (parallel/planning/schedules.py:
DeepSpeed's 1F1B, or ZB-H1, with or without early recompute; pure: no process group)."""

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache

from parallel.planning import schedules


@dataclass(frozen=True)
class ActivationPeak:
    """The most activation bytes a stage holds at once over a step, and what is live then."""

    bytes: int
    in_flight: int
    """Micro-batches forwarded and not yet through their backward (B): each keeps what its plan keeps."""
    weights_pending: int
    """Micro-batches through B whose W has not run (zb-h1): each holds what its Linears' W's need."""
    recomputed: int
    """Micro-batches recomputed early whose backward has not run (0 or 1): each holds its recomputed
    activations besides what its plan keeps."""
    working_set: int = 0
    """Of `bytes`, the transient of the backward running at the peak (0 when the peak is not inside one)."""
    backward_of: int | None = None
    """The micro-batch whose backward runs at the peak (None when the peak is between instructions)."""
    posted_grads: int = 0
    """Gradient sends posted and still held at the peak (a middle stage under posted sends)."""


def activation_peak(
    schedule: str,
    early: bool,
    kept: Sequence[int],
    weights_pending: int,
    recomputed: Sequence[int],
    micro_batches: int,
    stages: int,
    stage: int,
    deferred: int | None = None,
    transient: Sequence[int] | None = None,
    posted_grad_bytes: int = 0,
) -> ActivationPeak:
    """Walk the stage's schedule and return its peak. Per micro-batch k: `kept[k]` bytes from its forward to
    its backward, `recomputed[k]` more from its RecomputeEarly to its backward (what the plan would keep
    with no recompute, minus what it keeps), `weights_pending` bytes from its B to its W (zb-h1).

    Live bytes are counted after each instruction, except right after a B that a W follows at once: there
    the W's belong to the same backward (as in 1F1B's own backward, whose transient gradients the model does
    not count either), and the state after them counts. `deferred`: ZB-H1's deferral (parallel/planning/schedules.py).
    `transient[k]`: bytes micro-batch k's backward allocates on top while it runs (its working set: a full-recompute
    segment remade inside it, the gradients of its largest node), counted inside each backward, before it frees
    the micro-batch's activations; None counts the state between instructions only. `posted_grad_bytes`: one
    input gradient that the engine's posted SendGrad holds until it is surely received
    (schedules.grad_sends_released), counted from its SendGrad to its release (0: none held)."""
    program = _instruction_names(schedule, early, micro_batches, stages, stage, deferred)
    released_at = schedules.grad_sends_released(micro_batches, stages, stage)
    forwards = backwards = weights = 0  # counts so far: micro-batch k is the k-th of each kind
    grads_sent = grads_released = activations_received = 0
    early_live: int | None = None
    best = ActivationPeak(0, 0, 0, 0)

    def held(in_backward: bool = False) -> ActivationPeak:
        pending = backwards - weights if schedule == "zb-h1" else 0
        working_set = transient[backwards] if in_backward else 0
        posted = grads_sent - grads_released if posted_grad_bytes else 0
        live = sum(kept[backwards:forwards]) + pending * weights_pending + working_set + posted * posted_grad_bytes
        live += recomputed[early_live] if early_live is not None else 0
        running = backwards if in_backward else None
        recomputing = int(early_live is not None)
        return ActivationPeak(live, forwards - backwards, pending, recomputing, working_set, running, posted)

    for i, name in enumerate(program):
        if name == "SendGrad":
            grads_sent += 1
            continue
        if name == "RecvActivation":
            grads_released = max(grads_released, released_at[activations_received])
            activations_received += 1
            continue
        if name == "ForwardPass":
            forwards += 1
        elif name in ("BackwardPass", "BackwardInput"):
            if transient is not None:  # inside the backward: everything still held, and its working set
                best = max(best, held(in_backward=True), key=lambda peak: peak.bytes)
            backwards += 1
            early_live = None
        elif name == "BackwardWeight":
            weights += 1
        elif name == "RecomputeEarly":
            early_live = backwards  # the next backward's micro-batch
        else:
            continue
        if name == "BackwardInput" and i + 1 < len(program) and program[i + 1] == "BackwardWeight":
            continue
        best = max(best, held(), key=lambda peak: peak.bytes)
    return best


@cache
def _instruction_names(
    schedule: str, early: bool, micro_batches: int, stages: int, stage: int, deferred: int | None
) -> tuple[str, ...]:
    commands = schedules.train_schedule(schedule, early, micro_batches, stages, stage, deferred).commands()
    return tuple(type(command).__name__ for command in commands)


@cache
def in_flight_micro_batches(micro_batches: int, stages: int, stage_id: int) -> int:
    """The most micro-batches whose activations stage `stage_id` holds at once under DeepSpeed's own 1F1B
    (forward passes not yet matched by their backward pass)."""
    ones, zeros = [1] * micro_batches, [0] * micro_batches
    return activation_peak("1f1b", False, ones, 0, zeros, micro_batches, stages, stage_id).in_flight


def pipe_buffers(micro_batches: int, stages: int, stage_id: int) -> int:
    """Pipe buffers DeepSpeed allocates on the stage (at least 2, even when fewer are in flight). Every
    schedule of parallel/planning/schedules.py keeps 1F1B's buffers."""
    return schedules.pipe_buffers(micro_batches, stages, stage_id)
