"""`parallel.partition_method=balanced`: the stage boundaries chosen together with each stage's plan. A
stage's price is its predicted forward + backward time (parallel/planning/stage_price.py) under the plan it would
get with that many blocks (a fixed mode's, or auto's cheapest that fits the stage's side of the budget, given
the micro-batches it holds in flight: parallel/planning/stage_planner.py), a dynamic programme minimises the
slowest stage, and single-block moves keep what shortens the simulated 1F1B step (parallel/planning/step_sim.py).
"""

import math
from collections.abc import Callable
from functools import partial

from model import BLOCK_CLASSES
from parallel.planning.partition import StageRange, balanced_block_counts
from parallel.planning.stage_planner import StagePlanner
from parallel.planning.stage_price import StagePrice, simulate_priced

RESOLUTION = 1e-3
"""A block move must shorten the simulated step by this fraction: smaller gains are below what the cost
model can tell apart, and chasing them makes uneven partitions for nothing."""


class _BlockCountPrices:
    """Stage s holding n blocks, planned and priced once for each (s, n) the search asks about."""

    def __init__(self, planner: StagePlanner):
        self.planner = planner
        self._prices: dict[tuple[int, int], StagePrice | None] = {}

    def price(self, stage: int, blocks: int) -> StagePrice | None:
        """None when the stage cannot fit its side of the budget with that many blocks."""
        key = (stage, blocks)
        if key not in self._prices:
            self._prices[key] = self.planner.price(self._hypothetical(stage, blocks))
        return self._prices[key]

    def time(self, stage: int, blocks: int) -> float | None:
        """A micro-batch's forward and backward (recompute included) on the stage."""
        price = self.price(stage, blocks)
        return None if price is None else price.costs.forward + price.costs.backward + price.costs.recompute

    def _hypothetical(self, stage: int, blocks: int) -> StageRange:
        """Stage `stage` holding `blocks` blocks: blocks are identical, so only its ends matter."""
        recipes = self.planner.pricing.recipes
        n_layers, last = len(recipes), self.planner.pricing.run.topology.pipeline_stages - 1
        first_block = next(i for i, r in enumerate(recipes) if r.module_class in BLOCK_CLASSES)
        after_blocks = max(i for i, r in enumerate(recipes) if r.module_class in BLOCK_CLASSES) + 1
        start = 0 if stage == 0 else (after_blocks - blocks if stage == last else first_block)
        stop = n_layers if stage == last else start + blocks + (first_block if stage == 0 else 0)
        return StageRange(stage, start, stop)


def balanced_counts(planner: StagePlanner, blocks: int, num_stages: int) -> list[int]:
    """Blocks per stage: the split whose slowest stage is fastest (parallel/planning/partition.py's programme), then
    single-block moves across a boundary while the simulated step gets shorter. When no split fits the
    budget, the even split, so that the budget check names the stage that cannot fit.

    Why simulate at all: under DeepSpeed's blocking sends, a stage's send of micro-batch m + 1 waits for its
    recv of m's gradient, so the step is not simply micro-batches x the slowest stage; the tail (the
    first stage finishes last, then the tied-gradient reduce) also matters."""
    prices = _BlockCountPrices(planner)
    even = [blocks // num_stages + (s < blocks % num_stages) for s in range(num_stages)]
    times = [prices.time(s, n) for s, n in enumerate(even)]
    # No stage of the optimum is slower than the even split's slowest, and each block costs at least its
    # forward and backward: that bounds the blocks a stage can take, and with it the search. Where the even
    # split does not fit, the search stops at twice a stage's share (a limit, not a proof: it keeps the
    # planner's per-stage optimiser away from stages of ~all blocks, which take it seconds each).
    timing = planner.pricing.timing
    per_block = timing.block_forward + timing.block_backward
    if None not in times and per_block > 0:
        bound = int(max(times) / per_block) + 1
    else:
        bound = 2 * math.ceil(blocks / num_stages)
    counts = balanced_block_counts(blocks, num_stages, prices.time, bound)
    if counts is None:
        return even
    return shortened_by_single_moves(counts, partial(_simulated, prices))


def shortened_by_single_moves(counts: list[int], step_s: Callable[[list[int]], float | None]) -> list[int]:
    """`counts` (blocks per stage, or per virtual stage), improved by moving one block across a boundary at a time
    while the simulated step `step_s(counts)` (None: those counts do not fit) gets shorter by more than RESOLUTION."""
    best, improved = step_s(counts), True
    while improved:
        improved = False
        for boundary in range(len(counts) - 1):
            for give in (1, -1):  # one block from boundary + 1 to boundary, or back
                trial = list(counts)
                trial[boundary] += give
                trial[boundary + 1] -= give
                if min(trial) < 1:
                    continue
                step = step_s(trial)
                if step is not None and step < best * (1 - RESOLUTION):
                    counts, best, improved = trial, step, True
    return counts


def _simulated(prices: _BlockCountPrices, counts: list[int]) -> float | None:
    priced = [prices.price(s, n) for s, n in enumerate(counts)]
    if None in priced:
        return None
    return simulate_priced(priced).step_time_s
