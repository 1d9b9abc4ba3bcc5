"""Stage partitioning as a pure function of (layers, stages, method).

It calls the same DeepSpeed routines `PipelineModule` uses, so the plan printed at start-up and the
dry run's stages are the partition training really gets (a test checks `PipelineModule.parts`).
Parameters are counted on the meta device (model.layer_param_counts): no memory, even for gpt3-175b.
"""

import re
from collections.abc import Sequence
from dataclasses import dataclass

from deepspeed.runtime.utils import partition_balanced, partition_uniform

from model import LayerRecipe, layer_param_counts


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
        raise ValueError(f"parallel.partition_method={method!r} is unknown")
    return [StageRange(s, int(parts[s]), int(parts[s + 1])) for s in range(num_stages)]
