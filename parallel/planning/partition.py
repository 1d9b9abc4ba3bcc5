"""Stage partitioning as a pure function of (layers, stages, method).

`parameters`, `uniform` and `type:REGEX` are the partition methods of DeepSpeed's `PipelineModule`, written out
here (`uniform_bounds`, `balanced_bounds`: tests/test_partition_matches_deepspeed.py checks them against
DeepSpeed 0.19.8's), so the plan printed at start-up and the dry run's stages are the partition training really
gets (a test checks `PipelineModule.parts`). Parameters are counted on the meta device (model.layer_param_counts):
no memory, even for gpt3-175b. `balanced` is ours: `balanced_block_counts` splits the blocks so that the slowest
stage is as fast as it can be, given a stage's time as a function of its block count
(parallel/planning/layout.py supplies it from the step-time model), and `stages_of_block_counts` turns the counts
into stage ranges.
"""

import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import accumulate

from model import BLOCK_CLASSES, LayerRecipe, layer_param_counts


@dataclass(frozen=True)
class StageRange:
    stage: int
    start: int
    """First flat layer index of the stage."""
    stop: int
    """One past the last flat layer index."""

    @property
    def layers(self) -> range:
        return range(self.start, self.stop)


def partition_layers(recipes: Sequence[LayerRecipe], num_stages: int, method: str) -> list[StageRange]:
    if method == "uniform":
        bounds = uniform_bounds(len(recipes), num_stages)
    elif method == "parameters":
        bounds = balanced_bounds(layer_param_counts(recipes), num_stages)
    elif method.startswith("type:"):
        pattern = re.compile(method.split(":", 1)[1], re.IGNORECASE)
        bounds = balanced_bounds([1 if pattern.search(r.module_class.__name__) else 0 for r in recipes], num_stages)
    else:
        raise ValueError(
            f"parallel.partition_method={method!r} is unknown here (balanced: see parallel/planning/layout.py)"
        )
    return [StageRange(s, bounds[s], bounds[s + 1]) for s in range(num_stages)]


def stages_of_parts(parts: Sequence[int]) -> list[StageRange]:
    """Stage ranges from DeepSpeed's `parts` (each stage's first layer, then one past the last)."""
    return [StageRange(s, parts[s], parts[s + 1]) for s in range(len(parts) - 1)]


def uniform_bounds(items: int, parts: int) -> list[int]:
    """The `parts + 1` boundaries of `items` split into runs as even as can be, the longer runs first (DeepSpeed's
    `partition_uniform`); with fewer items than parts, one each to the first parts."""
    size, longer = divmod(items, parts)
    return [part * size + min(part, longer) for part in range(parts + 1)]


def balanced_bounds(weights: Sequence[int], parts: int) -> list[int]:
    """The `parts + 1` boundaries of `weights` split into non-empty runs whose sums are close together: DeepSpeed
    0.19.8's `partition_balanced`, a dynamic programme over prefixes that keeps, for the first i items in j runs,
    the split with the smallest spread (largest run sum minus smallest) that extends a kept split of fewer items,
    the later cut on a tie. (It is not always the split of least spread: a prefix keeps only one split.) With no
    more items than parts, `uniform_bounds`. Sums are compared as floats, as DeepSpeed's numpy arrays hold them.
    O(items^2 x parts)."""
    items = len(weights)
    if items <= parts:
        return uniform_bounds(items, parts)
    prefix = [0.0] + [float(total) for total in accumulate(weights)]
    # For the first i items in j runs: the kept split's spread, largest and smallest run, and where its last run
    # starts. No runs yet: largest 0, smallest unset (inf), so the first run sets both.
    spread = [[math.inf] * (parts + 1) for _ in range(items + 1)]
    largest = [[math.inf] * (parts + 1) for _ in range(items + 1)]
    smallest = [[math.inf] * (parts + 1) for _ in range(items + 1)]
    last_start = [[0] * (parts + 1) for _ in range(items + 1)]
    spread[0][0] = largest[0][0] = 0.0
    for i in range(1, items + 1):
        for j in range(1, min(i, parts) + 1):
            # The first run starts at 0; a later one where the j - 1 runs before it have an item each.
            for start in range(j - 1, i) if j > 1 else (0,):
                run = prefix[i] - prefix[start]
                high, low = max(largest[start][j - 1], run), min(smallest[start][j - 1], run)
                if spread[i][j] >= high - low:
                    spread[i][j], largest[i][j], smallest[i][j], last_start[i][j] = high - low, high, low, start
    bounds = [items]
    for j in range(parts, 0, -1):
        bounds.append(last_start[bounds[-1]][j])
    return bounds[::-1]


def balanced_block_counts(
    blocks: int, num_stages: int, stage_time: Callable[[int, int], float | None], max_per_stage: int | None = None
) -> list[int] | None:
    """Blocks per stage, each stage at least one, minimising the largest `stage_time(stage, blocks)` (None:
    that stage cannot hold that many, e.g. over its memory budget, nor any more). The slowest stage is
    exact; among splits as fast, the one with the smaller sum of squared stage times is preferred (a
    heuristic tie-break towards even stages: the caller's simulation decides the rest).
    Returns None when no split is feasible. A dynamic programme over block prefixes: O(stages x blocks x
    max_per_stage) calls to a (memoised) stage_time."""
    if blocks < num_stages:
        raise ValueError(f"cannot give each of {num_stages} stages a block: the model has {blocks}")
    most = min(max_per_stage or blocks, blocks - num_stages + 1)
    memo: dict[tuple[int, int], float | None] = {}

    def time_of(stage: int, n: int) -> float | None:
        if (stage, n) not in memo:
            memo[(stage, n)] = stage_time(stage, n)
        return memo[(stage, n)]

    # best[k]: (bottleneck, sum of squares, counts) over the stages so far, holding k blocks in all.
    best: dict[int, tuple[float, float, tuple[int, ...]]] = {0: (0.0, 0.0, ())}
    for stage in range(num_stages):
        left = num_stages - stage - 1  # stages after this one, one block each at least
        nxt: dict[int, tuple[float, float, tuple[int, ...]]] = {}
        for k, (worst, squares, counts) in best.items():
            sizes = [blocks - k] if left == 0 else range(1, blocks - left - k + 1)
            for n in sizes:
                t = time_of(stage, n) if 1 <= n <= most else None
                if t is None:
                    break  # a stage that cannot hold n blocks cannot hold more
                key = (max(worst, t), squares + t * t, counts + (n,))
                if k + n not in nxt or key[:2] < nxt[k + n][:2]:
                    nxt[k + n] = key
        best = nxt
    return list(best[blocks][2]) if blocks in best else None


def block_positions(recipes: Sequence[LayerRecipe], stage: "StageRange") -> list[int]:
    """The local indices of `stage`'s transformer blocks."""
    return [local for local, flat in enumerate(stage.layers) if recipes[flat].module_class in BLOCK_CLASSES]


def stages_of_block_counts(recipes: Sequence[LayerRecipe], counts: Sequence[int]) -> list[StageRange]:
    """Stage ranges holding `counts` blocks each: the layers before the first block (embeddings) on the
    first stage, those after the last block (final norm, head) on the last."""
    block_at = [i for i, r in enumerate(recipes) if r.module_class in BLOCK_CLASSES]
    cuts, seen = [0], 0
    for n in counts[:-1]:
        seen += n
        cuts.append(block_at[seen])
    cuts.append(len(recipes))
    return [StageRange(s, cuts[s], cuts[s + 1]) for s in range(len(counts))]
