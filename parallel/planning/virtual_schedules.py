"""Schedules with virtual stages: v model chunks per rank, as pure instruction programmes (no DeepSpeed, no process
group). The pipeline's layers split into `ranks * chunks` virtual stages; a rank holds several of them:

- `interleaved-1f1b` (Narayanan et al., "Efficient Large-Scale Language Model Training on GPU Clusters Using
  Megatron-LM", SC'21): interleaved placement, rank r holds virtual stages r, r + p, ..., and runs Megatron's
  order: forwards in rounds of p micro-batches through chunk 0, then chunk 1, ...; backwards in the same rounds with
  the chunks reversed; (p - r - 1) * 2 + (v - 1) * p forwards of warm-up, then one forward one backward. With v = 1
  that is 1F1B's own order.
- `zb-v` and `v-half` (Qi et al., "Pipeline Parallelism with Controllable Memory", NeurIPS'24; ZB-V also in "Zero
  Bubble Pipeline Parallelism", ICLR'24): V placement with 2 chunks, rank r holds virtual stages r and 2p - 1 - r,
  so rank 0 holds both the first and the last; the backward splits into B and W (parallel/planning/schedules.py's
  BackwardInput and BackwardWeight). Each rank runs a ready B first, else a ready forward (the deeper virtual stage
  first), else its oldest pending W. A memory limit bounds the chunk-micro-batches the rank holds (a micro-batch
  admitted to its first chunk reserves both chunks, each until its W): at the limit it admits no new micro-batch
  and runs its W's before forwards. ZB-V's limit is 2p (1F1B's p micro-batches of a whole stage, each two chunks:
  the same peak), V-Half's p (half of it). These orders are a greedy list schedule with the papers' placements
  and memory limits, not the papers' instruction lists copied (bench/virtual_schedule_bench.py prints their
  planned bytes and simulated steps).

A programme is derived in lock-step slots (by default a forward, a B or a W one slot, a whole backward two, as the
papers lay their schedules out; `Slots` gives other lengths): a compute instruction runs in the first slot after its
inputs were produced. What an instruction produces for another rank crosses at the boundary after its last slot: each
rank posts that boundary's sends and receives as one batch (`VirtualProgram.steps`: a step is one slot's computation,
then its boundary's communication). Every message is posted by both its ranks at the same boundary, so under the
strictest rendezvous transport (a send waits until its receive is posted) the lowest boundary still pending always
has both sides of each of its messages posted: no programme can deadlock, whatever the real costs
(tests/test_virtual_schedules.py replays every shape). A message received before it is needed is held until then
(parallel/planning/virtual_walk.py counts it). What a rank's chunk hands to its own next chunk (the V's turn on rank
p - 1) is a message to itself: a copy on the rank, which the simulator prices at no transfer.
"""

from collections.abc import Callable
from dataclasses import dataclass

from parallel.planning import schedules
from parallel.planning.virtual_program import (
    UNIT_SLOTS,
    VIRTUAL_SCHEDULES,
    ChunkCommand,
    Placement,
    Slots,
    VirtualProgram,
    VirtualStep,
    placement_of,
)

Op = tuple[type[schedules.Command], int, int]
"""(ForwardPass / BackwardPass / BackwardInput / BackwardWeight, virtual stage, micro-batch)."""


def _megatron_order(placement: Placement, micro_batches: int, rank: int) -> list[Op]:
    """Rank `rank`'s forwards and backwards in Megatron's interleaved order (micro-batches in rounds of p; a last
    round of fewer where p does not divide them)."""
    p, v = placement.ranks, placement.chunks
    rounds = [range(start, min(start + p, micro_batches)) for start in range(0, micro_batches, p)]

    def order(kind, chunks):
        return [(kind, placement.virtual_stage(rank, c), m) for batch in rounds for c in chunks for m in batch]

    forwards = order(schedules.ForwardPass, range(v))
    backwards = order(schedules.BackwardPass, range(v - 1, -1, -1))
    warmup = min(len(forwards), p - rank - 1 if v == 1 else (p - rank - 1) * 2 + (v - 1) * p)
    out = forwards[:warmup]
    for forward, backward in zip(forwards[warmup:], backwards):
        out += [forward, backward]
    return out + backwards[len(forwards) - warmup :]


def _deps(op: Op, placement: Placement, split: bool) -> list[Op]:
    """The ops whose output `op` needs."""
    kind, stage, m = op
    backward = schedules.BackwardInput if split else schedules.BackwardPass
    if kind is schedules.ForwardPass:
        return [(kind, stage - 1, m)] if stage > 0 else []
    if kind is schedules.BackwardWeight:
        return [(schedules.BackwardInput, stage, m)]
    last = placement.virtual_stages - 1
    return [(schedules.ForwardPass, stage, m)] + ([(backward, stage + 1, m)] if stage < last else [])


@dataclass
class _Progress:
    """What has started so far: the slot each op ends (exclusive), and per (kind, virtual stage) how many
    micro-batches (every kind runs its micro-batches in order on its stage)."""

    end_of: dict[Op, int]
    count: dict[tuple[type[schedules.Command], int], int]

    def ready(self, op: Op, placement: Placement, split: bool, slot: int) -> bool:
        for dep in _deps(op, placement, split):
            end = self.end_of.get(dep)
            if end is None or end > slot:
                return False
        return True

    def next_op(self, kind: type[schedules.Command], stage: int, micro_batches: int) -> Op | None:
        m = self.count.get((kind, stage), 0)
        return (kind, stage, m) if m < micro_batches else None


Chooser = Callable[[int, _Progress, int], Op | None]
"""(rank, what has run, this slot) -> the op the rank runs now, or None (idle)."""


def _in_order(orders: list[list[Op]], placement: Placement) -> Chooser:
    """Each rank runs its fixed order, idling until the next op's inputs are there."""
    position = [0] * placement.ranks

    def choose(rank: int, progress: _Progress, slot: int) -> Op | None:
        if position[rank] == len(orders[rank]):
            return None
        op = orders[rank][position[rank]]
        if not progress.ready(op, placement, False, slot):
            return None
        position[rank] += 1
        return op

    return choose


def _greedy_v(placement: Placement, micro_batches: int, limit: int) -> Chooser:
    """A ready B first, else a ready forward (the deeper virtual stage first), else the oldest pending W; at the
    memory `limit`, no new micro-batch on the first chunk, and W's before forwards. What counts against the limit
    is chunk-micro-batches held: a micro-batch admitted to the rank's first chunk reserves both of its chunks, each
    until its W."""
    kinds = (schedules.BackwardInput, schedules.ForwardPass, schedules.BackwardWeight)

    def choose(rank: int, progress: _Progress, slot: int) -> Op | None:
        first, second = placement.virtual_stage(rank, 0), placement.virtual_stage(rank, 1)
        held = 2 * progress.count.get((schedules.ForwardPass, first), 0) - sum(
            progress.count.get((schedules.BackwardWeight, stage), 0) for stage in (first, second)
        )
        order = kinds if held < limit else (schedules.BackwardInput, schedules.BackwardWeight, schedules.ForwardPass)
        for kind in order:
            ops = [progress.next_op(kind, stage, micro_batches) for stage in (second, first)]
            ready = [op for op in ops if op is not None and progress.ready(op, placement, True, slot)]
            if kind is schedules.ForwardPass:
                ready = [op for op in ready if op[1] != first or held < limit]
            else:  # the older micro-batch first
                ready.sort(key=lambda op: op[2])
            if ready:
                return ready[0]
        return None

    return choose


def _slots(
    placement: Placement, micro_batches: int, split: bool, choose: Chooser, lengths: Slots
) -> list[list[tuple[int, Op]]]:
    """Per rank, (start slot, op) of each op it runs, in order."""
    kinds = (schedules.ForwardPass,) + (
        (schedules.BackwardInput, schedules.BackwardWeight) if split else (schedules.BackwardPass,)
    )
    remaining = [len(kinds) * placement.chunks * micro_batches] * placement.ranks
    progress = _Progress({}, {})
    slots: list[list[tuple[int, Op]]] = [[] for _ in range(placement.ranks)]
    free = [0] * placement.ranks  # the slot each rank's running op ends
    slot = 0
    while any(remaining):
        idle = [rank for rank in range(placement.ranks) if remaining[rank] and free[rank] <= slot]
        chosen = [(rank, op) for rank in idle if (op := choose(rank, progress, slot)) is not None]
        for rank, op in chosen:
            slots[rank].append((slot, op))
            remaining[rank] -= 1
            free[rank] = progress.end_of[op] = slot + lengths.of(op[0])
            progress.count[op[:2]] = progress.count.get(op[:2], 0) + 1
        # Nothing changes for a waiting rank until some op ends: skip to the next end.
        later = [f for f in free if f > slot]
        if not later:
            raise RuntimeError(f"the schedule cannot proceed at slot {slot}: every rank waits")
        slot = slot + 1 if chosen else min(later)
    return slots


def _programs(
    schedule: str,
    placement: Placement,
    micro_batches: int,
    split: bool,
    choose: Chooser,
    lengths: Slots,
    early: frozenset[int],
):
    slots = _slots(placement, micro_batches, split, choose, lengths)
    p, last = placement.ranks, placement.virtual_stages - 1
    length = max(start + lengths.of(op[0]) for ranks in slots for start, op in ranks)
    steps: list[list[list[ChunkCommand]]] = [[[] for _ in range(length)] for _ in range(p)]
    for rank in range(p):
        for start, op in slots[rank]:
            kind, stage, m = op
            _, chunk = placement.holder(stage)
            steps[rank][start] += [ChunkCommand(schedules.LoadMicroBatch, chunk, stage, m)] * (
                kind is schedules.ForwardPass and stage in (0, last)
            )
            # Early recompute right before the backward that would wait for its gradient: the rank recomputes while
            # the gradient is on its way (the runner waits for a message only at the computation that reads it).
            steps[rank][start] += [ChunkCommand(schedules.RecomputeEarly, chunk, stage, m)] * (
                kind in (schedules.BackwardPass, schedules.BackwardInput) and stage in early
            )
            steps[rank][start].append(ChunkCommand(kind, chunk, stage, m))
            boundary = start + lengths.of(kind) - 1  # its output crosses after its last slot
            if kind is schedules.ForwardPass and stage < last:
                to, to_chunk = placement.holder(stage + 1)
                sends, recvs = schedules.SendActivation, schedules.RecvActivation
            elif kind in (schedules.BackwardPass, schedules.BackwardInput) and stage > 0:
                to, to_chunk = placement.holder(stage - 1)
                sends, recvs = schedules.SendGrad, schedules.RecvGrad
            else:
                continue
            steps[rank][boundary].append(ChunkCommand(sends, chunk, stage, m, peer=to))
            step = stage + 1 if sends is schedules.SendActivation else stage - 1
            steps[to][boundary].append(ChunkCommand(recvs, to_chunk, step, m, peer=rank))
    per_step = (
        ChunkCommand(schedules.ReduceTiedGrads),
        ChunkCommand(schedules.ReduceGrads),
        ChunkCommand(schedules.OptimizerStep),
    )
    programs = []
    for rank in range(p):
        ordered = tuple(_sends_before_receives(step) for step in steps[rank])
        ordered = ordered[:-1] + (ordered[-1] + per_step,)
        programs.append(VirtualProgram(schedule, p, placement.chunks, micro_batches, rank, ordered))
    return programs


def _sends_before_receives(step: list[ChunkCommand]) -> VirtualStep:
    """The step's computation, then its sends, then its receives: the batch is posted as one, and a runner that
    receives one message at a time (the local pipeline) must have sent first."""
    if len(step) < 2:
        return tuple(step)
    sends = (schedules.SendActivation, schedules.SendGrad)
    receives = (schedules.RecvActivation, schedules.RecvGrad)
    return tuple(
        [c for c in step if c.kind not in schedules.COMMUNICATION]
        + [c for c in step if c.kind in sends]
        + [c for c in step if c.kind in receives]
    )


def virtual_schedule(
    schedule: str,
    micro_batches: int,
    ranks: int,
    chunks: int = 2,
    slots: Slots = UNIT_SLOTS,
    early: frozenset[int] = frozenset(),
) -> list[VirtualProgram]:
    """Every rank's programme of `schedule` (one of VIRTUAL_SCHEDULES) with `chunks` per rank (2 for the V shapes),
    laid out in `slots` (the V shapes' greedy order follows them; interleaved 1F1B's order is Megatron's); the virtual
    stages `early` recompute each micro-batch as a RecomputeEarly of its own right before its backward (never the last
    virtual stage: its backward follows its forward)."""
    if schedule not in VIRTUAL_SCHEDULES:
        raise ValueError(f"unknown virtual schedule {schedule!r}: expected one of {', '.join(VIRTUAL_SCHEDULES)}")
    if micro_batches < 1:
        raise ValueError(f"micro_batches must be >= 1, got {micro_batches}")
    placement = placement_of(schedule, ranks, chunks)
    if placement.virtual_stages - 1 in early:
        raise ValueError("the last virtual stage never recomputes early: its backward follows its forward")
    if schedule == "interleaved-1f1b":
        if micro_batches > ranks and micro_batches % ranks:
            # A last round of fewer micro-batches leaves Megatron's warm-up waiting on itself (as Megatron-LM
            # refuses it too).
            raise ValueError(
                f"interleaved-1f1b needs the micro-batches ({micro_batches}) a multiple of the pipeline ranks "
                f"({ranks}), or at most as many"
            )
        orders = [_megatron_order(placement, micro_batches, rank) for rank in range(ranks)]
        return _programs(schedule, placement, micro_batches, False, _in_order(orders, placement), slots, early)
    limit = 2 * ranks if schedule == "zb-v" else ranks
    return _programs(schedule, placement, micro_batches, True, _greedy_v(placement, micro_batches, limit), slots, early)
