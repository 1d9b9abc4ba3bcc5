"""What one stage holds and what each block of it could choose: the step between the per-layer models
(memory_model, flops, schedule) and the plans built on them (auto_recompute, layout, run_plan).

Both the auto optimiser and the run plan read a stage's fixed bytes and its per-block options from here,
so each is computed in one place.
"""

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from model import LayerRecipe
from parallel.memory_model import (
    LayerActivation,
    block_items,
    model_state_bytes,
    pipe_buffer_bytes,
    selective_combinations,
    stage_activations,
    total,
)
from parallel.partition import StageRange
from parallel.schedule import in_flight_micro_batches, pipe_buffers
from parallel.shapes import RunShape, Shape, Target
from parallel.stage_plan import StagePlan


@dataclass(frozen=True)
class BlockOption:
    """One per-block choice short of a full-recompute segment."""

    choice: str
    """`none` or `selective:<modules>`."""
    modules: tuple[str, ...]
    kept_bytes: int
    """Bytes one block keeps per micro-batch."""
    cost: float
    """Recompute cost of one block per micro-batch (FLOPs, FLOP-equivalents or seconds: the caller's unit)."""


def block_options(shape: Shape, target: Target, cost: Callable[[tuple[str, ...]], float]) -> list[BlockOption]:
    """`none`, then every selective combination, with the bytes each keeps and `cost(modules)`."""
    options = [BlockOption("none", (), total(block_items(shape, target)), 0.0)]
    options += [
        BlockOption("selective:" + "+".join(combo), combo, total(block_items(shape, target, combo)), float(cost(combo)))
        for combo in selective_combinations()
    ]
    return options


@dataclass(frozen=True)
class StageMemory:
    """What one stage holds during a step under one plan (bytes unless said otherwise)."""

    stage: int
    params: int
    """Trainable parameters (a tied module counts on each stage that holds it)."""
    states: dict[str, int]
    """Parameter, gradient and optimizer-state bytes: keys params, grads, optimizer."""
    in_flight: int
    """Micro-batches whose activations the stage holds at once under 1F1B."""
    pipe_buffers: int
    pipe_buffer_bytes: int
    layers: tuple[LayerActivation, ...]
    """Per-layer activation bytes per micro-batch (the loss last, on the last stage)."""

    @property
    def activation_bytes(self) -> int:
        """Kept for backward per micro-batch, the stage input included."""
        return sum(layer.bytes for layer in self.layers)

    @property
    def fixed_bytes(self) -> int:
        """Everything but the blocks' activations: what no recompute choice changes."""
        others = sum(layer.bytes for layer in self.layers if not layer.is_block)
        return sum(self.states.values()) + self.pipe_buffer_bytes + self.in_flight * others

    @property
    def predicted_peak_bytes(self) -> int:
        return sum(self.states.values()) + self.in_flight * self.activation_bytes + self.pipe_buffer_bytes


def stage_memory(
    recipes: Sequence[LayerRecipe],
    stage: StageRange,
    plan: StagePlan,
    shape: Shape,
    run: RunShape,
    param_counts: Sequence[int],
) -> StageMemory:
    """`param_counts`: parallel.partition.layer_param_counts(recipes), counted once per layout."""
    num_stages = run.topology.pipeline_stages
    is_last = stage.stage == num_stages - 1
    in_flight = in_flight_micro_batches(run.micro_batches, num_stages, stage.stage)
    buffers = pipe_buffers(run.micro_batches, num_stages, stage.stage)
    params = sum(param_counts[i] for i in stage.layers)
    return StageMemory(
        stage=stage.stage,
        params=params,
        states=model_state_bytes(params, run.target.precision, run.zero_stage, run.topology.data_parallel_size),
        in_flight=in_flight,
        pipe_buffers=buffers,
        pipe_buffer_bytes=pipe_buffer_bytes(stage.stage, is_last, shape, run.target, buffers, in_flight),
        layers=tuple(stage_activations(recipes, stage.layers, plan, shape, run.target, is_last)),
    )
