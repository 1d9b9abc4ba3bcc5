"""The step time of a pipeline with virtual stages, predicted by replaying every rank's programme
(parallel/planning/virtual_schedules.py) as events, as parallel/planning/step_sim.py replays one chunk per rank
(pure: no process group).

A rank runs its instructions in order; a compute instruction takes its chunk's seconds (step_sim.StageCosts, one per
chunk). Messages move as the engine moves them (parallel/runtime/boundary_links.py's BoundaryBatch): a step's sends
and receives are posted together at its boundary, once the gradients the rank sent at the boundary before have
crossed; a message crosses once both its sides are posted, plus the transfer (a send is a rendezvous: gloo's, and
NCCL's for large messages); the computation that reads a message waits for it; and before the once-per-step
instructions every message has crossed. A message to the rank itself (the V's turn) is a copy. ReduceTiedGrads is a
collective of the ranks holding the first and the last virtual stage when they differ and the model ties its
embedding and LM head (a V's rank 0 holds both: its reduce is local; an untied head has none). Under gradient
clipping (`clip_barrier`) the optimizer step is a barrier of every rank, as step_sim.simulate's: DeepSpeed clips
inside its step, after an all-reduce of the norm over the pipeline's ranks, so no rank steps before the last has
reached its own step, and each then takes its own step's seconds.
"""

import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from parallel.planning import schedules
from parallel.planning.step_sim import COMPUTE, StageCosts
from parallel.planning.virtual_program import ChunkCommand, VirtualProgram

_SENDS = (schedules.SendActivation, schedules.SendGrad)
_ONCE_PER_RANK = ("ReduceGrads", "OptimizerStep")
"""Priced as the sum over the rank's chunks: each chunk's parameters are reduced and stepped."""


EXCHANGE = "BoundaryExchange"
"""A boundary's post (after the gradients sent at the one before have crossed), and before the once-per-step
instructions the wait for every message, as a traced step names them (parallel/runtime/virtual_rank.py)."""
RECEIVE_WAIT = "ReceiveWait"
"""A computation's wait for the message it reads."""
_DRAIN = "drain"
"""The work item before the once-per-step instructions: every message complete."""


@dataclass(frozen=True)
class VirtualTimeline:
    step_time_s: float
    busy_s: tuple[float, ...]
    """Per rank: seconds computing (step_sim.COMPUTE's instructions)."""
    rank_instruction_s: tuple[dict[str, float], ...] = ()
    """Per rank, the mean simulated seconds of each instruction it runs, from reaching it to its end, as a traced step
    times it: its chunks' computations, its once-per-step instructions (a collective's or the clipping barrier's wait
    included), each boundary's post and the final completion (EXCHANGE) and each computation's wait for the message
    it reads (RECEIVE_WAIT)."""


def _seconds(command: ChunkCommand, costs: Sequence[StageCosts], early: frozenset[int]) -> float:
    """`early`: the rank's chunks that recompute as RecomputeEarly, not inside their backwards."""
    if command.name in _ONCE_PER_RANK:
        return sum(c.by_instruction()[command.name] for c in costs)
    chunk = command.chunk or 0
    return costs[chunk].by_instruction(early=chunk in early)[command.name]


_RECEIVE_OF = {schedules.SendActivation: "RecvActivation", schedules.SendGrad: "RecvGrad"}


def _transfer_s(command: ChunkCommand, rank: int, costs: Sequence[StageCosts]) -> float:
    """A message's crossing, priced as its receive (one hidden-state tensor either way); a message between the rank's
    own chunks (the V's turn) is a copy on the rank: no transfer."""
    if command.peer == rank:
        return 0.0
    name = _RECEIVE_OF.get(command.kind, command.name)
    return costs[command.chunk or 0].by_instruction()[name]


def simulate_virtual(
    programs: Sequence[VirtualProgram],
    costs: Sequence[Sequence[StageCosts]],
    clip_barrier: bool = False,
    tied_weights: bool = True,
) -> VirtualTimeline:
    """Replay the ranks' programmes; `costs[rank][chunk]` are the seconds of that chunk's instructions.
    `clip_barrier`: the run clips its gradients (see the module's docstring). `tied_weights`: the model ties its
    embedding and LM head; an untied head has no ReduceTiedGrads collective (parallel/runtime/tied_copies.py)."""
    ranks = len(programs)
    placement = programs[0].placement
    ends = {placement.holder(0)[0], placement.holder(placement.virtual_stages - 1)[0]}
    tied = sorted(ends) if tied_weights else []
    # Per rank, its work in order: a compute (or per-step) instruction, a step's communication batch, or the drain.
    work: list[list[ChunkCommand | tuple[ChunkCommand, ...] | str]] = []
    for program in programs:
        items: list[ChunkCommand | tuple[ChunkCommand, ...] | str] = []
        for step in program.steps:
            # The slot's computation, then its boundary's batch, then (last step) the per-step instructions.
            items += [c for c in step if c.kind not in schedules.COMMUNICATION and c.micro_batch is not None]
            batch = tuple(c for c in step if c.kind in schedules.COMMUNICATION)
            items += [batch] if batch else []
            once = [c for c in step if c.micro_batch is None]
            items += [_DRAIN, *once] if once else []
        work.append(items)
    early = [frozenset(c.chunk for c in p.commands() if c.kind is schedules.RecomputeEarly) for p in programs]
    clock, pc, busy = [0.0] * ranks, [0] * ranks, [0.0] * ranks
    spans: list[dict[str, list[float]]] = [{} for _ in range(ranks)]
    posted: dict[tuple, float] = {}  # (message, sending?) -> when that side's batch was posted
    # the gradients the last batch and the one before sent: the older ones cross before the next post
    sent_grads: list[tuple[ChunkCommand, ...]] = [() for _ in range(ranks)]
    older_grads: list[tuple[ChunkCommand, ...]] = [() for _ in range(ranks)]
    reduce_posted: dict[int, float] = {}
    step_posted: dict[int, float] = {}  # rank -> when it reached its OptimizerStep (under clip_barrier)

    def crossed(command: ChunkCommand, r: int) -> float | None:
        """When the message of `command` (a send of rank r) has crossed, None while its receive is not posted."""
        receiving = (command.message(), False)
        if receiving not in posted:
            return None
        return max(posted[(command.message(), True)], posted[receiving]) + _transfer_s(command, r, costs[r])

    while any(pc[r] < len(work[r]) for r in range(ranks)):
        progressed = False
        for r in range(ranks):
            program = programs[r]
            while pc[r] < len(work[r]):
                item = work[r][pc[r]]
                reached = clock[r]
                if isinstance(item, tuple) or item == _DRAIN:
                    waited = older_grads[r] + (sent_grads[r] if item == _DRAIN else ())
                    ends = [crossed(c, r) for c in waited]
                    if None in ends:
                        break  # a peer has not posted the boundary those gradients cross at
                    clock[r] = max([clock[r], *ends])
                    older_grads[r], sent_grads[r] = (() if item == _DRAIN else sent_grads[r]), ()
                    if isinstance(item, tuple):
                        # what a post costs beyond the waits simulated here (StageCosts.exchange)
                        clock[r] += costs[r][item[0].chunk or 0].exchange
                        for c in item:
                            posted[(c.message(), c.kind in _SENDS)] = clock[r]
                        sent_grads[r] = tuple(c for c in item if c.kind is schedules.SendGrad)
                    name = EXCHANGE
                elif item.kind is schedules.ReduceTiedGrads and len(tied) > 1 and r in tied:
                    reduce_posted.setdefault(r, clock[r])
                    if len(reduce_posted) < len(tied):
                        break
                    clock[r] = max(reduce_posted.values()) + _seconds(item, costs[r], early[r])
                    name = item.name
                elif item.kind is schedules.OptimizerStep and clip_barrier and ranks > 1:
                    step_posted.setdefault(r, clock[r])
                    if len(step_posted) < ranks:
                        break  # the norm's all-reduce waits for every rank
                    clock[r] = max(step_posted.values()) + _seconds(item, costs[r], early[r])
                    name = item.name
                else:
                    message = program.message_read(item)
                    if message is not None:
                        if (message, True) not in posted:
                            break  # its sender has not posted it yet
                        sender = placement.holder(message[1])[0]
                        receive = "RecvActivation" if message[0] == "activation" else "RecvGrad"
                        transfer = 0.0 if sender == r else costs[r][item.chunk].by_instruction()[receive]
                        arrived = max(posted[(message, True)], posted[(message, False)]) + transfer
                        spans[r].setdefault(RECEIVE_WAIT, []).append(max(0.0, arrived - clock[r]))
                        clock[r] = reached = max(clock[r], arrived)
                    seconds = _seconds(item, costs[r], early[r])
                    clock[r] += seconds
                    busy[r] += seconds if item.name in COMPUTE else 0.0
                    name = item.name
                spans[r].setdefault(name, []).append(clock[r] - reached)
                pc[r] += 1
                progressed = True
        if not progressed:
            raise RuntimeError("the programmes deadlock: every rank waits for a peer")
    means = tuple({name: statistics.fmean(values) for name, values in rank.items()} for rank in spans)
    return VirtualTimeline(max(clock), tuple(busy), means)
