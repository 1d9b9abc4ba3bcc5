"""The training schedules a stage can run, as pure instruction programmes (no DeepSpeed, no process group);
parallel/runtime/ds_schedule.py hands them to DeepSpeed's engine.

`1f1b` is DeepSpeed 0.19.8's synchronous 1F1B (`TrainSchedule`), written out here instruction for instruction
(tests/test_schedules_match_deepspeed.py compares the two). `zb-h1` is ZB-H1 (Qi et al., "Zero Bubble Pipeline
Parallelism", ICLR'24): the backward pass splits into B (`BackwardInput`: the input gradient, which the previous
stage waits for, and every gradient that is not deferred) and W (`BackwardWeight`: the Linear layers' weight
gradients, which nobody waits for), and W's run later, where the stage would otherwise wait. `early=True` runs the
plan's recompute of a micro-batch as its own instruction (`RecomputeEarly`) before the stage blocks on that
micro-batch's gradient (Mario, PPoPP'25), instead of inside its backward.

Both are rewrites of the 1F1B programme that add only local instructions and keep its communication in its
order, but for each step's SendActivation, sent first (`_sends_first`). Under a rendezvous transport (a send blocks
until its recv is posted: gloo's blocking send; NCCL once a message outgrows its buffers, where a pair of ranks'
transfers also run in order on one stream) whether a schedule deadlocks depends only on how each stage posts its
communication (`p2p_batches`): a stage sending its activation first would meet its neighbour sending its gradient
first, so the engine posts such a step's SendActivation and RecvGrad as one batch, and every send then meets its
receive in the same batch or an earlier one on the peer (tests/test_pipe_schedule.py replays
every shape under strict rendezvous). Every per-micro-batch kind still runs in micro-batch order on every
stage, so the k-th of a kind is micro-batch k (parallel/measurement/trace.py and parallel/planning/step_sim.py
rely on it), and the pipe buffers are 1F1B's: a buffer is live from its forward to its B, and neither rewrite
changes that.
"""

from collections.abc import Sequence
from dataclasses import dataclass, replace
from functools import cache

SCHEDULES = ("1f1b", "zb-h1")
"""The concrete schedules (`parallel.schedule=auto` resolves to one of them at planning time)."""


@dataclass(frozen=True)
class Command:
    """One instruction of a stage's programme. Its class name is its name everywhere: DeepSpeed's instruction of
    that name runs it, and the simulator and the trace report it so."""


@dataclass(frozen=True)
class BufferCommand(Command):
    buffer_id: int
    """The pipe buffer it works on: micro-batch m's is m % the stage's pipe buffers."""


class LoadMicroBatch(BufferCommand):
    """The next micro-batch's inputs (first stage) or labels (last stage) into the buffer."""


class ForwardPass(BufferCommand):
    """The stage's forward pass of the micro-batch in the buffer."""


class BackwardPass(BufferCommand):
    """The stage's whole backward pass of the micro-batch in the buffer (1F1B)."""


class SendActivation(BufferCommand):
    """The forward's output to the next stage."""


class RecvActivation(BufferCommand):
    """The forward's input from the previous stage."""


class SendGrad(BufferCommand):
    """The gradient of the stage's input to the previous stage."""


class RecvGrad(BufferCommand):
    """The gradient of the stage's output from the next stage."""


class BackwardInput(BufferCommand):
    """B: the backward pass of the micro-batch in the buffer that computes the input gradient (sent upstream by the
    SendGrad that follows) and every gradient that is not deferred; the Linear layers' weight gradients go to the
    weight-gradient store for a later BackwardWeight."""


class BackwardWeight(BufferCommand):
    """W: the deferred weight gradients of one micro-batch. W's run in micro-batch order on every stage (the k-th W
    is micro-batch k); `buffer_id` is that micro-batch's buffer, for the trace only (the buffer itself may already
    hold a later micro-batch)."""


class RecomputeEarly(BufferCommand):
    """The plan's recompute of the micro-batch in the buffer, ahead of its backward, right before the stage blocks
    on that micro-batch's RecvGrad. Never on the last stage: its backward follows its forward."""


class ReduceTiedGrads(Command):
    """The tied embedding's gradient summed over the stages that hold it; every deferred W and early recompute must
    have run before it."""


class ReduceGrads(Command):
    """The gradients averaged over the stage's data-parallel ranks."""


class OptimizerStep(Command):
    """Clip, step the optimizer and the learning rate, zero the gradients."""


Step = tuple[Command, ...]


@dataclass(frozen=True)
class StageProgram:
    """What stage `stage_id` runs in one training step, in steps (a step's instructions run in order, and a barrier
    between two steps could not deadlock)."""

    micro_batches: int
    stages: int
    stage_id: int
    steps: tuple[Step, ...]

    @property
    def pipe_buffers(self) -> int:
        return pipe_buffers(self.micro_batches, self.stages, self.stage_id)

    def commands(self) -> list[Command]:
        return [command for step in self.steps for command in step]


def pipe_buffers(micro_batches: int, stages: int, stage_id: int) -> int:
    """The buffers 1F1B cycles through on a stage: as many as it holds micro-batches at once (`stages - stage_id`,
    or every micro-batch when there are fewer), and at least 2, as DeepSpeed allocates them."""
    return max(2, min(stages - stage_id, micro_batches))


def _work_of_step(step: int, micro_batches: int, stages: int, stage_id: int) -> tuple[int | None, bool]:
    """(micro-batch or None, forward?) that 1F1B computes in `step` on the stage. Micro-batch m's forward runs in
    step 2m + stage_id (one step per stage downstream); its backward in step 2m + 2 * stages - 1 - stage_id (on the
    last stage the step after its forward, then one step per stage upstream). So the stage alternates forward and
    backward steps, forward ones where `step - stage_id` is even; at both ends some steps have none to run."""
    forward = (step - stage_id) % 2 == 0
    micro_batch = (step - stage_id) // 2 if forward else (step - 2 * stages + 1 + stage_id) // 2
    return (micro_batch if 0 <= micro_batch < micro_batches else None), forward


@cache  # programmes are immutable, and the planner asks for the same one thousands of times per plan
def one_f_one_b(micro_batches: int, stages: int, stage_id: int) -> StageProgram:
    """DeepSpeed's synchronous 1F1B: 2 * (micro_batches + stages - 1) steps (see `_work_of_step`). A step first
    talks to the neighbours: a forward step sends upstream the gradient of the backward just run and receives its
    own input; a backward step receives its own output gradient and sends downstream the output of the forward just
    run. The first and the last stage then load the micro-batch (inputs, labels) of a forward, the stage computes,
    and the last step reduces the gradients and steps the optimizer."""
    buffers = pipe_buffers(micro_batches, stages, stage_id)
    first, last = stage_id == 0, stage_id == stages - 1
    total = 2 * (micro_batches + stages - 1)
    steps = []
    previous = None  # the micro-batch the previous step computed
    for step in range(total):
        micro_batch, forward = _work_of_step(step, micro_batches, stages, stage_id)
        current = None if micro_batch is None else micro_batch % buffers
        done = None if previous is None else previous % buffers
        out: list[Command] = []
        if forward and not first:
            out += [SendGrad(done)] if done is not None else []
            out += [RecvActivation(current)] if current is not None else []
        if not forward and not last:
            out += [RecvGrad(current)] if current is not None else []
            out += [SendActivation(done)] if done is not None else []
        if current is not None:
            out += [LoadMicroBatch(current)] if forward and (first or last) else []
            out.append(ForwardPass(current) if forward else BackwardPass(current))
        if step == total - 1:
            out += [ReduceTiedGrads(), ReduceGrads(), OptimizerStep()]
        steps.append(tuple(out))
        previous = micro_batch
    return StageProgram(micro_batches, stages, stage_id, tuple(steps))


def _with_early_recompute(commands: list[Command]) -> list[Command]:
    """RecomputeEarly(b) inserted right before each RecvGrad(b): the stage would otherwise wait there."""
    out = []
    for command in commands:
        if isinstance(command, RecvGrad):
            out.append(RecomputeEarly(command.buffer_id))
        out.append(command)
    return out


def _sends_first(commands: list[Command]) -> Step:
    """The step's SendActivation before everything else in it. 1F1B sends a forward's output after the next
    RecvGrad, so whatever this stage runs before that RecvGrad (an early recompute, deferred W's) would hold up the
    next stage's forward. Sending first needs posted sends, and the step's RecvGrad posted with the send
    (`p2p_batches`): under rendezvous sends this stage would block in the send while the next stage blocks in its
    SendGrad to this stage's RecvGrad. The engine running these schedules posts
    them so (parallel/runtime/zero_bubble_engine.py), and the simulator replays them so."""
    sends = [command for command in commands if isinstance(command, SendActivation)]
    return tuple(sends + [command for command in commands if not isinstance(command, SendActivation)])


def _split_backward(program: StageProgram, deferred: int) -> list[list[Command]]:
    """ZB-H1 on the 1F1B `program`: every BackwardPass becomes a BackwardInput, and each micro-batch's
    BackwardWeight runs up to `deferred` micro-batches later, in micro-batch order, all before ReduceTiedGrads.

    `deferred` is the most micro-batches B'd but not yet W'd at any forward pass. Its default is the stage index,
    as in ZB-H1: under 1F1B stage s holds the activations of up to `stages - s` micro-batches at once and stage 0
    `stages`, so s deferred W's (each holding only what W needs: a Linear's input and output gradient) keep every
    stage within the most micro-batches 1F1B holds anywhere. A planner that bounds each stage by its own 1F1B peak
    in bytes passes a smaller `deferred` (0: each W right after its B, the 1F1B backward split in two with nothing
    deferred).

    Where a W goes: on the first and the last stage, and wherever `deferred` is 0, right after the B whose count
    makes it due (the first stage sends nothing upstream; the last stage would otherwise block in the SendGrad
    rendezvous until the previous stage, busy with its own B, posts the recv). On the stages between, right before
    the next RecvGrad (and its RecomputeEarly), where the stage waits for the next stage's B: anywhere else a W
    would hold up a neighbour blocked in a rendezvous with this stage. With deferral, the W's still pending after
    the last B run after its SendGrad, before ReduceTiedGrads: from then on the previous stage waits for nothing
    but that gradient. With none, each W follows its B at once, the last one too: B and W are then 1F1B's backward
    cut in two, holding nothing between them.
    """
    if deferred < 0:
        raise ValueError(f"deferred must be >= 0, got {deferred}")
    micro_batches, buffers = program.micro_batches, program.pipe_buffers
    first, last = program.stage_id == 0, program.stage_id == program.stages - 1
    backwards = weights = 0  # B's and W's emitted so far; the next W is micro-batch `weights`

    def weights_up_to(micro_batch: int) -> list[Command]:
        """The W's due up to `micro_batch`, of the micro-batches B'd so far."""
        nonlocal weights
        out = []
        while weights <= min(micro_batch, backwards - 1):
            out.append(BackwardWeight(weights % buffers))
            weights += 1
        return out

    # The last stage with nothing deferred: each W right after the SendGrad of its B (an asynchronous send returns
    # at once), so the previous stage gets the gradient a W earlier, and only that W's inputs are held meanwhile.
    after_send = last and program.stages > 1 and deferred == 0
    after_backward = not after_send and (first or last or deferred == 0)
    steps = []
    for commands in program.steps:
        out = []
        for command in commands:
            if after_send and isinstance(command, SendGrad):
                out += [command, *weights_up_to(weights)]
                continue
            if isinstance(command, RecvGrad) and not after_backward:
                # After this B the stage reaches a forward with at most `deferred` W's pending.
                out += weights_up_to(backwards - deferred)
            if isinstance(command, ReduceTiedGrads):
                out += weights_up_to(micro_batches - 1)
            if isinstance(command, BackwardPass):
                out.append(BackwardInput(command.buffer_id))
                backwards += 1
                if after_backward and (backwards < micro_batches or deferred == 0):
                    out += weights_up_to(backwards - 1 - deferred)
            else:
                out.append(command)
        steps.append(out)
    return steps


def posts_sends(kind: str, early: Sequence[bool]) -> bool:
    """Whether a pipeline whose stage plans have these `early` settings runs on posted sends: a rewrite of 1F1B
    (zb-h1, or a stage other than the last recomputing early: the last never does). Else it runs DeepSpeed's own
    1F1B with its blocking sends. One value for the whole pipeline, as its engine and the simulator take it."""
    return kind != "1f1b" or any(early[:-1])


COMMUNICATION = (SendActivation, RecvActivation, SendGrad, RecvGrad)
"""The point-to-point instructions."""


def sends_activation_first(step: Step) -> bool:
    """Whether a step sends its activation before it receives its gradient (`_sends_first`): its engine then posts
    both as one batch at the SendActivation. Posted apart, in this order, the send would wait (NCCL, large
    messages) on the next stage's RecvActivation, which that stage posts after its SendGrad, which waits on this
    stage's RecvGrad, queued behind the send on the pair's one stream: a deadlock."""
    kinds = [type(c) for c in step]
    return SendActivation in kinds and RecvGrad in kinds and kinds.index(SendActivation) < kinds.index(RecvGrad)


def p2p_batches(program: StageProgram) -> list[tuple[Command, ...]]:
    """The stage's point-to-point communication in the order its engine posts it, each batch posted at once
    (`torch.distributed.batch_isend_irecv`) at its first instruction's place: one instruction per batch, but a
    step's SendActivation and RecvGrad as one where it sends its activation first (`sends_activation_first`)."""
    out: list[tuple[Command, ...]] = []
    for step in program.steps:
        ops = [c for c in step if isinstance(c, COMMUNICATION)]
        if sends_activation_first(step):
            recv = next(c for c in ops if isinstance(c, RecvGrad))
            out += [(c, recv) if isinstance(c, SendActivation) else (c,) for c in ops if c is not recv]
        else:
            out += [(c,) for c in ops]
    return out


@cache
def grad_sends_released(micro_batches: int, stages: int, stage_id: int) -> tuple[int, ...]:
    """Per RecvActivation of stage `stage_id` (the k-th receives micro-batch k): how many of the stage's posted
    gradient sends are complete by then, so that waiting for them costs nothing. The previous stage posts its
    RecvGrad no later than the SendActivation of the same step (before it in 1F1B, in one batch with it where the
    step sends its activation first), and no rewrite moves a communication out of its step: once activation k has
    arrived, the previous stage has posted the receive of every gradient of that step and the steps before it, and
    each such transfer completes without anything more from either side."""
    if stage_id == 0:
        return ()
    released, out = 0, []
    for step in one_f_one_b(micro_batches, stages, stage_id - 1).steps:
        released += sum(isinstance(command, RecvGrad) for command in step)
        out += [released] * sum(isinstance(command, SendActivation) for command in step)
    return tuple(out)


@cache
def train_schedule(
    kind: str, early: bool, micro_batches: int, stages: int, stage_id: int, deferred: int | None = None
) -> StageProgram:
    """The programme stage `stage_id` runs for `kind` (one of SCHEDULES) and `early` (the stage's plan runs its
    recompute as RecomputeEarly; ignored on the last stage, which never waits for a gradient). `deferred` (zb-h1
    only): `_split_backward`'s bound, the stage plan's `deferred_weights` (None: the stage index). The engine and
    the planner pass the same plan's values, so both run the same instruction list. `1f1b` without `early` is
    DeepSpeed's own 1F1B unchanged; the others also send each forward's output first in its step."""
    if kind not in SCHEDULES:
        raise ValueError(f"unknown pipeline schedule {kind!r}: expected one of {', '.join(SCHEDULES)}")
    program = one_f_one_b(micro_batches, stages, stage_id)
    if kind == "1f1b" and not early:
        return program
    steps = _split_backward(program, stage_id if deferred is None else deferred) if kind == "zb-h1" else program.steps
    rewritten = (_sends_first(_with_early_recompute(list(step)) if early else list(step)) for step in steps)
    return replace(program, steps=tuple(rewritten))
