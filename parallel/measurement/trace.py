"""The per-instruction trace of one training step: what every rank executed, when, on one clock.

DeepSpeed's `PipelineEngine._exec_schedule` runs each instruction of the stage's schedule (the planned programme
in DeepSpeed's instruction classes: parallel/runtime/ds_schedule.py) through `self._INSTRUCTION_MAP[type(cmd)]`,
looked up on the engine. For the traced step an instance-level map of timed wrappers shadows the class's map;
deleting it afterwards restores the class's map, so untraced steps run DeepSpeed's own code with nothing added.
The engine of a virtual-stage schedule (parallel/runtime/virtual_engine.py) runs its rank's programme itself and
times each instruction, and each boundary's batch of messages, through the recorder it is handed for the traced
step (`record_programme`); an untraced step is handed none.
The recompute that autograd runs inside a backward pass reaches the trace through parallel/runtime/recompute.py's
`observe_recompute`.

The clock: a barrier before the step, and each rank's `perf_counter` at barrier exit is its zero. A
second barrier right after measures how far apart the ranks leave a barrier: the residual skew. The instruction
edges are marks of parallel/measurement/step_clock.py's clock (CUDA events on CUDA, read after the step, so the
traced step runs as an untraced one does), collected by a `StepRecorder` and turned into seconds at the step's end.
"""

from collections import Counter
from collections.abc import Iterator
from contextlib import AbstractContextManager, ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import torch.distributed as dist

from parallel.measurement.step_clock import CudaEventClock, HostClock, step_clock
from parallel.planning.step_sim import PER_STEP
from parallel.runtime.recompute import observe_recompute

RECOMPUTE = "Recompute"


@dataclass(frozen=True)
class Interval:
    name: str
    """The instruction's class name (ForwardPass, SendGrad, ...), or Recompute."""
    start_s: float
    """Seconds since this rank's clock zero (the barrier before the step)."""
    end_s: float
    buffer_id: int | None = None
    micro_batch: int | None = None
    virtual_stage: int | None = None
    """The chunk's virtual stage under a virtual-stage schedule (None: one stage per rank, or once per step)."""

    @property
    def duration_s(self) -> float:
        return self.end_s - self.start_s


@dataclass
class RankTrace:
    rank: int
    stage: int
    """The pipeline rank's place in the pipeline (under a virtual-stage schedule its chunks' virtual stages are each
    interval's `virtual_stage`)."""
    dp_rank: int
    instructions: list[Interval] = field(default_factory=list)
    """Every instruction this rank executed, in execution order."""
    recomputes: list[Interval] = field(default_factory=list)
    """Each outermost recompute (a checkpoint's, or an output-discarding one), nested inside a BackwardPass (or
    BackwardInput, or RecomputeEarly)."""
    end_s: float = 0.0
    """When `train_batch` returned (loss averaged and broadcast)."""
    barrier_exit_s: float = 0.0
    """When this rank left the second barrier: across ranks, the spread of these is the residual skew."""


@dataclass(frozen=True)
class StepTrace:
    step: int
    micro_batches: int
    stages: int
    """The pipeline's ranks per replica (under a virtual-stage schedule, not its virtual stages)."""
    ranks: list[RankTrace]
    schedule: str | None = None
    """The virtual-stage schedule that ran (None: one stage per rank, named by what its trace shows)."""

    @property
    def step_time_s(self) -> float:
        """From the common zero to the last rank's return from `train_batch`."""
        return max(r.end_s for r in self.ranks)

    @property
    def clock_skew_s(self) -> float:
        exits = [r.barrier_exit_s for r in self.ranks]
        return max(exits) - min(exits)


class StepRecorder:
    """The bookkeeping of one traced step, free of process groups: timed wrappers of instruction handlers and a
    bracket for recomputes, each edge a mark of `clock`; `finish` turns the marks into Intervals."""

    def __init__(self, clock: HostClock | CudaEventClock):
        self.clock = clock
        self._counts: Counter = Counter()
        self._running: int | None = None
        """The micro-batch of the instruction running now: a recompute belongs to it (a BackwardPass or
        BackwardInput, or a RecomputeEarly)."""
        self._running_stage: int | None = None
        """Its chunk's virtual stage, under a virtual-stage schedule."""
        self._recompute_depth = 0
        self._instructions: list[tuple] = []
        self._recomputes: list[tuple] = []
        """(name, start mark, end mark, buffer id, micro-batch, virtual stage), unread until `finish`."""

    def timed(self, name: str, fn):
        """`fn`, a handler of DeepSpeed's instruction map, timed: the k-th instruction of a kind run once per
        micro-batch is micro-batch k's, in micro-batch order under every one-stage-per-rank schedule."""

        def timed(engine, **kwargs):
            micro_batch = None
            if name not in PER_STEP:
                micro_batch = self._counts[name]
                self._counts[name] += 1
            with self.instruction(name, micro_batch, kwargs.get("buffer_id")):
                return fn(engine, **kwargs)

        return timed

    @contextmanager
    def instruction(
        self, name: str, micro_batch: int | None, buffer_id: int | None = None, virtual_stage: int | None = None
    ) -> Iterator[None]:
        """Brackets one instruction (a recompute inside it belongs to its micro-batch and virtual stage)."""
        self._running, self._running_stage = micro_batch, virtual_stage
        start = self.clock.mark()
        try:
            yield
        finally:
            self._instructions.append((name, start, self.clock.mark(), buffer_id, micro_batch, virtual_stage))

    @contextmanager
    def recompute(self):
        """Brackets one recompute; a recompute inside another (none in today's plans) counts in the outer."""
        self._recompute_depth += 1
        start = self.clock.mark()
        try:
            yield
        finally:
            self._recompute_depth -= 1
            if self._recompute_depth == 0:
                self._recomputes.append((RECOMPUTE, start, self.clock.mark(), None, self._running, self._running_stage))

    def finish(self) -> tuple[list[Interval], list[Interval], float]:
        """(instructions, recomputes, now), in seconds since the clock's start: read once, after the step."""
        records = self._instructions + self._recomputes
        marks = [mark for record in records for mark in record[1:3]] + [self.clock.mark()]
        seconds = self.clock.seconds(marks)
        intervals = [
            Interval(name, seconds[2 * i], seconds[2 * i + 1], buffer_id, micro_batch, virtual_stage)
            for i, (name, _, _, buffer_id, micro_batch, virtual_stage) in enumerate(records)
        ]
        count = len(self._instructions)
        return intervals[:count], intervals[count:], seconds[-1]


@runtime_checkable
class ProgrammeEngine(Protocol):
    """An engine that runs its rank's programme itself (parallel/runtime/virtual_engine.py) and times it through the
    recorder it is handed for a step."""

    schedule: str

    def record_programme(self, recorder: StepRecorder) -> AbstractContextManager: ...


@contextmanager
def _instruction_map_timed(engine, recorder: StepRecorder) -> Iterator[None]:
    """DeepSpeed's PipelineEngine with an instance-level map of timed handlers over its class's map."""
    engine._INSTRUCTION_MAP = {
        kind: recorder.timed(kind.__name__, fn) for kind, fn in type(engine)._INSTRUCTION_MAP.items()
    }
    try:
        yield
    finally:
        del engine._INSTRUCTION_MAP  # the class's map again: untraced steps pay nothing


class StepTracer:
    """Traces step `step` (None: none). Every rank calls `begin(step)` before and `end(step)` after each
    `train_batch`, and `gather()` once after the last step (collectives on the traced step only)."""

    def __init__(self, engine, step: int | None, device: str):
        self.engine = engine
        self.step = step
        self._device = device
        self._trace: RankTrace | None = None

    def begin(self, step: int) -> None:
        if step != self.step:
            return
        engine = self.engine
        self._recorder = StepRecorder(step_clock(self._device))
        dist.barrier()
        self._recorder.clock.start()
        dist.barrier()
        (barrier_exit,) = self._recorder.clock.seconds([self._recorder.clock.mark()])
        self._trace = RankTrace(
            rank=dist.get_rank(),
            stage=engine.stage_id,
            dp_rank=engine.grid.get_data_parallel_rank(),
            barrier_exit_s=barrier_exit,
        )
        self._observing = ExitStack()
        if isinstance(engine, ProgrammeEngine):
            self._observing.enter_context(engine.record_programme(self._recorder))
        else:
            self._observing.enter_context(_instruction_map_timed(engine, self._recorder))
        self._observing.enter_context(observe_recompute(self._recorder.recompute))

    def end(self, step: int) -> None:
        if step != self.step or self._trace is None:
            return
        self._observing.close()
        self._trace.instructions, self._trace.recomputes, self._trace.end_s = self._recorder.finish()

    def gather(self) -> StepTrace | None:
        """Collective on every rank when a step was traced: the rank holding the loss (the last stage's, or under a V
        rank 0's, on the first data-parallel replica) gets every rank's trace; the others get None."""
        if self._trace is None:
            return None
        engine = self.engine
        gathered: list[RankTrace | None] = [None] * dist.get_world_size()
        # to every rank: which rank holds the loss depends on the schedule (a V's is rank 0)
        dist.all_gather_object(gathered, self._trace)
        if not (engine.is_last_stage() and engine.grid.get_data_parallel_rank() == 0):
            return None
        ranks = sorted(gathered, key=lambda r: (r.stage, r.dp_rank))
        schedule = engine.schedule if isinstance(engine, ProgrammeEngine) else None
        return StepTrace(self.step, engine.micro_batches, engine.num_stages, ranks, schedule)
