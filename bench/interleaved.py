"""Variants timed side by side: every variant once per round, after one warm-up call each, so that a ratio compares
calls that saw the same machine state; every other round runs them in reverse, so none always runs first (after
another's garbage, or into a cold cache). bench/recompute_bench.py, bench/memory_floor_bench.py and
bench/nested_compress_bench.py time their in-process variants with it."""

import statistics
import time
from collections.abc import Callable

Seconds = dict[str, list[tuple[float, float]]]
"""Per variant, (process CPU seconds, wall seconds) of each round's call."""


def interleaved(variants: dict[str, Callable[[], object]], rounds: int) -> Seconds:
    """Call each of `variants` once per round for `rounds` rounds (one warm-up call each first)."""
    for run in variants.values():
        run()
    seconds: Seconds = {name: [] for name in variants}
    names = list(variants)
    for r in range(rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            cpu, wall = time.process_time(), time.perf_counter()
            variants[name]()
            seconds[name].append((time.process_time() - cpu, time.perf_counter() - wall))
    return seconds


def least_cpu(seconds: Seconds) -> dict[str, float]:
    """Each variant's least CPU seconds: what it costs when nothing else takes its core."""
    return {name: min(cpu for cpu, _ in calls) for name, calls in seconds.items()}


def median_cpu(seconds: Seconds) -> dict[str, float]:
    return {name: statistics.median(cpu for cpu, _ in calls) for name, calls in seconds.items()}


def median_wall(seconds: Seconds) -> dict[str, float]:
    return {name: statistics.median(wall for _, wall in calls) for name, calls in seconds.items()}
