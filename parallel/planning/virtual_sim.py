"""The step time of a pipeline with virtual stages, predicted by replaying every rank's programme
(parallel/planning/virtual_schedules.py) as events, as parallel/planning/step_sim.py replays one chunk per rank
(pure: no process group).

A rank runs its instructions in order; a compute instruction takes its chunk's seconds (step_sim.StageCosts, one per
chunk). A step's communication is one posted batch, as the engine's interpreter posts it
(parallel/runtime/stage_interpreter.py): its sends cost the sender nothing, and it ends once each of its receives
has crossed (its send posted, plus the transfer). ReduceTiedGrads is a collective of the ranks holding the first
and the last virtual stage when they differ (a V's rank 0 holds both: its reduce is local). Under gradient clipping
(`clip_barrier`) the optimizer step is a barrier of every rank, as step_sim.simulate's: DeepSpeed clips inside its
step, after an all-reduce of the norm over the pipeline's ranks, so no rank steps before the last has reached its own
step, and each then takes its own step's seconds.
"""

from collections.abc import Sequence
from dataclasses import dataclass

from parallel.planning import schedules
from parallel.planning.step_sim import COMPUTE, StageCosts
from parallel.planning.virtual_schedules import ChunkCommand, VirtualProgram

_SENDS = (schedules.SendActivation, schedules.SendGrad)
_ONCE_PER_RANK = ("ReduceGrads", "OptimizerStep")
"""Priced as the sum over the rank's chunks: each chunk's parameters are reduced and stepped."""


@dataclass(frozen=True)
class VirtualTimeline:
    step_time_s: float
    busy_s: tuple[float, ...]
    """Per rank: seconds computing (step_sim.COMPUTE's instructions)."""


def _seconds(command: ChunkCommand, costs: Sequence[StageCosts]) -> float:
    if command.name in _ONCE_PER_RANK:
        return sum(c.by_instruction()[command.name] for c in costs)
    return costs[command.chunk or 0].by_instruction()[command.name]


def _transfer_s(receive: ChunkCommand, rank: int, costs: Sequence[StageCosts]) -> float:
    """A message from the rank itself (the V's turn) is a copy on the rank: no transfer."""
    return 0.0 if receive.peer == rank else _seconds(receive, costs)


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
    sent: dict[tuple, float] = {}  # message -> when its send was posted
    reduce_posted: dict[int, float] = {}
    step_posted: dict[int, float] = {}  # rank -> when it reached its OptimizerStep (under clip_barrier)
    while any(pc[r] < len(work[r]) for r in range(ranks)):
        progressed = False
        for r in range(ranks):
            while pc[r] < len(work[r]):
                item = work[r][pc[r]]
                if isinstance(item, tuple):
                    for c in item:
                        if c.kind in _SENDS:
                            sent.setdefault(c.message(), clock[r])
                    receives = [c for c in item if c.kind not in _SENDS]
                    if any(c.message() not in sent for c in receives):
                        break  # a peer has not sent yet
                    ends = [max(clock[r], sent[c.message()]) + _transfer_s(c, r, costs[r]) for c in receives]
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
                pc[r] += 1
                progressed = True
        if not progressed:
            raise RuntimeError("the programmes deadlock: every rank waits for a peer")
    return VirtualTimeline(max(clock), tuple(busy))
