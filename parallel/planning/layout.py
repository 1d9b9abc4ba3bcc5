"""The pipeline layout: which layers each stage holds and what each stage recomputes; for `recompute=auto`,
also each stage's side of the memory budget. Pure: the start-up print, the dry run and the engine all read
the same layout, built by `build_layout` alone.

`parallel.partition_method=balanced` chooses the stage boundaries together with each stage's plan: a
stage's price is its predicted forward + backward time (parallel/planning/step_costs.py) under the plan it would get
with that many blocks (a fixed mode's, or auto's cheapest that fits the stage's side of the budget, given
the micro-batches it holds in flight), a dynamic programme minimises the slowest stage, and single-block
moves keep what shortens the simulated 1F1B step (parallel/planning/step_sim.py).
"""

import math
from dataclasses import dataclass, replace

from model import Block, GPTConfig, LayerRecipe, gpt_layers, layer_param_counts
from parallel.planning.auto_recompute import (
    CostTable,
    StageBudget,
    analytic_costs,
    choose_stage,
    choose_stage_micro_batches,
    least_stage_bytes,
    to_stage_plan,
)
from parallel.planning.config import AutoRecompute, RecomputeConfig
from parallel.planning.partition import StageRange, balanced_block_counts, partition_layers, stages_of_block_counts
from parallel.planning.schedules import SCHEDULES
from parallel.planning.shapes import GIB, RunShape, Shape
from parallel.planning.stage_costs import stage_memory
from parallel.planning.stage_plan import StagePlan, plan_stage
from parallel.planning.step_costs import (
    DeviceRates,
    StageCosts,
    TimeModel,
    analytic_rates,
    lower_bound_s,
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
    schedule: str = "1f1b"
    """The concrete schedule every stage runs (parallel/planning/schedules.py's SCHEDULES); the engine reads it and
    each plan's `early` and `deferred_weights`."""
    schedule_options: tuple["ScheduleOption", ...] = ()
    """Every schedule x early setting the planner priced for these plans (the dry run's table)."""

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
            line = f"stage {stage.stage}: layers {stage.start}..{stage.stop - 1} ({len(names)} layers) "
            line += " ".join(names)
            if plan.micro_batches is not None and plan.micro_batches < plan.in_flight:
                line += f" | recompute for {plan.micro_batches} of {plan.in_flight} in-flight micro-batches"
            lines.append(line)
        if self.schedule != "1f1b" or any(p.early for p in self.plans):
            early = ", ".join(str(s) for s, p in enumerate(self.plans) if p.early) or "none"
            line = f"schedule {self.schedule} | early recompute on stages: {early}"
            if self.schedule == "zb-h1":
                line += " | deferred W's per stage: " + " ".join(str(p.deferred_weights) for p in self.plans)
            lines.append(line)
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
            if b.choice.micro_batches is not None:
                plan += f" for {b.choice.micro_batches} of them, none for the others"
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
    schedule: str = "1f1b",
) -> PipelineLayout:
    """The layout training and the dry run use. `recompute=auto` plans each stage against the budget (with
    `costs`, else the analytic ones) and raises ValueError when a stage cannot fit. `rates`: what the
    analytic step-time model charges at (default: parallel/planning/step_costs.py's nominal rates for the target).
    `schedule` (parallel.schedule) and `recompute.early`: see `_choose_schedule`."""
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
    budgets = None
    if isinstance(recompute, AutoRecompute):
        budgets = [budget for _, budget in planned]
        _check_fits(recompute, budgets)
    chosen, options = _choose_schedule(planner, stages, plans, schedule, getattr(recompute, "early", False))
    return PipelineLayout(recipes, stages, list(chosen.plans), budgets, timing, chosen.schedule, options)


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


RESOLUTION = 1e-3
"""A block move must shorten the simulated step by this fraction: smaller gains are below what the cost
model can tell apart, and chasing them makes uneven partitions for nothing."""


def _balanced_counts(planner: _StagePlanner, blocks: int, num_stages: int) -> list[int]:
    """Blocks per stage: the split whose slowest stage is fastest (parallel/planning/partition.py's programme), then
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


@dataclass(frozen=True)
class ScheduleOption:
    """One schedule x early-recompute setting of a layout's plans, as the planner priced it."""

    schedule: str
    early: bool
    plans: tuple[StagePlan, ...]
    """The layout's plans with this setting's `early` and ZB-H1 deferral."""
    step_time_s: float
    """The simulated step (parallel/planning/step_sim.py)."""
    lower_bound_s: float
    """What no schedule of these stages beats (parallel/planning/step_costs.py's `lower_bound_s`)."""
    peak_bytes: tuple[int, ...]
    """Each stage's predicted peak tensor bytes under this setting (StageMemory.predicted_peak_tensor_bytes: the
    backward's working set included, which early recompute moves ahead of the backward)."""
    fits: bool
    """`recompute=auto` only (always true without it): every stage's peak within the budget, or no higher than
    under the 1F1B schedule the plans were chosen for (the budget check of auto's own plan counts its segment's
    working set its own way)."""
    allowed: bool
    """parallel.schedule and recompute.early allow it (`auto` / null allow every value)."""


def _choose_schedule(
    planner: _StagePlanner, stages: list[StageRange], plans: list[StagePlan], schedule: str, early: bool | None
) -> tuple[ScheduleOption, tuple[ScheduleOption, ...]]:
    """Price every schedule x early setting of the plans, and keep the allowed one with the shortest simulated
    step among those that fit (`schedule` `auto` or `early` None: the planner's choice). Early recompute is
    priced only where some stage recomputes. The plans are auto's (or the mode's) for 1F1B: early recompute
    adds one micro-batch's recomputed activations to a stage's peak, so under a budget it may not fit; ZB-H1
    stays within 1F1B's peak by construction (`_deferrals`), so it fits wherever 1F1B with the same `early`
    does. Raises ValueError when the configured setting does not fit the budget."""
    recomputes = any(p.segments or p.selective for p in plans)
    options = []
    for early_here in (False, True) if recomputes else (False,):
        for kind in SCHEDULES:
            # With nothing to recompute, early=true has nothing to move: its setting is early=false's.
            allowed = schedule in ("auto", kind) and (early is None or early == early_here or not recomputes)
            options.append(_price_schedule(planner, stages, plans, kind, early_here, allowed))
    candidates = [o for o in options if o.allowed and o.fits]
    if not candidates:
        usable = planner.usable / GIB
        raise ValueError(
            f"recompute.early={str(early).lower()} does not fit recompute.budget_gb: early recompute holds one "
            f"micro-batch's recomputed activations on top of the plan, and a stage's peak then exceeds its "
            f"{usable:g} GiB; use recompute.early=null (the planner chooses) or false, or a larger recompute.budget_gb"
        )
    return min(candidates, key=lambda o: o.step_time_s), tuple(options)


def _price_schedule(
    planner: _StagePlanner, stages: list[StageRange], plans: list[StagePlan], kind: str, early: bool, allowed: bool
) -> ScheduleOption:
    last = len(stages) - 1
    plans = [
        replace(p, early=early and s < last and bool(p.segments or p.selective), deferred_weights=None)
        for s, p in enumerate(plans)
    ]
    if kind == "zb-h1":
        plans = _deferrals(planner, stages, plans)
    run, counts = planner.run, planner.counts
    memory = [stage_memory(planner.recipes, st, p, planner.shape, run, counts, kind) for st, p in zip(stages, plans)]
    reference = [
        stage_memory(planner.recipes, st, replace(p, early=False, deferred_weights=None), planner.shape, run, counts)
        for st, p in zip(stages, plans)
    ]
    costs = [
        per_micro_batch_costs(
            stage_range_costs(planner.timing, planner.recipes, st, p, run, counts), p, run.micro_batches
        )
        for st, p in zip(stages, plans)
    ]
    peaks = tuple(m.predicted_peak_tensor_bytes for m in memory)
    fits = not isinstance(planner.recompute, AutoRecompute) or all(
        peak <= max(planner.usable, r.predicted_peak_tensor_bytes) for peak, r in zip(peaks, reference)
    )
    return ScheduleOption(
        kind,
        early,
        tuple(plans),
        simulate_stages(
            costs, run.micro_batches, kind, [p.early for p in plans], [p.deferred_weights for p in plans]
        ).step_time_s,
        lower_bound_s(costs, run.micro_batches, early),
        peaks,
        fits,
        allowed,
    )


def _deferrals(planner: _StagePlanner, stages: list[StageRange], plans: list[StagePlan]) -> list[StagePlan]:
    """ZB-H1's bound, per stage: the most deferred W's (up to the stage index, ZB-H1's own count) that keep
    the stage's predicted peak tensor bytes (each backward's working set inside it) within the fullest stage's
    1F1B peak of the same plans. That is ZB-H1's promise
    ("1F1B's activation memory"): a later stage holds fewer micro-batches under 1F1B than stage 0, and the room
    left takes deferred W's. A W-pending micro-batch holds each Linear's input and output gradient
    (memory_model.weight_grad_items), whatever the plan recomputes, so under heavy recompute even one may not
    fit: the stage then defers none, and its B and W are 1F1B's backward cut in two."""
    run, counts = planner.run, planner.counts

    def peak(stage: StageRange, plan: StagePlan, kind: str) -> int:
        return stage_memory(planner.recipes, stage, plan, planner.shape, run, counts, kind).predicted_peak_tensor_bytes

    bound = max(peak(st, p, "1f1b") for st, p in zip(stages, plans))
    out = []
    for st, p in zip(stages, plans):
        deferred = next(
            d for d in range(st.stage, -1, -1) if d == 0 or peak(st, replace(p, deferred_weights=d), "zb-h1") <= bound
        )
        out.append(replace(p, deferred_weights=deferred))
    return out


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
