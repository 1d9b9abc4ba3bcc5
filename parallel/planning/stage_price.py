"""One stage priced, in one place: what it holds (parallel/planning/stage_bytes.py's StageMemory), the seconds of
each of its instructions (step_sim.StageCosts, from parallel/planning/instruction_seconds.py's time model) and its FLOPs
(parallel/planning/flops.py), under one plan and schedule. The stage planner and the balanced search, the schedule
choice, the run plan and the simulated steps all price a stage with `price_stage`, and simulate priced stages with
`simulate_priced`.
"""

from collections.abc import Sequence
from dataclasses import dataclass, replace
from functools import cached_property

from model import LayerRecipe, layer_param_counts
from parallel.planning.flops import StageFlops, stage_flops
from parallel.planning.instruction_seconds import TimeModel, per_micro_batch_costs, stage_range_costs
from parallel.planning.memory_model import attention_kernel
from parallel.planning.partition import StageRange
from parallel.planning.shapes import RunShape, Shape
from parallel.planning.stage_bytes import StageMemory, stage_memory
from parallel.planning.stage_plan import StagePlan
from parallel.planning.step_sim import StageCosts, Timeline, simulate_stages


@dataclass(frozen=True)
class StagePricing:
    """What pricing any stage of one model and run needs, gathered once per layout."""

    recipes: tuple[LayerRecipe, ...]
    run: RunShape
    shape: Shape
    timing: TimeModel
    """The step-time model the seconds come from."""
    param_counts: tuple[int, ...]
    """model.layer_param_counts(recipes): each layer's parameters, counted on the meta device."""

    @classmethod
    def of(cls, recipes: Sequence[LayerRecipe], run: RunShape, shape: Shape, timing: TimeModel) -> "StagePricing":
        return cls(tuple(recipes), run, shape, timing, tuple(layer_param_counts(recipes)))

    def at(self, timing: TimeModel) -> "StagePricing":
        """The same stages priced with another step-time model (another device's rates)."""
        return replace(self, timing=timing)


@dataclass(frozen=True)
class StagePrice:
    """One stage under one plan and schedule. Each part is computed when first read: the balanced search reads
    only the seconds, the ZB-H1 deferral only the memory."""

    pricing: StagePricing
    stage: StageRange
    plan: StagePlan
    schedule: str
    """The schedule the stage runs (parallel/planning/schedules.py): with `plan.early` it decides what the peak
    holds, and the simulated step replays it."""

    @cached_property
    def memory(self) -> StageMemory:
        p = self.pricing
        return stage_memory(p.recipes, self.stage, self.plan, p.shape, p.run, p.param_counts, self.schedule)

    @cached_property
    def costs(self) -> StageCosts:
        """Seconds per instruction, each backward paying its share of the plan's recompute (per_micro_batch_costs)."""
        p = self.pricing
        costs = stage_range_costs(p.timing, p.recipes, self.stage, self.plan, p.run, p.param_counts)
        return per_micro_batch_costs(costs, self.plan, p.run.micro_batches)

    @cached_property
    def flops(self) -> StageFlops:
        """One micro-batch's, counted as FlopCounterMode does."""
        p = self.pricing
        return stage_flops(p.recipes, self.stage.layers, self.plan, p.shape, attention_kernel(p.shape, p.run.target))


def price_stage(pricing: StagePricing, stage: StageRange, plan: StagePlan, schedule: str = "1f1b") -> StagePrice:
    """Stage `stage` (a real stage, or the balanced search's hypothetical one) under `plan` and `schedule`."""
    return StagePrice(pricing, stage, plan, schedule)


def simulate_priced(prices: Sequence[StagePrice]) -> Timeline:
    """The simulated step (parallel/planning/step_sim.py) of priced stages, under their schedule and their plans'
    early recompute and ZB-H1 deferral, their optimizer steps a barrier when the run clips its gradients, and
    ReduceTiedGrads a meeting of the end stages where the model ties its embedding and LM head."""
    run = prices[0].pricing.run
    return simulate_stages(
        [price.costs for price in prices],
        run.micro_batches,
        prices[0].schedule,
        [price.plan.early for price in prices],
        [price.plan.deferred_weights for price in prices],
        clip_barrier=run.grad_clip > 0,
        tied=prices[0].pricing.shape.tied,
    )
