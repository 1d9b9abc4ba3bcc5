"""Python's garbage collector in the training loop (train.gc_interval).

A full collection scans every object the collector tracks: after start-up (torch, DeepSpeed, transformers, the model)
hundreds of thousands of them, so one rank stops for tens of milliseconds in the middle of a step (36 ms on this CPU,
at a 0.22 s step: docs/step_time_benchmark.md) while the pipeline's other ranks wait for it. Freezing what start-up
built (gc.freeze) takes those objects out of every later collection; with an interval, the automatic collector is off
and every rank collects between the same two steps (Megatron-LM's --manual-gc), where no peer waits on it mid-step."""

import gc
import time


class GarbageCollection:
    """Entered before the first step, left after the last. Leaving unfreezes every frozen object and enables the
    collector again if it was: a Hydra sweep trains its jobs one after another in one process, and the engine built
    before the first step is a cycle that must stay collectable when its job ends (sweep/callback.py's
    release_memory collects it, then freezes the survivors again; harness/startup.py froze the imports' objects)."""

    def __init__(self, interval: int):
        self.interval = interval
        self.was_enabled = gc.isenabled()

    def __enter__(self) -> "GarbageCollection":
        gc.collect()  # start-up's garbage, before what remains is frozen out of later collections
        gc.freeze()
        if self.interval:
            gc.disable()
        return self

    def __exit__(self, *exc) -> None:
        gc.unfreeze()
        if self.was_enabled:
            gc.enable()

    def after_step(self, step: int) -> dict[str, float]:
        """At the end of `step`: collect when the interval is due; metrics.jsonl's `gc_s`, the seconds it took."""
        if not self.interval or step % self.interval:
            return {}
        start = time.perf_counter()
        gc.collect()
        return {"gc_s": time.perf_counter() - start}
