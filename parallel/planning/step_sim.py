"""The step time of a pipeline, predicted by replaying the stage's training schedule (DeepSpeed's own 1F1B, or
one of its rewrites: parallel/planning/schedules.py) as an event simulation (pure: no process group).

Each stage runs its instruction list in order. A local instruction (load, forward, backward, the
data-parallel reduce, the optimizer step) starts when the stage is free. Communication is a rendezvous:
DeepSpeed 0.19.8's p2p uses torch.distributed send/recv, and on gloo a send blocks until the peer posts
its recv (measured: docs/measurement.md), so a send of micro-batch m on stage s and the matching recv on
its neighbour start together, when the later of the two arrives, and both are busy for the transfer.
ReduceTiedGrads is a collective of the first and the last stage, which hold the tied embedding; elsewhere it
does nothing. Under gradient clipping (`clip_barrier`) the optimizer step is a barrier of every stage: DeepSpeed
0.19.8 clips inside its optimizer step (engine.clip_fp32_gradients, and the bf16 and ZeRO optimizers alike), and the
global norm is an all-reduce over the pipeline's stages (the grid's model-parallel group), so no stage updates its
weights before the last has reached its own step.

Micro-batches are not named in the instructions (they carry a buffer id, as DeepSpeed's do), but under 1F1B every
stage runs each kind of per-micro-batch instruction in micro-batch order (so do ZB-H1 and early recompute),
so the k-th of a kind belongs to micro-batch k; that is how a send finds its recv.

`simulate_stages` replays stages given each one's `StageCosts` (the planner's, priced by
parallel/planning/stage_price.py, or a traced run's), and `lower_bound_s` is what no schedule of them beats.
"""

import functools
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from parallel.planning.schedules import posts_sends, train_schedule

PER_STEP = ("ReduceTiedGrads", "ReduceGrads", "OptimizerStep")
"""Instructions that run once per step; every other kind runs once per micro-batch."""
COMPUTE = (
    "LoadMicroBatch",
    "ForwardPass",
    "BackwardPass",
    "BackwardInput",
    "BackwardWeight",
    "RecomputeEarly",
    "OptimizerStep",
)
"""What counts as busy (parallel/measurement/trace.py's split): the rest is communication or waiting."""


@dataclass(frozen=True)
class StageCosts:
    """Seconds of each instruction on one stage (per micro-batch, or per step for the last three)."""

    forward: float
    backward: float
    """Without the recompute the plan adds."""
    recompute: float
    """What the plan's recompute adds to each backward pass (or runs as RecomputeEarly)."""
    send_activation: float
    send_grad: float
    reduce_tied: float
    reduce_grads: float
    optimizer: float
    load: float = 0.0
    weight_grad: float = 0.0
    """The part of `backward` that ZB-H1 defers into a BackwardWeight: the Linear layers' weight gradients."""
    backward_input: float | None = None
    """ZB-H1's B without the recompute: the split backward as it runs it (it keeps what W needs); None: `backward` less
    `weight_grad` (a traced run's costs, where B and W were timed apart)."""
    exchange: float = 0.0
    """A schedule with virtual stages: the rank's post of one boundary's batch of messages (parallel/planning/
    virtual_sim.py), beyond what the simulator times (MeasuredSeconds.exchange)."""

    def by_instruction(self, early: bool = False) -> dict[str, float]:
        """Seconds by instruction name (DeepSpeed's and parallel/planning/schedules.py's); `early`: the stage runs
        its recompute as RecomputeEarly, not inside its backward."""
        inside = 0.0 if early else self.recompute
        return {
            "LoadMicroBatch": self.load,
            "ForwardPass": self.forward,
            "BackwardPass": self.backward + inside,
            "BackwardInput": (self.backward - self.weight_grad if self.backward_input is None else self.backward_input)
            + inside,
            "BackwardWeight": self.weight_grad,
            "RecomputeEarly": self.recompute,
            "SendActivation": self.send_activation,
            "RecvActivation": self.send_activation,
            "SendGrad": self.send_grad,
            "RecvGrad": self.send_grad,
            "ReduceTiedGrads": self.reduce_tied,
            "ReduceGrads": self.reduce_grads,
            "OptimizerStep": self.optimizer,
        }


@dataclass(frozen=True)
class Instruction:
    stage: int
    index: int
    """Position in the stage's instruction list."""
    name: str
    """The instruction's class name (parallel/planning/schedules.py's, DeepSpeed's too): ForwardPass, SendActivation,
    ReduceTiedGrads, ..."""
    micro_batch: int | None
    """None for the once-per-step instructions."""


@dataclass(frozen=True)
class Interval:
    instruction: Instruction
    posted_s: float
    """When the stage reached the instruction (a rendezvous may start later)."""
    start_s: float
    end_s: float


@dataclass(frozen=True)
class Timeline:
    stages: int
    micro_batches: int
    intervals: tuple[Interval, ...]
    """Every instruction of every stage, in completion order."""

    @property
    def step_time_s(self) -> float:
        return max(i.end_s for i in self.intervals)

    def of_stage(self, stage: int) -> list[Interval]:
        """The stage's intervals in its schedule order."""
        return sorted((i for i in self.intervals if i.instruction.stage == stage), key=lambda i: i.instruction.index)

    def busy_s(self, stage: int) -> float:
        """Seconds the stage computes (load, forward, backward, optimizer step), as a traced run's
        `stage_busy_s` counts them; transfers, reduces and waits are idle."""
        return sum(i.end_s - i.start_s for i in self.of_stage(stage) if i.instruction.name in COMPUTE)

    def idle_s(self, stage: int) -> float:
        return self.step_time_s - self.busy_s(stage)


@functools.lru_cache(maxsize=1024)
def instructions(
    micro_batches: int,
    stages: int,
    stage: int,
    schedule: str = "1f1b",
    early: bool = False,
    deferred: int | None = None,
) -> tuple[Instruction, ...]:
    """The stage's training schedule (parallel/planning/schedules.py's `train_schedule`, with the stage plan's
    `early` and `deferred_weights`), flattened, each instruction with its micro-batch (cached: the balanced
    partition simulates one shape many times)."""
    seen: Counter[str] = Counter()
    out = []
    for command in train_schedule(schedule, early, micro_batches, stages, stage, deferred).commands():
        name = type(command).__name__
        micro_batch = None if name in PER_STEP else seen[name]
        seen[name] += 1
        out.append(Instruction(stage, len(out), name, micro_batch))
    return tuple(out)


ASYNC_SENDS = ("SendActivation", "SendGrad")
ASYNC_RECVS = ("RecvActivation", "RecvGrad")


def _meeting(ins: Instruction, stages: int, clip_barrier: bool, tied: bool) -> tuple | None:
    """The rendezvous an instruction takes part in (the same key on every side), or None when local. `tied`: the
    first and last stages hold copies of one weight, whose gradients ReduceTiedGrads all-reduces (an untied LM head
    has no such collective: the instruction is local)."""
    m = ins.micro_batch
    if ins.name == "SendActivation":
        return ("activation", ins.stage, m)
    if ins.name == "RecvActivation":
        return ("activation", ins.stage - 1, m)
    if ins.name == "SendGrad":
        return ("grad", ins.stage, m)
    if ins.name == "RecvGrad":
        return ("grad", ins.stage + 1, m)
    if ins.name == "ReduceTiedGrads" and tied and stages > 1 and ins.stage in (0, stages - 1):
        return ("tied",)
    if ins.name == "OptimizerStep" and clip_barrier and stages > 1:
        return CLIP
    return None


CLIP = ("clip",)
"""The optimizer steps' barrier under clipping: every stage takes part, and each then runs its own step."""


def simulate(
    micro_batches: int,
    stages: int,
    cost: Callable[[Instruction], float],
    schedule: str = "1f1b",
    early: bool | Sequence[bool] = False,
    deferred: Sequence[int | None] | None = None,
    clip_barrier: bool = False,
    tied: bool = True,
) -> Timeline:
    """Replay `schedule` with `cost(instruction)` seconds per instruction; `early` (one for every stage, or
    one per stage) and `deferred` (per stage, zb-h1) as the stage plans say; `tied`: the model ties its embedding
    and LM head (ReduceTiedGrads a meeting of the first and last stages). A rendezvous lasts the shorter of
    its sides' costs: a measured blocking call includes its wait, and the side that arrived last waited least.
    `clip_barrier` (the run clips its gradients): every stage's OptimizerStep starts when the last stage reaches its
    own, and lasts its own cost (a traced run's OptimizerStep already holds that wait: replay it without).

    Under DeepSpeed's own 1F1B every send is a rendezvous (its p2p is a blocking send on gloo). The schedules
    of parallel/planning/schedules.py (zb-h1, or any stage early: `posts_sends`) run on an engine that posts its
    sends: a send only posts (no time on the sender), and its recv ends `cost(recv)` after both sides have posted.
    That is also how a step that sends its activation first runs, its RecvGrad posted with the send as one batch
    (`p2p_batches`): the activation goes at the SendActivation, and the gradient's receive ends when both sides have
    posted it."""
    early_of = [early] * stages if isinstance(early, bool) else list(early)
    deferred_of = [None] * stages if deferred is None else list(deferred)
    async_sends = posts_sends(schedule, early_of)
    programs = [instructions(micro_batches, stages, s, schedule, early_of[s], deferred_of[s]) for s in range(stages)]
    clock = [0.0] * stages
    pc = [0] * stages
    posted: dict[tuple, list[tuple[Instruction, float]]] = {}
    sent: dict[tuple, float] = {}
    intervals: list[Interval] = []
    while any(pc[s] < len(programs[s]) for s in range(stages)):
        progressed = False
        for s in range(stages):
            while pc[s] < len(programs[s]):
                ins = programs[s][pc[s]]
                key = _meeting(ins, stages, clip_barrier, tied)
                if key is None:
                    end = clock[s] + cost(ins)
                    intervals.append(Interval(ins, clock[s], clock[s], end))
                    clock[s], pc[s], progressed = end, pc[s] + 1, True
                    continue
                if async_sends and ins.name in ASYNC_SENDS:
                    sent[key] = clock[s]
                    intervals.append(Interval(ins, clock[s], clock[s], clock[s]))
                    pc[s], progressed = pc[s] + 1, True
                    continue
                if async_sends and ins.name in ASYNC_RECVS:
                    if key not in sent:
                        break  # blocked until the peer's send is posted
                    start = max(clock[s], sent.pop(key))
                    intervals.append(Interval(ins, clock[s], start, start + cost(ins)))
                    clock[s], pc[s], progressed = start + cost(ins), pc[s] + 1, True
                    continue
                parties = posted.setdefault(key, [])
                if all(p.stage != s for p, _ in parties):
                    parties.append((ins, clock[s]))
                if len(parties) < (stages if key == CLIP else 2):
                    break  # blocked until the peers arrive
                start = max(t for _, t in parties)
                shortest = min(cost(p) for p, _ in parties)
                for p, t in parties:
                    end = start + (cost(p) if key == CLIP else shortest)
                    intervals.append(Interval(p, t, start, end))
                    clock[p.stage], pc[p.stage] = end, pc[p.stage] + 1
                del posted[key]
                progressed = True
        if not progressed:
            stuck = {s: programs[s][pc[s]].name for s in range(stages) if pc[s] < len(programs[s])}
            raise RuntimeError(f"the schedule deadlocks under rendezvous sends: stages blocked at {stuck}")
    return Timeline(stages, micro_batches, tuple(intervals))


def simulate_stages(
    costs: Sequence[StageCosts],
    micro_batches: int,
    schedule: str = "1f1b",
    early: bool | Sequence[bool] = False,
    deferred: Sequence[int | None] | None = None,
    clip_barrier: bool = False,
    tied: bool = True,
) -> Timeline:
    """The simulated step of stages with these costs. `early` (for all stages, or per stage): the stage runs
    its recompute as RecomputeEarly (never the last, which never waits for a gradient: it recomputes inside
    its backward). `deferred`: each stage plan's `deferred_weights` (zb-h1). `clip_barrier`, `tied`: see
    `simulate`."""
    last = len(costs) - 1
    early_of = [early] * len(costs) if isinstance(early, bool) else list(early)
    early_of = [e and s < last for s, e in enumerate(early_of)]
    seconds = [c.by_instruction(early_of[s]) for s, c in enumerate(costs)]
    return simulate(
        micro_batches,
        len(costs),
        lambda ins: seconds[ins.stage][ins.name],
        schedule,
        early_of,
        deferred,
        clip_barrier,
        tied,
    )


def lower_bound_s(costs: Sequence[StageCosts], micro_batches: int, early: bool = True) -> float:
    """No schedule of these stages takes less: the longest of, on each stage s, (a) micro-batch 0's forward
    through the stages before s, then all of s's own work; (b) the same start, s's forwards and B's (W's may
    come later), then the chain micro-batch `micro_batches - 1`'s gradient still has to travel: each earlier
    stage's B and its transfer, then stage 0's last W and its once-per-step work. `early` (the default, the
    bound a schedule with early recompute is held to): the recompute of every stage but the last is off the
    gradient chain."""
    last = len(costs) - 1
    seconds = [c.by_instruction(early and s < last) for s, c in enumerate(costs)]
    per_step = [sec["ReduceTiedGrads"] + sec["ReduceGrads"] + sec["OptimizerStep"] for sec in seconds]
    forward = [sec["LoadMicroBatch"] + sec["ForwardPass"] for sec in seconds]
    b = [sec["BackwardInput"] + (sec["RecomputeEarly"] if early and s < last else 0.0) for s, sec in enumerate(seconds)]
    bound = 0.0
    for s, sec in enumerate(seconds):
        start = sum(forward[r] + seconds[r]["SendActivation"] for r in range(s))
        work = micro_batches * (forward[s] + b[s] + sec["BackwardWeight"]) + per_step[s]
        # Below s the last gradient meets each stage's B (its early recompute ran before the RecvGrad).
        chain = sum(seconds[r + 1]["SendGrad"] + seconds[r]["BackwardInput"] for r in range(s))
        tail = chain + seconds[0]["BackwardWeight"] + per_step[0]
        bound = max(bound, start + work, start + micro_batches * (forward[s] + b[s]) + tail)
    return bound
