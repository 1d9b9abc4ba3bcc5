"""The training schedules a stage can run, as DeepSpeed `PipeSchedule`s (pure planning: no process group).

`1f1b` is DeepSpeed's own `TrainSchedule`. `zb-h1` is ZB-H1 (Qi et al., "Zero Bubble Pipeline Parallelism",
ICLR'24): the backward pass splits into B (`BackwardInput`: the input gradient, which the previous stage waits
for, and every gradient that is not deferred) and W (`BackwardWeight`: the Linear layers' weight gradients, which
nobody waits for), and W's run later, where the stage would otherwise wait. `early=True` runs the plan's
recompute of a micro-batch as its own instruction (`RecomputeEarly`) before the stage blocks on that
micro-batch's gradient (Mario, PPoPP'25), instead of inside its backward.

Both schedules are DeepSpeed's `TrainSchedule` rewritten step by step: the communication instructions and
their order are TrainSchedule's own, and only local instructions are added. Under rendezvous sends (a send
blocks until its recv is posted: gloo here) whether a schedule deadlocks depends only on the order of each
stage's communication, which DeepSpeed's schedule gets right, so neither rewrite can deadlock
(parallel/planning/step_sim.py checks it). Every per-micro-batch kind still runs in micro-batch order on every stage, so
the k-th of a kind is micro-batch k (parallel/measurement/trace.py and parallel/planning/step_sim.py rely on it), and
the pipe
buffers are TrainSchedule's: a buffer is live from its forward to its B, and neither rewrite changes that.
"""

from deepspeed.runtime.pipe.schedule import (
    BackwardPass,
    BufferOpInstruction,
    PipeSchedule,
    RecvGrad,
    ReduceTiedGrads,
    SendActivation,
    SendGrad,
    TrainSchedule,
)


class BackwardInput(BufferOpInstruction):
    """B: the backward pass of the micro-batch in `buffer_id` that computes the input gradient (sent upstream
    by the SendGrad that follows) and every gradient that is not deferred; the Linear layers' weight
    gradients go to the weight-gradient store for a later BackwardWeight."""


class BackwardWeight(BufferOpInstruction):
    """W: the deferred weight gradients of one micro-batch. W's run in micro-batch order on every stage (the
    k-th W is micro-batch k); `buffer_id` is that micro-batch's buffer, for the trace only (the buffer itself
    may already hold a later micro-batch)."""


class RecomputeEarly(BufferOpInstruction):
    """The plan's recompute of the micro-batch in `buffer_id`, ahead of its backward, right before the stage
    blocks on that micro-batch's RecvGrad. Never on the last stage: its backward follows its forward."""


SCHEDULES = ("1f1b", "zb-h1")
"""The concrete schedules (`parallel.schedule=auto` resolves to one of them at planning time)."""


def _with_early_recompute(commands: list) -> list:
    """RecomputeEarly(b) inserted right before each RecvGrad(b): the stage would otherwise wait there."""
    out = []
    for command in commands:
        if isinstance(command, RecvGrad):
            out.append(RecomputeEarly(command.buffer_id))
        out.append(command)
    return out


def _sends_first(commands: list) -> list:
    """The step's SendActivation before everything else in it. TrainSchedule sends a forward's output after the
    next RecvGrad, so whatever this stage runs before that RecvGrad (an early recompute, deferred W's) would hold up
    the next stage's forward. Sending first needs asynchronous sends: under rendezvous sends this stage would block
    in the send while the next stage blocks in its SendGrad to this stage's RecvGrad. The engine running these
    schedules sends asynchronously (parallel/runtime/zero_bubble_engine.py), and the simulator replays them so."""
    sends = [command for command in commands if isinstance(command, SendActivation)]
    return sends + [command for command in commands if not isinstance(command, SendActivation)]


class EarlyRecomputeSchedule(TrainSchedule):
    """DeepSpeed's 1F1B with each non-last stage's recompute run early (the last stage's backward follows
    its forward with no wait, so it gets no RecomputeEarly and recomputes inside its backward)."""

    def steps(self):
        for commands in super().steps():
            yield _sends_first(_with_early_recompute(commands))


class ZeroBubbleH1Schedule(TrainSchedule):
    """ZB-H1 on DeepSpeed's 1F1B: every BackwardPass becomes a BackwardInput, and each micro-batch's
    BackwardWeight runs up to `deferred` micro-batches later, in micro-batch order, all before ReduceTiedGrads.

    `deferred` is the most micro-batches B'd but not yet W'd at any forward pass. Its default is the stage
    index, as in ZB-H1: under 1F1B stage s holds the activations of up to `stages - s` micro-batches at once
    and stage 0 `stages`, so s deferred W's (each holding only what W needs: a Linear's input and output
    gradient) keep every stage within the most micro-batches 1F1B holds anywhere. A planner that bounds each
    stage by its own 1F1B peak in bytes passes a smaller `deferred` (0: each W right after its B, the 1F1B
    backward split in two with nothing deferred).

    Where a W goes: on the first and the last stage, and wherever `deferred` is 0, right after the B whose
    count makes it due (the first stage sends nothing upstream; the last stage would otherwise block in the
    SendGrad rendezvous until the previous stage, busy with its own B, posts the recv). On the stages between,
    right before the next RecvGrad (and its RecomputeEarly), where the stage waits for the next stage's B:
    anywhere else a W would hold up a neighbour blocked in a rendezvous with this stage. With deferral, the W's
    still pending after the last B run after its SendGrad, before ReduceTiedGrads: from then on the previous
    stage waits for nothing but that gradient. With none, each W follows its B at once, the last one too: B and
    W are then 1F1B's backward cut in two, holding nothing between them.
    """

    def __init__(
        self, micro_batches: int, stages: int, stage_id: int, early: bool = False, deferred: int | None = None
    ):
        super().__init__(micro_batches=micro_batches, stages=stages, stage_id=stage_id)
        self.early = early
        self.deferred = stage_id if deferred is None else deferred
        if self.deferred < 0:
            raise ValueError(f"deferred must be >= 0, got {self.deferred}")

    def steps(self):
        backwards = weights = 0  # B's and W's emitted so far; the next W is micro-batch `weights`

        def weights_up_to(last: int) -> list:
            nonlocal weights
            out = []
            while weights <= min(last, backwards - 1):
                out.append(BackwardWeight(self._buffer_idx(weights)))
                weights += 1
            return out

        # The last stage with nothing deferred: each W right after the SendGrad of its B (an asynchronous send
        # returns at once), so the previous stage gets the gradient a W earlier, and only that W's inputs are held
        # meanwhile.
        after_send = self.is_last_stage and self.stages > 1 and self.deferred == 0
        after_backward = not after_send and (self.is_first_stage or self.is_last_stage or self.deferred == 0)
        for commands in super().steps():
            out = []
            for command in commands:
                if after_send and isinstance(command, SendGrad):
                    out += [command, *weights_up_to(weights)]
                    continue
                if isinstance(command, RecvGrad) and not after_backward:
                    # After this B the stage reaches a forward with at most `deferred` W's pending.
                    out += weights_up_to(backwards - self.deferred)
                if isinstance(command, ReduceTiedGrads):
                    out += weights_up_to(self.micro_batches - 1)
                if isinstance(command, BackwardPass):
                    out.append(BackwardInput(command.buffer_id))
                    backwards += 1
                    if after_backward and (backwards < self.micro_batches or self.deferred == 0):
                        out += weights_up_to(backwards - 1 - self.deferred)
                else:
                    out.append(command)
            yield _sends_first(_with_early_recompute(out) if self.early else out)


def train_schedule(
    kind: str, early: bool, micro_batches: int, stages: int, stage_id: int, deferred: int | None = None
) -> PipeSchedule:
    """The schedule stage `stage_id` runs for `kind` (one of SCHEDULES) and `early` (the stage's plan runs its
    recompute as RecomputeEarly; ignored on the last stage, which never waits for a gradient). `deferred`
    (zb-h1 only): ZeroBubbleH1Schedule's bound, the stage plan's `deferred_weights` (None: the stage index).
    The engine and the planner pass the same plan's values, so both run the same instruction list."""
    if kind == "1f1b":
        schedule = EarlyRecomputeSchedule if early else TrainSchedule
        return schedule(micro_batches=micro_batches, stages=stages, stage_id=stage_id)
    if kind == "zb-h1":
        return ZeroBubbleH1Schedule(micro_batches, stages, stage_id, early=early, deferred=deferred)
    raise ValueError(f"unknown pipeline schedule {kind!r}: expected one of {', '.join(SCHEDULES)}")
