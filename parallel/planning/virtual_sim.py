"""The step time of a pipeline with virtual stages, predicted by replaying every rank's programme
(parallel/planning/virtual_schedules.py) as events, as parallel/planning/step_sim.py replays one chunk per rank
(pure: no process group).

A rank runs its instructions in order; a compute instruction takes its chunk's seconds (step_sim.StageCosts, one per
chunk). A step's communication is one batch, as the engine posts it (parallel/runtime/boundary_links.py's
BoundaryBatch): every send and receive posted at once and all waited for, so it ends once each of its messages to or
from another rank has crossed, both sides posted plus the transfer: a send is a rendezvous (gloo's, and NCCL's for
large messages), so a rank that sends waits for its receiver to reach the same boundary. A message to the rank itself
(the V's turn) is a copy. ReduceTiedGrads is a collective of the ranks holding the first
and the last virtual stage when they differ (a V's rank 0 holds both: its reduce is local). Under gradient clipping
(`clip_barrier`) the optimizer step is a barrier of every rank, as step_sim.simulate's: DeepSpeed clips inside its
step, after an all-reduce of the norm over the pipeline's ranks, so no rank steps before the last has reached its own
step, and each then takes its own step's seconds.
"""

import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from parallel.planning import schedules
from parallel.planning.step_sim import COMPUTE, StageCosts
from parallel.planning.virtual_schedules import ChunkCommand, VirtualProgram

_SENDS = (schedules.SendActivation, schedules.SendGrad)
_ONCE_PER_RANK = ("ReduceGrads", "OptimizerStep")
"""Priced as the sum over the rank's chunks: each chunk's parameters are reduced and stepped."""


EXCHANGE = "BoundaryExchange"
"""A step's communication batch, as a traced step names it: its sends and receives, posted and waited for at once
(parallel/runtime/virtual_rank.py)."""


@dataclass(frozen=True)
class VirtualTimeline:
    step_time_s: float
    busy_s: tuple[float, ...]
    """Per rank: seconds computing (step_sim.COMPUTE's instructions)."""
    rank_instruction_s: tuple[dict[str, float], ...] = ()
    """Per rank, the mean simulated seconds of each instruction it runs, from reaching it to its end, as a traced step
    times it: its chunks' computations, its once-per-step instructions (a collective's or the clipping barrier's wait
    included) and each boundary's batch (EXCHANGE: the wait for the peers included)."""


def _seconds(command: ChunkCommand, costs: Sequence[StageCosts]) -> float:
    if command.name in _ONCE_PER_RANK:
        return sum(c.by_instruction()[command.name] for c in costs)
    return costs[command.chunk or 0].by_instruction()[command.name]


_RECEIVE_OF = {schedules.SendActivation: "RecvActivation", schedules.SendGrad: "RecvGrad"}


def _transfer_s(command: ChunkCommand, rank: int, costs: Sequence[StageCosts]) -> float:
    """A message's crossing, priced as its receive (one hidden-state tensor either way); a message between the rank's
    own chunks (the V's turn) is a copy on the rank: no transfer."""
    if command.peer == rank:
        return 0.0
    name = _RECEIVE_OF.get(command.kind, command.name)
    return costs[command.chunk or 0].by_instruction()[name]


def simulate_virtual(
    programs: Sequence[VirtualProgram], costs: Sequence[Sequence[StageCosts]], clip_barrier: bool = False
) -> VirtualTimeline:
    """Replay the ranks' programmes; `costs[rank][chunk]` are the seconds of that chunk's instructions.
    `clip_barrier`: the run clips its gradients (see the module's docstring)."""
    ranks = len(programs)
    placement = programs[0].placement
    tied = sorted({placement.holder(0)[0], placement.holder(placement.virtual_stages - 1)[0]})
    # Per rank, its work in order: a compute (or per-step) instruction, or a step's communication batch.
    work: list[list[ChunkCommand | tuple[ChunkCommand, ...]]] = []
    for program in programs:
        items: list[ChunkCommand | tuple[ChunkCommand, ...]] = []
        for step in program.steps:
            # The slot's computation, then its boundary's batch, then (last step) the per-step instructions.
            items += [c for c in step if c.kind not in schedules.COMMUNICATION and c.micro_batch is not None]
            batch = tuple(c for c in step if c.kind in schedules.COMMUNICATION)
            items += [batch] if batch else []
            items += [c for c in step if c.micro_batch is None]
        work.append(items)
    clock, pc, busy = [0.0] * ranks, [0] * ranks, [0.0] * ranks
    spans: list[dict[str, list[float]]] = [{} for _ in range(ranks)]
    posted: dict[tuple, float] = {}  # (message, sending?) -> when that side's batch was posted
    reduce_posted: dict[int, float] = {}
    step_posted: dict[int, float] = {}  # rank -> when it reached its OptimizerStep (under clip_barrier)
    while any(pc[r] < len(work[r]) for r in range(ranks)):
        progressed = False
        for r in range(ranks):
            while pc[r] < len(work[r]):
                item = work[r][pc[r]]
                reached = clock[r]
                if isinstance(item, tuple):
                    for c in item:
                        posted.setdefault((c.message(), c.kind in _SENDS), clock[r])
                    other = [(c.message(), c.kind not in _SENDS) for c in item]
                    if any(side not in posted for side in other):
                        break  # a peer has not reached this boundary yet
                    ends = [max(clock[r], posted[side]) + _transfer_s(c, r, costs[r]) for c, side in zip(item, other)]
                    clock[r] = max([clock[r], *ends])
                elif item.kind is schedules.ReduceTiedGrads and len(tied) > 1 and r in tied:
                    reduce_posted.setdefault(r, clock[r])
                    if len(reduce_posted) < len(tied):
                        break
                    clock[r] = max(reduce_posted.values()) + _seconds(item, costs[r])
                elif item.kind is schedules.OptimizerStep and clip_barrier and ranks > 1:
                    step_posted.setdefault(r, clock[r])
                    if len(step_posted) < ranks:
                        break  # the norm's all-reduce waits for every rank
                    clock[r] = max(step_posted.values()) + _seconds(item, costs[r])
                else:
                    seconds = _seconds(item, costs[r])
                    clock[r] += seconds
                    busy[r] += seconds if item.name in COMPUTE else 0.0
                name = EXCHANGE if isinstance(item, tuple) else item.name
                spans[r].setdefault(name, []).append(clock[r] - reached)
                pc[r] += 1
                progressed = True
        if not progressed:
            raise RuntimeError("the programmes deadlock: every rank waits for a peer")
    means = tuple({name: statistics.fmean(values) for name, values in rank.items()} for rank in spans)
    return VirtualTimeline(max(clock), tuple(busy), means)
