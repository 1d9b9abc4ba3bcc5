"""Python's garbage collector in the training loop (train.gc_interval).

A full collection scans every object the collector tracks. harness/startup.py freezes what the imports made, but what
start-up builds after them (the engine, the model, DeepSpeed's state) stayed in the collector's sight, so one rank
stopped for tens of milliseconds in the middle of a step (36 ms on this CPU, at a 0.22 s step:
docs/step_time_benchmark.md) while the pipeline's other ranks waited for it. Once no step is left to meter, what is
alive is frozen out of later collections (gc.freeze): not before, since the tensor meters find tensors by walking the
collector's objects (parallel/measurement/tensor_peak.py), which leaves frozen ones out. With an interval, the
automatic collector is also off, and every rank collects between the same two steps (Megatron-LM's --manual-gc),
where no peer waits on it mid-step."""

import gc
import time


class GarbageCollection:
    """Entered before the first step, left after the last. Leaving unfreezes every frozen object and enables the
    collector again if it was: a Hydra sweep trains its jobs one after another in one process, and the engine is a
    cycle that must stay collectable when its job ends (sweep/callback.py's release_memory collects it, then freezes
    the survivors again)."""

    def __init__(self, interval: int):
        self.interval = interval
        self.was_enabled = gc.isenabled()
        self.frozen = False

    def __enter__(self) -> "GarbageCollection":
        if self.interval:
            gc.collect()  # start-up's garbage, before the automatic collector stops
            gc.disable()
        return self

    def __exit__(self, *exc) -> None:
        if self.frozen:
            gc.unfreeze()
        if self.was_enabled:
            gc.enable()

    def after_step(self, step: int, metering_done: bool) -> dict[str, float]:
        """At the end of `step`: freeze what is alive once `metering_done` (no step left for the tensor meters), and
        collect when the interval is due; metrics.jsonl's `gc_s`, the seconds a collection took."""
        record = {}
        if self.interval and step % self.interval == 0:
            start = time.perf_counter()
            gc.collect()
            record["gc_s"] = time.perf_counter() - start
        if metering_done and not self.frozen:
            gc.collect()  # this step's garbage: a frozen cycle is never collected
            gc.freeze()
            self.frozen = True
        return record
