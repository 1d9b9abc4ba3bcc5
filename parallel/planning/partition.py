"""Stage partitioning as a pure function of (layers, stages, method).

`parameters`, `uniform` and `type:REGEX` call the same DeepSpeed routines `PipelineModule` uses, so the plan
printed at start-up and the dry run's stages are the partition training really gets (a test checks
`PipelineModule.parts`). Parameters are counted on the meta device (model.layer_param_counts): no memory,
even for gpt3-175b. `balanced` is ours: `balanced_block_counts` splits the blocks so that the slowest
stage is as fast as it can be, given a stage's time as a function of its block count (parallel/planning/layout.py
supplies it from the step-time model), and `stages_of_block_counts` turns the counts into stage ranges.
"""

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from deepspeed.runtime.utils import partition_balanced, partition_uniform

from model import Block, LayerRecipe, layer_param_counts


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
        parts = partition_uniform(num_items=len(recipes), num_parts=num_stages)
    elif method == "parameters":
        parts = partition_balanced(weights=layer_param_counts(recipes), num_parts=num_stages)
    elif method.startswith("type:"):
        pattern = re.compile(method.split(":", 1)[1], re.IGNORECASE)
        weights = [1 if pattern.search(r.module_class.__name__) else 0 for r in recipes]
        parts = partition_balanced(weights=weights, num_parts=num_stages)
    else:
        raise ValueError(
            f"parallel.partition_method={method!r} is unknown here (balanced: see parallel/planning/layout.py)"
        )
    return [StageRange(s, int(parts[s]), int(parts[s + 1])) for s in range(num_stages)]


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


def stages_of_block_counts(recipes: Sequence[LayerRecipe], counts: Sequence[int]) -> list[StageRange]:
    """Stage ranges holding `counts` blocks each: the layers before the first block (embeddings) on the
    first stage, those after the last block (final norm, head) on the last."""
    block_at = [i for i, r in enumerate(recipes) if r.module_class is Block]
    cuts, seen = [0], 0
    for n in counts[:-1]:
        seen += n
        cuts.append(block_at[seen])
    cuts.append(len(recipes))
    return [StageRange(s, cuts[s], cuts[s + 1]) for s in range(len(counts))]
