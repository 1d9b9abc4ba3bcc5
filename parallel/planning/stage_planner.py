"""One stage's plan and its price: a fixed mode's plan, or auto's cheapest plan that fits the stage's side of
the budget, priced by the step-time model (parallel/planning/step_costs.py), for real stage ranges and for the
balanced search's hypothetical ones.
"""

from dataclasses import replace

from model import Block, layer_param_counts
from parallel.planning.auto_recompute import (
    CostTable,
    StageBudget,
    choose_stage,
    choose_stage_micro_batches,
    least_stage_bytes,
    to_stage_plan,
)
from parallel.planning.config import AutoRecompute
from parallel.planning.partition import StageRange
from parallel.planning.shapes import GIB, RunShape, Shape
from parallel.planning.stage_costs import stage_memory
from parallel.planning.stage_plan import StagePlan, plan_stage
from parallel.planning.step_costs import StageCosts, TimeModel, stage_range_costs


class StagePlanner:
    """Plans one stage (a fixed mode's plan, or auto's cheapest plan that fits its side of the budget) and
    prices it, for real stage ranges and for the balanced search's hypothetical ones."""

    def __init__(self, recipes, recompute, run: RunShape, shape: Shape, table: CostTable, timing: TimeModel):
        self.recipes = recipes
        self.recompute = recompute
        self.run = run
        self.shape = shape
        self.table = table
        self.timing = timing
        self.counts = layer_param_counts(recipes)
        self.usable = (recompute.budget_gb - recompute.reserve_gb) * GIB if isinstance(recompute, AutoRecompute) else 0
        self._costs: dict[tuple[int, int], StageCosts | None] = {}

    def plan(self, stage: StageRange) -> tuple[StagePlan, StageBudget | None]:
        recipes = self.recipes
        positions = [local for local, flat in enumerate(stage.layers) if recipes[flat].module_class is Block]
        is_block = [recipes[i].module_class is Block for i in stage.layers]
        auto = isinstance(self.recompute, AutoRecompute)
        if not auto and getattr(self.recompute, "micro_batches", None) is None:  # none has no micro_batches
            return plan_stage(is_block, self.recompute), None
        memory = stage_memory(recipes, stage, StagePlan(), self.shape, self.run, self.counts)
        if not auto:  # which micro-batches recompute depends on how many the stage holds
            return plan_stage(is_block, self.recompute, memory.in_flight), None
        room = self.usable - memory.fixed_bytes
        if self.recompute.per_micro_batch:
            choice = choose_stage_micro_batches(
                len(positions), self.table, memory.in_flight, self.run.micro_batches, room
            )
        else:
            choice = choose_stage(len(positions), self.table, memory.in_flight, room)
        budget = StageBudget(
            stage.stage,
            int(self.usable),
            memory.in_flight,
            memory.fixed_bytes,
            choice,
            memory.fixed_bytes + least_stage_bytes(len(positions), self.table, memory.in_flight),
        )
        return (to_stage_plan(choice, positions, self.table, memory.in_flight) if choice else StagePlan()), budget

    def stage_costs(self, stage: int, blocks: int) -> StageCosts | None:
        """Seconds of stage `stage` holding `blocks` blocks under its plan; None when it cannot fit."""
        key = (stage, blocks)
        if key not in self._costs:
            self._costs[key] = self._price(self._hypothetical(stage, blocks))
        return self._costs[key]

    def stage_time(self, stage: int, blocks: int) -> float | None:
        """A micro-batch's forward and backward (recompute included) on the stage."""
        costs = self.stage_costs(stage, blocks)
        return None if costs is None else costs.forward + costs.backward + costs.recompute

    def _price(self, stage: StageRange) -> StageCosts | None:
        plan, budget = self.plan(stage)
        if budget is not None and budget.choice is None:
            return None
        costs = stage_range_costs(self.timing, self.recipes, stage, plan, self.run, self.counts)
        return per_micro_batch_costs(costs, plan, self.run.micro_batches)

    def _hypothetical(self, stage: int, blocks: int) -> StageRange:
        """Stage `stage` holding `blocks` blocks: blocks are identical, so only its ends matter."""
        n_layers, last = len(self.recipes), self.run.topology.pipeline_stages - 1
        first_block = next(i for i, r in enumerate(self.recipes) if r.module_class is Block)
        after_blocks = max(i for i, r in enumerate(self.recipes) if r.module_class is Block) + 1
        start = 0 if stage == 0 else (after_blocks - blocks if stage == last else first_block)
        stop = n_layers if stage == last else start + blocks + (first_block if stage == 0 else 0)
        return StageRange(stage, start, stop)


def per_micro_batch_costs(costs: StageCosts, plan: StagePlan, micro_batches: int) -> StageCosts:
    """A stage's costs with its recompute spread over the step's backward passes: only the micro-batches the
    plan recomputes for pay it (StagePlan.micro_batches), and the simulator charges every backward alike, so
    each pays the mean (the step's busy time is exact; where in the step the recompute falls is not)."""
    if plan.micro_batches is None:
        return costs
    return replace(costs, recompute=costs.recompute * plan.recomputed_count(micro_batches) / micro_batches)
