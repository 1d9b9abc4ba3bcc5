"""Robust seconds of many small workloads measured side by side: each runs once to warm up (allocator, kernels,
lazy initialisation), then all of them in turn, round after round (a load that comes and goes touches every
workload alike), and each one's figure is the median of its rounds after dropping those further than
OUTLIER_MADS median absolute deviations from the median (a round hit by a preemption)."""

import statistics
import time
from collections.abc import Callable

import torch

OUTLIER_MADS = 3.0
MIN_SECONDS = 2e-3
"""A workload shorter than this runs several times per round (timer resolution, launch jitter) and reports one."""


def robust_seconds(samples: list[float]) -> float:
    """The median of the samples within OUTLIER_MADS median absolute deviations of their median."""
    median = statistics.median(samples)
    mad = statistics.median(abs(s - median) for s in samples)
    kept = [s for s in samples if abs(s - median) <= OUTLIER_MADS * mad] if mad > 0 else samples
    return statistics.median(kept)


def _synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _timed(fn: Callable[[], object], device: str, calls: int) -> float:
    _synchronize(device)
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    _synchronize(device)
    return (time.perf_counter() - start) / calls


def interleaved_seconds(workloads: dict[str, Callable[[], object]], device: str, rounds: int) -> dict[str, float]:
    """Seconds of one call of each workload (see the module docstring)."""
    calls = {}
    for name, fn in workloads.items():
        fn()  # warm-up
        first = _timed(fn, device, 1)  # how many calls one round needs
        calls[name] = max(1, min(100, round(MIN_SECONDS / max(first, 1e-9))))
    samples: dict[str, list[float]] = {name: [] for name in workloads}
    for _ in range(rounds):
        for name, fn in workloads.items():
            samples[name].append(_timed(fn, device, calls[name]))
    return {name: robust_seconds(times) for name, times in samples.items()}
