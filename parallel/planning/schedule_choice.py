"""The schedule a layout runs: every schedule x early-recompute setting of the layout's plans priced (the
simulated step, the peaks, the budget), and the allowed one with the shortest step that fits chosen; ZB-H1's
deferred W's per stage bounded by 1F1B's peak.
"""

from dataclasses import dataclass, replace

from parallel.planning.config import AutoRecompute
from parallel.planning.partition import StageRange
from parallel.planning.schedules import SCHEDULES
from parallel.planning.shapes import GIB
from parallel.planning.stage_plan import StagePlan, with_early
from parallel.planning.stage_planner import StagePlanner
from parallel.planning.stage_price import StagePrice, StagePricing, price_stage, simulate_priced
from parallel.planning.step_sim import lower_bound_s


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
    """What no schedule of these stages beats (parallel/planning/step_sim.py's `lower_bound_s`)."""
    peak_bytes: tuple[int, ...]
    """Each stage's predicted peak under this setting (StageMemory.predicted_peak_bytes: the backward's working set
    included, which early recompute moves ahead of the backward)."""
    fits: bool
    """`recompute=auto` only (always true without it): every stage's peak within the budget."""
    allowed: bool
    """parallel.schedule and recompute.early allow it (`auto` / null allow every value)."""


def choose_schedule(
    planner: StagePlanner, stages: list[StageRange], plans: list[StagePlan], schedule: str, early: bool | None
) -> tuple[ScheduleOption, tuple[ScheduleOption, ...]]:
    """Price every schedule x early setting of the plans, and keep the allowed one with the shortest simulated
    step among those that fit (`schedule` `auto` or `early` None: the planner's choice). Early recompute is
    priced only where some stage recomputes. The plans are auto's (or the mode's) for 1F1B, which fits the
    budget: early recompute adds one micro-batch's recomputed activations to a stage's peak, and ZB-H1's B holds
    what its W's need (`_deferrals` bounds only the W's it defers), so under a budget either may not fit. Raises
    ValueError when no allowed setting fits the budget."""
    recomputes = any(p.segments or p.selective for p in plans)
    options = []
    for early_here in (False, True) if recomputes else (False,):
        for kind in SCHEDULES:
            # With nothing to recompute, early=true has nothing to move: its setting is early=false's.
            allowed = schedule in ("auto", kind) and (early is None or early == early_here or not recomputes)
            options.append(price_schedule(planner, stages, plans, kind, early_here, allowed))
    candidates = [o for o in options if o.allowed and o.fits]
    if not candidates:
        usable = planner.usable / GIB
        raise ValueError(
            f"parallel.schedule={schedule} with recompute.early={str(early).lower()} does not fit "
            f"recompute.budget_gb: early recompute holds one micro-batch's recomputed activations on top of the "
            f"plan, zb-h1's backward holds what its deferred weight gradients need, and a stage's peak then exceeds "
            f"its {usable:g} GiB; use parallel.schedule=auto and recompute.early=null (the planner chooses), or a "
            f"larger recompute.budget_gb"
        )
    return min(candidates, key=lambda o: o.step_time_s), tuple(options)


def setting_prices(
    pricing: StagePricing, stages: list[StageRange], plans: list[StagePlan], kind: str, early: bool
) -> list[StagePrice]:
    """The plans under schedule `kind` with early recompute on (`early`: on every stage that recomputes, but the
    last) or off, and ZB-H1's deferrals: each stage priced. The run plan prices the uniform modes it compares with
    this too, so that they run the layout's own schedule."""
    plans = [replace(p, deferred_weights=None) for p in with_early(plans, early)]
    if kind == "zb-h1":
        plans = _deferrals(pricing, stages, plans)
    return [price_stage(pricing, st, p, kind) for st, p in zip(stages, plans)]


def price_schedule(
    planner: StagePlanner, stages: list[StageRange], plans: list[StagePlan], kind: str, early: bool, allowed: bool
) -> ScheduleOption:
    prices = setting_prices(planner.pricing, stages, plans, kind, early)
    peaks = tuple(price.memory.predicted_peak_bytes for price in prices)
    fits = not isinstance(planner.recompute, AutoRecompute) or all(peak <= planner.usable for peak in peaks)
    return ScheduleOption(
        kind,
        early,
        tuple(price.plan for price in prices),
        simulate_priced(prices).step_time_s,
        lower_bound_s([price.costs for price in prices], planner.pricing.run.micro_batches, early),
        peaks,
        fits,
        allowed,
    )


def _deferrals(pricing: StagePricing, stages: list[StageRange], plans: list[StagePlan]) -> list[StagePlan]:
    """ZB-H1's bound, per stage: the most deferred W's (up to the stage index, ZB-H1's own count) that keep
    the stage's predicted peak (each backward's working set inside it) within the fullest stage's
    1F1B peak of the same plans. That is ZB-H1's promise
    ("1F1B's activation memory"): a later stage holds fewer micro-batches under 1F1B than stage 0, and the room
    left takes deferred W's. A W-pending micro-batch holds each Linear's input and output gradient
    (weight_grad_bytes.weight_grad_items), whatever the plan recomputes, so under heavy recompute even one may not
    fit: the stage then defers none, and its B and W are 1F1B's backward cut in two."""

    def peak(stage: StageRange, plan: StagePlan, kind: str) -> int:
        return price_stage(pricing, stage, plan, kind).memory.predicted_peak_bytes

    bound = max(peak(st, p, "1f1b") for st, p in zip(stages, plans))
    out = []
    for st, p in zip(stages, plans):
        deferred = next(
            d for d in range(st.stage, -1, -1) if d == 0 or peak(st, replace(p, deferred_weights=d), "zb-h1") <= bound
        )
        out.append(replace(p, deferred_weights=deferred))
    return out
