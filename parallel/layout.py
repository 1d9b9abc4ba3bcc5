"""The pipeline layout: which layers each stage holds and what each stage recomputes; for `recompute=auto`,
also each stage's side of the memory budget. Pure: the start-up print, the dry run and the engine all read
the same layout, built by `build_layout` alone.

`parallel.partition_method=balanced` chooses the stage boundaries together with each stage's plan: a
stage's price is its predicted forward + backward time (parallel/step_costs.py) under the plan it would get
with that many blocks (a fixed mode's, or auto's cheapest that fits the stage's side of the budget, given
the micro-batches it holds in flight), a dynamic programme minimises the slowest stage, and single-block
moves keep what shortens the simulated 1F1B step (parallel/step_sim.py).
"""

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
from parallel.partition import StageRange, balanced_block_counts, partition_layers, stages_of_block_counts
from parallel.shapes import GIB, RunShape, Shape
from parallel.stage_costs import stage_memory
from parallel.stage_plan import StagePlan, plan_stage
from parallel.step_costs import (
    DeviceRates,
    StageCosts,
    TimeModel,
    analytic_rates,
    simulate_stages,
    stage_range_costs,
    time_model,
)


@dataclass(frozen=True)
class PipelineLayout:
    recipes: list[LayerRecipe]
    stages: list[StageRange]
    plans: list[StagePlan]
    budgets: list[StageBudget] | None = None
    """`recompute=auto` only: each stage's side of the budget, one per stage."""
    timing: TimeModel | None = None
    """The step-time model the layout was planned with (the run plan predicts the step with it)."""

    def empty_stage_warnings(self) -> list[str]:
        """One warning per stage that holds no transformer block: it idles while the others compute."""
        warnings = []
        for stage in self.stages:
            if any(self.recipes[i].module_class is Block for i in stage.layers):
                continue
            names = " ".join(self.recipes[i].name for i in stage.layers)
            warnings.append(
                f"warning: stage {stage.stage} holds no transformer block (only {names}): it does almost no work "
                "while the other stages compute; parallel.partition_method=balanced gives every stage a block "
                "when model.n_layer >= parallel.pipeline_stages"
            )
        return warnings

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
                # full(1) and full(stage) make the same choices: the segments tell them apart
                "segments": [[s.start + a, s.start + b] for a, b in p.segments],
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
    rates: DeviceRates | None = None,
) -> PipelineLayout:
    """The layout training and the dry run use. `recompute=auto` plans each stage against the budget (with
    `costs`, else the analytic ones) and raises ValueError when a stage cannot fit. `rates`: what the
    analytic step-time model charges at (default: parallel/step_costs.py's nominal rates for the target)."""
    recipes = gpt_layers(model, seed)
    shape = Shape.of(model, run.micro_batch_size)
    table = costs or analytic_costs(shape, run.target)
    timing = time_model(shape, run, table, rates or analytic_rates(run.target.device, run.target.precision))
    planner = _StagePlanner(recipes, recompute, run, shape, table, timing)
    num_stages = run.topology.pipeline_stages
    if partition_method != "balanced":
        stages = partition_layers(recipes, num_stages, partition_method)
    elif model.n_layer < num_stages:
        # Some stage must go without a block: DeepSpeed's layer-count split at least gives each a layer.
        stages = partition_layers(recipes, num_stages, "uniform")
    else:
        stages = stages_of_block_counts(recipes, _balanced_counts(planner, model.n_layer, num_stages))
    planned = [planner.plan(stage) for stage in stages]
    plans = [plan for plan, _ in planned]
    if not isinstance(recompute, AutoRecompute):
        return PipelineLayout(recipes, stages, plans, timing=timing)
    budgets = [budget for _, budget in planned]
    _check_fits(recompute, budgets)
    return PipelineLayout(recipes, stages, plans, budgets, timing)


class _StagePlanner:
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
        if not isinstance(self.recompute, AutoRecompute):
            return plan_stage([recipes[i].module_class is Block for i in stage.layers], self.recompute), None
        memory = stage_memory(recipes, stage, StagePlan(), self.shape, self.run, self.counts)
        choice = choose_stage(len(positions), self.table, memory.in_flight, self.usable - memory.fixed_bytes)
        budget = StageBudget(
            stage.stage,
            int(self.usable),
            memory.in_flight,
            memory.fixed_bytes,
            choice,
            memory.fixed_bytes + least_stage_bytes(len(positions), self.table, memory.in_flight),
        )
        return (to_stage_plan(choice, positions, self.table) if choice else StagePlan()), budget

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
        return stage_range_costs(self.timing, self.recipes, stage, plan, self.run, self.counts)

    def _hypothetical(self, stage: int, blocks: int) -> StageRange:
        """Stage `stage` holding `blocks` blocks: blocks are identical, so only its ends matter."""
        n_layers, last = len(self.recipes), self.run.topology.pipeline_stages - 1
        first_block = next(i for i, r in enumerate(self.recipes) if r.module_class is Block)
        after_blocks = max(i for i, r in enumerate(self.recipes) if r.module_class is Block) + 1
        start = 0 if stage == 0 else (after_blocks - blocks if stage == last else first_block)
        stop = n_layers if stage == last else start + blocks + (first_block if stage == 0 else 0)
        return StageRange(stage, start, stop)


RESOLUTION = 1e-3
"""A block move must shorten the simulated step by this fraction: smaller gains are below what the cost
model can tell apart, and chasing them makes uneven partitions for nothing."""


def _balanced_counts(planner: _StagePlanner, blocks: int, num_stages: int) -> list[int]:
    """Blocks per stage: the split whose slowest stage is fastest (parallel/partition.py's programme), then
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


def _simulated(planner: _StagePlanner, counts: list[int]) -> float | None:
    costs = [planner.stage_costs(s, n) for s, n in enumerate(counts)]
    if None in costs:
        return None
    return simulate_stages(costs, planner.run.micro_batches).step_time_s


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
