"""Python's garbage collector in the training loop (train.gc_interval).

A full collection scans every object the collector tracks. harness/startup.py freezes what the imports made, but what
start-up builds after them (the engine, the model, DeepSpeed's state) stays in the collector's sight, so one rank can
stop for tens of milliseconds in the middle of a step (36 ms on this CPU, at a 0.22 s step:
docs/step_time_benchmark.md) while the pipeline's other ranks wait for it. Freezing that too is not an answer: the
tensor meters find tensors by walking the collector's objects (parallel/measurement/tensor_peak.py), which leaves
frozen ones out. With an interval, the automatic collector is off and every rank collects between the same two steps
(Megatron-LM's --manual-gc), where no peer waits on it mid-step."""

import gc
import time


class GarbageCollection:
    """Entered before the first step, left after the last, when the collector is enabled again if it was (a Hydra
    sweep trains its jobs one after another in one process)."""

    def __init__(self, interval: int):
        self.interval = interval
        self.was_enabled = gc.isenabled()

    def __enter__(self) -> "GarbageCollection":
        if self.interval:
            gc.collect()  # start-up's garbage, before the automatic collector stops
            gc.disable()
        return self

    def __exit__(self, *exc) -> None:
        if self.was_enabled:
            gc.enable()

    def after_step(self, step: int) -> dict[str, float]:
        """At the end of `step`: collect when the interval is due; metrics.jsonl's `gc_s`, the seconds it took."""
        if not self.interval or step % self.interval:
            return {}
        start = time.perf_counter()
        gc.collect()
        return {"gc_s": time.perf_counter() - start}
