"""The pipeline layout: which layers each stage holds and what each stage recomputes; for `recompute=auto`,
also each stage's side of the memory budget. Pure: the start-up print, the dry run and the engine all read
the same layout, built by `build_layout` alone.

`parallel.partition_method=balanced` chooses the stage boundaries together with each stage's plan
(parallel/planning/balanced_search.py); the schedule is chosen last (parallel/planning/schedule_choice.py).
"""

from dataclasses import dataclass, replace

from model import BLOCK_CLASSES, GPTConfig, LayerRecipe, gpt_layers
from parallel.planning.auto_recompute import StageBudget
from parallel.planning.balanced_search import balanced_counts
from parallel.planning.block_prices import BlockPrices, analytic_prices
from parallel.planning.budget_refusal import BudgetTooSmall, alternatives, smallest_budget_gb
from parallel.planning.config import AutoRecompute, GivenRecompute, RecomputeConfig
from parallel.planning.considered_plans import ConsideredPlan, considered_plans
from parallel.planning.given_plan import read_given_plan
from parallel.planning.instruction_seconds import DeviceRates, TimeModel, analytic_rates, time_model
from parallel.planning.partition import (
    StageRange,
    block_positions,
    partition_layers,
    stages_of_block_counts,
    stages_of_parts,
)
from parallel.planning.schedule_choice import ScheduleOption, choose_schedule
from parallel.planning.shapes import GIB, RunShape, Shape
from parallel.planning.stage_plan import StagePlan
from parallel.planning.stage_planner import StagePlanner
from parallel.planning.stage_price import StagePricing
from parallel.planning.virtual_auto import RankBudget
from parallel.planning.virtual_program import UNIT_SLOTS, Slots

DEEPSPEED_PARTITIONS = ("uniform", "parameters", "type:Block")
"""DeepSpeed's own partition methods, which `balanced` prices beside its own split."""


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
    schedule_options: tuple[ScheduleOption, ...] = ()
    """Every schedule x early setting the planner priced for these plans (the dry run's table)."""
    partition_candidates: tuple[tuple[str, float | None], ...] = ()
    """`balanced` only: each partition it priced (its own block counts, then DeepSpeed's methods) with its
    simulated step under its fastest allowed schedule (None: it fits no plan in the budget); it runs the fastest."""
    seed: int = 0
    """The run seed (run.seed) the recipes were built with (each layer's initial weights); it keys the dropout masks
    too (parallel/runtime/dropout_keys.py)."""
    virtual_schedule: str | None = None
    """The schedule with virtual stages (interleaved-1f1b, zb-v, v-half) whose virtual stages `stages` are, ranks x
    `virtual_chunks` of them (parallel/planning/virtual_layout.py); None: one stage per rank, under `schedule`."""
    virtual_chunks: int = 2
    """`virtual_schedule`'s model chunks per rank."""
    virtual_slots: Slots = UNIT_SLOTS
    """The slots `virtual_schedule`'s programmes are laid out in (parallel/planning/virtual_slots.py): every rank,
    the walk, the simulator and the replays build them alike."""
    rank_budgets: tuple[RankBudget, ...] = ()
    """`recompute=auto` under a schedule with virtual stages only: each rank's side of the budget, its chunks' plans
    chosen together (`budgets` is then None)."""
    considered: tuple[ConsideredPlan, ...] = ()
    """`recompute=auto`, when build_layout was asked for them (the dry run): the fastest whole-run plans auto weighed,
    by simulated step under the layout's schedule (parallel/planning/considered_plans.py)."""

    @property
    def parts(self) -> list[int]:
        """Each stage's first layer, then one past the last (DeepSpeed's `PipelineModule.parts`)."""
        return [s.start for s in self.stages] + [self.stages[-1].stop]

    def empty_stage_warnings(self) -> list[str]:
        """One warning per stage that holds no transformer block: it idles while the others compute."""
        warnings = []
        for stage in self.stages:
            if any(self.recipes[i].module_class in BLOCK_CLASSES for i in stage.layers):
                continue
            names = " ".join(self.recipes[i].name for i in stage.layers)
            warnings.append(
                f"warning: stage {stage.stage} holds no transformer block (only {names}): it does almost no work "
                "while the other stages compute; parallel.partition_method=balanced gives every stage a block "
                "when model.n_layer >= parallel.pipeline_stages"
            )
        return warnings

    def _choices(self, stage: StageRange, plan: StagePlan) -> list[str]:
        """Each block of `stage`'s choice under `plan`, in order."""
        return [plan.choice_of(local) for local in block_positions(self.recipes, stage)]

    def describe_considered(self) -> list[str]:
        """The dry run's lines on the plans auto weighed: one per plan, its simulated step and each stage's blocks."""
        if not self.considered:
            return []
        lines = [
            f"auto weighed, fastest simulated step first ({len(self.considered)} shown; +recompute=plan runs one):"
        ]
        for rank, considered in enumerate(self.considered, 1):
            stages = [",".join(self._choices(stage, plan)) for stage, plan in zip(self.stages, considered.plans)]
            chosen = (
                " (chosen)"
                if [replace(p, early=False) for p in considered.plans] == [replace(p, early=False) for p in self.plans]
                else ""
            )
            peak = max(considered.peak_bytes) / GIB
            lines.append(f"  {rank}. {considered.step_time_s:.4g} s, peak {peak:.4f} GiB: {' | '.join(stages)}{chosen}")
        return lines

    def describe(self) -> list[str]:
        """One line per stage: its layers, each with its recompute choice."""
        lines = []
        for stage, plan in zip(self.stages, self.plans):
            names = []
            for local, flat in enumerate(stage.layers):
                recipe = self.recipes[flat]
                choice = plan.choice_of(local) if recipe.module_class in BLOCK_CLASSES else ""
                names.append(f"{flat}:{recipe.name}" + (f"[{choice}]" if choice and choice != "none" else ""))
            line = f"stage {stage.stage}: layers {stage.start}..{stage.stop - 1} ({len(names)} layers) "
            line += " ".join(names)
            if plan.micro_batches is not None and plan.micro_batches < plan.in_flight:
                line += f" | recompute for {plan.micro_batches} of {plan.in_flight} in-flight micro-batches"
            lines.append(line)
        if self.partition_candidates:
            chosen = min((c for c in self.partition_candidates if c[1] is not None), key=lambda c: c[1])
            priced = ", ".join(
                f"{name} {'no fit' if t is None else f'{t:.4g} s'}" for name, t in self.partition_candidates
            )
            lines.append(f"partition balanced: {chosen[0]}, the fastest simulated step of {priced}")
        if self.schedule != "1f1b" or any(p.early for p in self.plans):
            early = ", ".join(str(s) for s, p in enumerate(self.plans) if p.early) or "none"
            # a virtual layout's stages are its virtual stages, run under its own schedule (its line follows)
            where = "virtual stages" if self.virtual_schedule else "stages"
            line = f"schedule {self.virtual_schedule or self.schedule} | early recompute on {where}: {early}"
            if self.schedule == "zb-h1":
                line += " | deferred W's per stage: " + " ".join(str(p.deferred_weights) for p in self.plans)
            lines.append(line)
        return lines

    @property
    def budgeted(self) -> bool:
        """Planned by `recompute=auto`, per stage or per rank: `describe_budgets` has lines."""
        return self.budgets is not None or bool(self.rank_budgets)

    def describe_budgets(self, auto: AutoRecompute) -> list[str]:
        """The auto plan against the budget, one line per stage, or per rank under virtual stages (start-up print and
        dry run)."""
        usable = auto.budget_gb - auto.reserve_gb
        lines = [
            f"auto recompute: budget {auto.budget_gb:g} GiB - reserve {auto.reserve_gb:g} GiB = {usable:g} GiB per rank"
        ]
        if self.rank_budgets:  # a rank's chunks share its budget
            return lines + [b.line() for b in self.rank_budgets]
        for b in self.budgets or []:
            counts: dict[str, int] = {}
            for choice in b.choice.choices:
                counts[choice] = counts.get(choice, 0) + 1
            plan = ", ".join(f"{n} x {c}" for c, n in counts.items()) or "no blocks"
            if b.choice.compress != "none":
                plan += f" (segment inputs stored as {b.choice.compress}: lossy)"
            if b.choice.micro_batches is not None:
                plan += f" for {b.choice.micro_batches} of them, none for the others"
            lines.append(
                f"stage {b.stage}: {plan} | {b.in_flight} in flight | predicted peak "
                f"{self.peak_bytes[b.stage] / GIB:.4f} of {usable:g} GiB | {_floor(b, auto.compress)} GiB"
            )
        return lines

    @property
    def peak_bytes(self) -> tuple[int, ...]:
        """Each stage's predicted peak under the layout's schedule and plans (the chosen ScheduleOption's)."""
        early = any(p.early for p in self.plans)
        return next(o for o in self.schedule_options if o.schedule == self.schedule and o.early == early).peak_bytes

    def as_dict(self) -> list[dict]:
        """The layout as plain data, for W&B's run config and summaries."""
        return [
            {
                "stage": s.stage,
                "layers": [s.start, s.stop],
                "choices": self._choices(s, p),
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
    costs: BlockPrices | None = None,
    rates: DeviceRates | None = None,
    schedule: str = "1f1b",
    price_alternatives: bool = True,
    held_parts: list[int] | None = None,
    considered: int = 0,
) -> PipelineLayout:
    """The layout training and the dry run use. `recompute=auto` plans each stage against the budget (with
    `costs`, else the analytic ones) and raises BudgetTooSmall (a ValueError) when a stage cannot fit, with the
    settings that would help priced unless `price_alternatives` is false. `rates`: what the analytic step-time model
    charges at (default: parallel/planning/instruction_seconds.py's nominal rates for the target). `schedule`
    (parallel.schedule) and `recompute.early`: see schedule_choice.choose_schedule. `held_parts` (each stage's first
    layer, then one past the last) are boundaries kept rather than chosen: a resume's checkpoint's, a sweep's
    (harness/run_layout.py); `partition_method` is then not consulted, nor under +recompute=plan, whose file holds
    them. `considered`: under +recompute=auto, keep that many of the fastest whole-run plans it weighed (the dry run's
    list: PipelineLayout.considered)."""
    recipes = gpt_layers(model, seed)
    shape = Shape.of(model, run.micro_batch_size)
    table = costs or analytic_prices(shape, run.target)
    timing = time_model(shape, run, table, rates or analytic_rates(run.target.device, run.target.precision))
    planner = StagePlanner(StagePricing.of(recipes, run, shape, timing), recompute, table)
    num_stages = run.topology.pipeline_stages
    early = getattr(recompute, "early", False)
    candidates: tuple[tuple[str, float | None], ...] = ()
    if isinstance(recompute, GivenRecompute):  # the file's boundaries, unless a resume holds its own
        given = read_given_plan(recompute.file)
        given.check_run(len(recipes), num_stages)
        held_parts = held_parts or list(given.parts)
    if held_parts is not None:
        stages = stages_of_parts(held_parts)
    elif partition_method != "balanced":
        stages = partition_layers(recipes, num_stages, partition_method)
    elif model.n_layer < num_stages:
        # Some stage must go without a block: DeepSpeed's layer-count split at least gives each a layer.
        stages = partition_layers(recipes, num_stages, "uniform")
    else:
        counts = balanced_counts(planner, model.n_layer, num_stages)
        own = ("blocks " + "/".join(map(str, counts)), stages_of_block_counts(recipes, counts))
        splits = [(method, partition_layers(recipes, num_stages, method)) for method in DEEPSPEED_PARTITIONS]
        # DeepSpeed's splits that give every stage a block: balanced promises that, and its search covers them
        splits = [(name, st) for name, st in splits if all(_blocks(recipes, stage) for stage in st)]
        stages, candidates = _fastest_partition(planner, recompute, schedule, early, [own, *splits])
    planned = [planner.plan(stage) for stage in stages]
    plans = [plan for plan, _ in planned]
    budgets = None
    if isinstance(recompute, AutoRecompute):
        budgets = [budget for _, budget in planned]
        if any(b.choice is None for b in budgets):
            priced = _priced_alternatives(model, recompute, run, partition_method, seed) if price_alternatives else []
            raise BudgetTooSmall(recompute, budgets, priced)
    chosen, options = choose_schedule(planner, stages, plans, schedule, early)
    weighed = ()
    if considered and isinstance(recompute, AutoRecompute):
        weighed = considered_plans(planner, stages, chosen.schedule, chosen.early, considered)
    return PipelineLayout(
        recipes,
        stages,
        list(chosen.plans),
        budgets,
        timing,
        chosen.schedule,
        options,
        candidates,
        seed,
        considered=weighed,
    )


def _floor(budget: StageBudget, compress: str) -> str:
    """The stage's floor, the smallest peak any plan auto may choose reaches, with the higher floors of the plans
    without the techniques that lower it: the compressed stashes (when recompute.compress allows them) and nesting."""
    if compress == "none":
        restricted = [(budget.least_bytes_unnested, "without nesting")]
    else:
        restricted = [
            (budget.least_bytes_exact, f"without {compress} stashes"),
            (budget.least_bytes_today, f"without nesting or {compress} stashes"),
        ]
    shown, higher = budget.least_bytes, []
    for floor, without in restricted:
        if floor > shown:
            higher.append(f"{floor / GIB:.4f} {without}")
            shown = floor
    return f"floor {budget.least_bytes / GIB:.4f}" + (f" ({', '.join(higher)})" if higher else "")


def _blocks(recipes: list[LayerRecipe], stage: StageRange) -> int:
    return sum(recipes[i].module_class in BLOCK_CLASSES for i in stage.layers)


def _fastest_partition(
    planner: StagePlanner,
    recompute: RecomputeConfig,
    schedule: str,
    early: bool | None,
    partitions: list[tuple[str, list[StageRange]]],
) -> tuple[list[StageRange], tuple[tuple[str, float | None], ...]]:
    """The partition whose plans simulate fastest under their fastest allowed schedule, first wins a tie: balanced's
    own block counts never lose to a split DeepSpeed could have made. One that fits no plan is priced None (the
    first is kept then, and the budget check names its stage)."""
    steps = []
    for _, stages in partitions:
        planned = [planner.plan(stage) for stage in stages]
        step = None
        if not isinstance(recompute, AutoRecompute) or all(b.choice is not None for _, b in planned):
            try:
                step = choose_schedule(planner, stages, [p for p, _ in planned], schedule, early)[0].step_time_s
            except ValueError:  # no allowed schedule fits the budget with this split
                pass
        steps.append(step)
    priced = [i for i, step in enumerate(steps) if step is not None]
    best = min(priced, key=lambda i: (steps[i], i)) if priced else 0
    return partitions[best][1], tuple((name, step) for (name, _), step in zip(partitions, steps))


def _priced_alternatives(
    model: GPTConfig, auto: AutoRecompute, run: RunShape, partition_method: str, seed: int
) -> list[tuple[str, float]]:
    """Each of budget_refusal.alternatives with the smallest budget the planner finds under it (analytic costs), and
    lossy fp8 storage where the run does not allow it yet."""
    priced = []
    settings = [(setting, auto, other_run) for setting, other_run in alternatives(model, run)]
    if auto.compress == "none" and run.target.compiled is None:  # train.compile refuses compressed stashes
        settings.append(("recompute.compress=fp8 (lossy)", replace(auto, compress="fp8"), run))
    for setting, other_auto, other_run in settings:
        try:
            layout = build_layout(model, other_auto, other_run, partition_method, seed, price_alternatives=False)
        except BudgetTooSmall as refused:
            priced.append((setting, refused.smallest_gb))
            continue
        except ValueError:  # the setting itself is refused (recompute.early=true that does not fit): not a help
            continue
        priced.append((setting, smallest_budget_gb(other_auto, layout.budgets)))
    return priced
