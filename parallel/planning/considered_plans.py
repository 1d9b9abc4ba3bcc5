"""The whole-run plans `+recompute=auto` weighed, ranked by their simulated step: the dry run's list of the runner-ups
beside auto's choice (plan.json's `considered`), each runnable as it is with `+recompute=plan`. The planner's regret
benchmark (bench/planner_regret.py) runs them one by one, to measure how far auto's choice is from the fastest.

Auto chooses each stage's plan on its own, the least summed recompute cost that fits the stage's side of the budget
(parallel/planning/auto_recompute.py). The plans weighed here are those its search enumerates
(auto_recompute.stage_choices) that fit, per stage the cheapest by that cost, combined over the stages and priced
together under the layout's schedule and early setting, as the layout's own plans are.
"""

import itertools
from dataclasses import dataclass

from parallel.planning.auto_recompute import stage_choices, to_stage_plan
from parallel.planning.partition import StageRange, block_positions
from parallel.planning.schedule_choice import price_schedule
from parallel.planning.stage_plan import StagePlan
from parallel.planning.stage_planner import StagePlanner
from parallel.planning.stage_price import price_stage
from parallel.planning.working_set import stage_working

COMBINATIONS = 512
"""At most this many whole-run plans are priced: each stage keeps its cheapest floor(512^(1/stages)) plans."""


@dataclass(frozen=True)
class ConsideredPlan:
    plans: tuple[StagePlan, ...]
    """Each stage's plan, under the layout's schedule and early setting."""
    step_time_s: float
    """The simulated step (parallel/planning/step_sim.py)."""
    peak_bytes: tuple[int, ...]
    """Each stage's predicted peak."""
    recompute_cost: float
    """The stages' summed recompute cost of one micro-batch, what auto minimises per stage."""

    def to_json(self) -> dict:
        return {
            "stages": [plan.to_record() for plan in self.plans],
            "predicted_step_time_s": self.step_time_s,
            "peak_bytes": list(self.peak_bytes),
            "recompute_cost": self.recompute_cost,
        }


def considered_plans(
    planner: StagePlanner, stages: list[StageRange], schedule: str, early: bool, count: int
) -> tuple[ConsideredPlan, ...]:
    """The `count` fastest whole-run plans (by simulated step under `schedule` with `early`) among the per-stage plans
    auto weighs that fit the budget; empty where some stage fits none."""
    per_stage = [_fitting(planner, stage) for stage in stages]
    keep = max(1, int(COMBINATIONS ** (1 / len(stages)) + 1e-9))
    ranked = []
    for combination in itertools.product(*(fitting[:keep] for fitting in per_stage)):
        plans = [plan for _, plan in combination]
        option = price_schedule(planner, stages, plans, schedule, early, True)
        if option.fits:
            cost = sum(c for c, _ in combination)
            ranked.append(ConsideredPlan(option.plans, option.step_time_s, option.peak_bytes, cost))
    ranked.sort(key=lambda p: (p.step_time_s, p.recompute_cost))
    return tuple(ranked[:count])


def _fitting(planner: StagePlanner, stage: StageRange) -> list[tuple[float, StagePlan]]:
    """The stage's distinct plans among those auto weighs whose 1F1B peak fits its budget, cheapest (recompute cost)
    first."""
    pricing = planner.pricing
    positions = block_positions(pricing.recipes, stage)
    plain = price_stage(pricing, stage, StagePlan()).memory
    ends_stage = stage_working(plain.plain_layers, pricing.shape, pricing.run.target).blocks_end_stage
    seen, fitting = set(), []
    for choice in stage_choices(len(positions), planner.table, ends_stage):
        plan = to_stage_plan(choice, positions, planner.table)
        key = repr(plan)  # a StagePlan holds a dict: not hashable
        if key in seen:
            continue
        seen.add(key)
        if price_stage(pricing, stage, plan).memory.predicted_peak_bytes <= planner.usable:
            fitting.append((choice.cost, plan))
    fitting.sort(key=lambda item: item[0])
    return fitting
