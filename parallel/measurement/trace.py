"""The per-instruction trace of one training step: what every rank executed, when, on one clock.

DeepSpeed's `PipelineEngine._exec_schedule` runs each instruction of the stage's schedule (the planned programme
in DeepSpeed's instruction classes: parallel/runtime/ds_schedule.py) through `self._INSTRUCTION_MAP[type(cmd)]`,
looked up on the engine. For the traced step an instance-level map of timed wrappers shadows the class's map;
deleting it afterwards restores the class's map, so untraced steps run DeepSpeed's own code with nothing added.
The recompute that autograd runs inside a backward pass reaches the trace through parallel/runtime/recompute.py's
`observe_recompute`.

The clock: a barrier before the step, and each rank's `perf_counter` at barrier exit is its zero. A
second barrier right after measures how far apart the ranks leave a barrier: the residual skew.
"""

import time
from collections import Counter
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

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

    @property
    def duration_s(self) -> float:
        return self.end_s - self.start_s


@dataclass
class RankTrace:
    rank: int
    stage: int
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
    ranks: list[RankTrace]

    @property
    def step_time_s(self) -> float:
        """From the common zero to the last rank's return from `train_batch`."""
        return max(r.end_s for r in self.ranks)

    @property
    def clock_skew_s(self) -> float:
        exits = [r.barrier_exit_s for r in self.ranks]
        return max(exits) - min(exits)


class StepTracer:
    """Traces step `step` (None: none). Every rank calls `begin(step)` before and `end(step)` after each
    `train_batch`, and `gather()` once after the last step (collectives on the traced step only)."""

    def __init__(self, engine, step: int | None, device: str):
        self.engine = engine
        self.step = step
        self._sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
        self._trace: RankTrace | None = None
        self._t0 = 0.0
        self._counts: Counter = Counter()
        self._running: int | None = None
        """The micro-batch of the instruction running now: a recompute belongs to it (a BackwardPass or
        BackwardInput, or a RecomputeEarly)."""
        self._recompute_depth = 0

    def _now(self) -> float:
        self._sync()  # CUDA: the interval's kernels are done (only while tracing)
        return time.perf_counter() - self._t0

    def begin(self, step: int) -> None:
        if step != self.step:
            return
        engine = self.engine
        dist.barrier()
        self._t0 = time.perf_counter()
        dist.barrier()
        self._trace = RankTrace(
            rank=dist.get_rank(),
            stage=engine.stage_id,
            dp_rank=engine.grid.get_data_parallel_rank(),
            barrier_exit_s=self._now(),
        )
        wrapped = {kind: self._timed(kind.__name__, fn) for kind, fn in type(engine)._INSTRUCTION_MAP.items()}
        engine._INSTRUCTION_MAP = wrapped  # shadows the class's map on this engine only
        self._observing = ExitStack()
        self._observing.enter_context(observe_recompute(self._recompute))

    def end(self, step: int) -> None:
        if step != self.step or self._trace is None:
            return
        self._observing.close()
        del self.engine._INSTRUCTION_MAP  # the class's map again: untraced steps pay nothing
        self._trace.end_s = self._now()

    def _timed(self, name: str, fn):
        def timed(engine, **kwargs):
            micro_batch = None
            if name not in PER_STEP:  # once per micro-batch, in micro-batch order under every schedule
                micro_batch = self._counts[name]
                self._counts[name] += 1
            self._running = micro_batch
            start = self._now()
            try:
                return fn(engine, **kwargs)
            finally:
                self._trace.instructions.append(
                    Interval(name, start, self._now(), kwargs.get("buffer_id"), micro_batch)
                )

        return timed

    @contextmanager
    def _recompute(self):
        """Brackets one recompute; a recompute inside another (none in today's plans) counts in the outer."""
        self._recompute_depth += 1
        start = self._now()
        try:
            yield
        finally:
            self._recompute_depth -= 1
            if self._recompute_depth == 0:
                self._trace.recomputes.append(Interval(RECOMPUTE, start, self._now(), None, self._running))

    def gather(self) -> StepTrace | None:
        """Collective on every rank when a step was traced: the rank holding the loss (last stage, first
        data-parallel rank) gets every rank's trace; the others get None."""
        if self._trace is None:
            return None
        loss_rank = self.engine.grid.stage_to_global(self.engine.num_stages - 1, data=0)
        gathered = [None] * dist.get_world_size() if dist.get_rank() == loss_rank else None
        dist.gather_object(self._trace, gathered, dst=loss_rank)
        if gathered is None:
            return None
        ranks = sorted(gathered, key=lambda r: (r.stage, r.dp_rank))
        return StepTrace(self.step, self.engine.micro_batches, self.engine.num_stages, ranks)
