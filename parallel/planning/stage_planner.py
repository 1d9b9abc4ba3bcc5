"""One stage's plan: a fixed mode's plan, or auto's cheapest plan that fits the stage's side of the budget (given
the micro-batches it holds in flight), for real stage ranges and for the balanced search's hypothetical ones.
"""

from dataclasses import replace

from model import BLOCK_CLASSES
from parallel.planning.auto_recompute import (
    StageBudget,
    choose_stage,
    choose_stage_micro_batches,
    least_stage_bytes,
    to_stage_plan,
)
from parallel.planning.block_prices import BlockPrices
from parallel.planning.compression import stored_input_bytes
from parallel.planning.config import AutoRecompute, GivenRecompute, NoRecompute, RecomputeConfig
from parallel.planning.given_plan import read_given_plan
from parallel.planning.partition import StageRange, block_positions
from parallel.planning.shapes import GIB
from parallel.planning.stage_bytes import StageMemory
from parallel.planning.stage_plan import StagePlan, plan_stage
from parallel.planning.stage_price import StagePrice, StagePricing, price_stage
from parallel.planning.working_set import stage_working


class StagePlanner:
    """Plans one stage under `recompute` (with `table`'s costs for auto) and prices it under that plan."""

    def __init__(self, pricing: StagePricing, recompute: RecomputeConfig, table: BlockPrices):
        self.pricing = pricing
        self.recompute = recompute
        compress = getattr(recompute, "compress", "none")
        if isinstance(recompute, AutoRecompute) and compress != "none":  # lossy storage allowed: one more choice
            table = replace(table, stash=(compress, stored_input_bytes(pricing.shape, pricing.run.target, compress)))
        self.table = table
        self.usable = (recompute.budget_gb - recompute.reserve_gb) * GIB if isinstance(recompute, AutoRecompute) else 0

    def plan(self, stage: StageRange) -> tuple[StagePlan, StageBudget | None]:
        recipes, run = self.pricing.recipes, self.pricing.run
        positions = block_positions(recipes, stage)
        is_block = [recipes[i].module_class in BLOCK_CLASSES for i in stage.layers]
        auto = isinstance(self.recompute, AutoRecompute)
        if isinstance(self.recompute, NoRecompute) or (not auto and not positions):
            return StagePlan(), None
        memory = price_stage(self.pricing, stage, StagePlan()).memory
        if isinstance(self.recompute, GivenRecompute):  # as the file holds it, lowering the peak or not
            return read_given_plan(self.recompute.file).stage_plan(stage, is_block, memory.in_flight), None
        if not auto:  # which micro-batches recompute depends on how many the stage holds
            return self._lowering(stage, plan_stage(is_block, self.recompute, memory.in_flight), memory), None
        room = self.usable - memory.fixed_bytes
        working = stage_working(memory.plain_layers, self.pricing.shape, run.target, memory.optimizer_floor)
        table = self.table if working.blocks_end_stage else self.table.with_fresh_output()
        n, in_flight = len(positions), memory.in_flight
        if self.recompute.per_micro_batch:
            choice = choose_stage_micro_batches(n, table, in_flight, run.micro_batches, room, working)
        else:
            choice = choose_stage(n, table, in_flight, room, working)
        floors = (memory.fixed_bytes + b for b in least_stage_bytes(n, table, in_flight, working))
        budget = StageBudget(stage.stage, int(self.usable), in_flight, memory.fixed_bytes, working, choice, *floors)
        return (to_stage_plan(choice, positions, table, memory.in_flight) if choice else StagePlan()), budget

    def _lowering(self, stage: StageRange, plan: StagePlan, plain: StageMemory) -> StagePlan:
        """`plan`, or no recompute where the plan would not lower the stage's predicted peak below `plain`'s (the
        stage with no recompute): a last stage holding one micro-batch under full(stage) remakes in its backward
        all that `none` keeps, so recomputing there costs time on the critical path and saves no memory."""
        if price_stage(self.pricing, stage, plan).memory.predicted_peak_bytes < plain.predicted_peak_bytes:
            return plan
        return StagePlan()

    def price(self, stage: StageRange) -> StagePrice | None:
        """The stage under its plan and 1F1B (the schedule plans are chosen for); None when auto finds no plan
        that fits its side of the budget."""
        plan, budget = self.plan(stage)
        if budget is not None and budget.choice is None:
            return None
        return price_stage(self.pricing, stage, plan)
