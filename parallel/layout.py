"""The pipeline layout: which layers each stage holds and what each stage recomputes; for `recompute=auto`,
also each stage's side of the memory budget. Pure: the start-up print, the dry run and the engine all read
the same layout, built by `build_layout` alone."""

import math
from dataclasses import dataclass

from model import Block, GPTConfig, LayerRecipe, gpt_layers, layer_param_counts
from parallel.auto_recompute import (
    CostTable,
    StageBudget,
    analytic_costs,
    choose_stage,
    least_stage_bytes,
    to_stage_plan,
)
from parallel.config import AutoRecompute, RecomputeConfig
from parallel.partition import StageRange, partition_layers
from parallel.shapes import GIB, RunShape, Shape
from parallel.stage_costs import stage_memory
from parallel.stage_plan import StagePlan, plan_stage


@dataclass(frozen=True)
class PipelineLayout:
    recipes: list[LayerRecipe]
    stages: list[StageRange]
    plans: list[StagePlan]
    budgets: list[StageBudget] | None = None
    """`recompute=auto` only: each stage's side of the budget, one per stage."""

    def describe(self) -> list[str]:
        """One line per stage: its layers, each with its recompute choice."""
        lines = []
        for stage, plan in zip(self.stages, self.plans):
            names = []
            for local, flat in enumerate(stage.layers):
                recipe = self.recipes[flat]
                choice = plan.choice_of(local) if recipe.module_class is Block else ""
                names.append(f"{flat}:{recipe.name}" + (f"[{choice}]" if choice and choice != "none" else ""))
            lines.append(
                f"stage {stage.stage}: layers {stage.start}..{stage.stop - 1} ({len(names)} layers) " + " ".join(names)
            )
        return lines

    def describe_budgets(self, auto: AutoRecompute) -> list[str]:
        """The auto plan against the budget, one line per stage (start-up print and dry run)."""
        usable = auto.budget_gb - auto.reserve_gb
        lines = [
            f"auto recompute: budget {auto.budget_gb:g} GiB - reserve {auto.reserve_gb:g} GiB = {usable:g} GiB per rank"
        ]
        for b in self.budgets or []:
            counts: dict[str, int] = {}
            for choice in b.choice.choices:
                counts[choice] = counts.get(choice, 0) + 1
            plan = ", ".join(f"{n} x {c}" for c, n in counts.items()) or "no blocks"
            lines.append(
                f"stage {b.stage}: {plan} | {b.in_flight} in flight | predicted peak "
                f"{b.predicted_peak_bytes / GIB:.4f} of {usable:g} GiB "
                f"(segment working set {b.choice.working_bytes / GIB:.4f} GiB)"
            )
        return lines

    def as_dict(self) -> list[dict]:
        """The layout as plain data, for W&B's run config and summaries."""
        return [
            {
                "stage": s.stage,
                "layers": [s.start, s.stop],
                "choices": [
                    p.choice_of(local)
                    for local, flat in enumerate(s.layers)
                    if self.recipes[flat].module_class is Block
                ],
            }
            for s, p in zip(self.stages, self.plans)
        ]


def build_layout(
    model: GPTConfig,
    recompute: RecomputeConfig,
    run: RunShape,
    partition_method: str,
    seed: int,
    costs: CostTable | None = None,
) -> PipelineLayout:
    """The layout training and the dry run use. `recompute=auto` plans each stage against the budget (with
    `costs`, else the analytic ones) and raises ValueError when a stage cannot fit."""
    recipes = gpt_layers(model, seed)
    stages = partition_layers(recipes, run.topology.pipeline_stages, partition_method)
    if not isinstance(recompute, AutoRecompute):
        plans = [plan_stage([recipes[i].module_class is Block for i in s.layers], recompute) for s in stages]
        return PipelineLayout(recipes, stages, plans)
    shape = Shape.of(model, run.micro_batch_size)
    table = costs or analytic_costs(shape, run.target)
    counts = layer_param_counts(recipes)
    usable = (recompute.budget_gb - recompute.reserve_gb) * GIB
    plans, budgets = [], []
    for stage in stages:
        positions = [local for local, flat in enumerate(stage.layers) if recipes[flat].module_class is Block]
        memory = stage_memory(recipes, stage, StagePlan(), shape, run, counts)
        choice = choose_stage(len(positions), table, memory.in_flight, usable - memory.fixed_bytes)
        budgets.append(
            StageBudget(
                stage.stage,
                int(usable),
                memory.in_flight,
                memory.fixed_bytes,
                choice,
                memory.fixed_bytes + least_stage_bytes(len(positions), table, memory.in_flight),
            )
        )
        plans.append(to_stage_plan(choice, positions, table) if choice else StagePlan())
    _check_fits(recompute, budgets)
    return PipelineLayout(recipes, stages, plans, budgets)


def _check_fits(auto: AutoRecompute, budgets: list[StageBudget]) -> None:
    failing = [b for b in budgets if b.choice is None]
    if not failing:
        return
    # Rounded up to 0.01 GiB, so the budget quoted really fits.
    smallest = math.ceil(100 * (max(b.least_bytes for b in budgets) / GIB + auto.reserve_gb)) / 100
    stages = ", ".join(str(b.stage) for b in failing)
    raise ValueError(
        f"recompute.budget_gb={auto.budget_gb} does not fit stage {stages}, not even with full recompute of every "
        f"block: the smallest budget that fits every stage is recompute.budget_gb={smallest:.2f} (with "
        f"recompute.reserve_gb={auto.reserve_gb}). Also helps: more stages (parallel.pipeline_stages), a smaller "
        f"train.micro_batch_size, train.precision=bf16, or parallel.zero_stage=1 with data parallelism"
    )
