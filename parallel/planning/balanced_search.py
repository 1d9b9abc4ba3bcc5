"""`parallel.partition_method=balanced`: the stage boundaries chosen together with each stage's plan. A
stage's price is its predicted forward + backward time (parallel/planning/step_costs.py) under the plan it would
get with that many blocks (a fixed mode's, or auto's cheapest that fits the stage's side of the budget, given
the micro-batches it holds in flight: parallel/planning/stage_planner.py), a dynamic programme minimises the
slowest stage, and single-block moves keep what shortens the simulated 1F1B step (parallel/planning/step_sim.py).
"""

import math

from parallel.planning.partition import balanced_block_counts
from parallel.planning.stage_planner import StagePlanner
from parallel.planning.step_costs import simulate_stages

RESOLUTION = 1e-3
"""A block move must shorten the simulated step by this fraction: smaller gains are below what the cost
model can tell apart, and chasing them makes uneven partitions for nothing."""


def balanced_counts(planner: StagePlanner, blocks: int, num_stages: int) -> list[int]:
    """Blocks per stage: the split whose slowest stage is fastest (parallel/planning/partition.py's programme), then
    single-block moves across a boundary while the simulated step gets shorter. When no split fits the
    budget, the even split, so that the budget check names the stage that cannot fit.

    Why simulate at all: under DeepSpeed's blocking sends, a stage's send of micro-batch m + 1 waits for its
    recv of m's gradient, so the step is not simply micro-batches x the slowest stage; the tail (the
    first stage finishes last, then the tied-gradient reduce) also matters."""
    even = [blocks // num_stages + (s < blocks % num_stages) for s in range(num_stages)]
    times = [planner.stage_time(s, n) for s, n in enumerate(even)]
    # No stage of the optimum is slower than the even split's slowest, and each block costs at least its
    # forward and backward: that bounds the blocks a stage can take, and with it the search. Where the even
    # split does not fit, the search stops at twice a stage's share (a limit, not a proof: it keeps the
    # planner's per-stage optimiser away from stages of ~all blocks, which take it seconds each).
    per_block = planner.timing.block_forward + planner.timing.block_backward
    if None not in times and per_block > 0:
        bound = int(max(times) / per_block) + 1
    else:
        bound = 2 * math.ceil(blocks / num_stages)
    counts = balanced_block_counts(blocks, num_stages, planner.stage_time, bound)
    if counts is None:
        return even
    best = _simulated(planner, counts)
    improved = True
    while improved:
        improved = False
        for boundary in range(num_stages - 1):
            for give in (1, -1):  # one block from stage boundary + 1 to boundary, or back
                trial = list(counts)
                trial[boundary] += give
                trial[boundary + 1] -= give
                if min(trial) < 1:
                    continue
                step = _simulated(planner, trial)
                if step is not None and step < best * (1 - RESOLUTION):
                    counts, best, improved = trial, step, True
    return counts


def _simulated(planner: StagePlanner, counts: list[int]) -> float | None:
    costs = [planner.stage_costs(s, n) for s, n in enumerate(counts)]
    if None in costs:
        return None
    return simulate_stages(costs, planner.run.micro_batches).step_time_s
