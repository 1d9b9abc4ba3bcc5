"""The dry run's last word: does each stage fit the target's memory, by how much it is over, and the one change that
helps most (each candidate planned again and compared); and when the step idles, what would fill it (a schedule the
options do not allow, more micro-batches), priced.
"""

from dataclasses import dataclass, replace

from model import GPTConfig
from parallel.planning.budget_refusal import alternatives
from parallel.planning.config import AutoRecompute, FullRecompute, RecomputeConfig
from parallel.planning.curve_seconds import profile_prices
from parallel.planning.device_profile_file import DeviceProfile
from parallel.planning.instruction_seconds import DeviceRates
from parallel.planning.layout import build_layout
from parallel.planning.plan_record import RunPlan
from parallel.planning.shapes import GIB, RunShape, Shape, gib_text

GPU_MEMORY_GIB = 80.0
"""The memory of the GPU a CUDA dry run is planned on (an 80 GB H100, parallel/planning/instruction_seconds.py's
DEFAULT_GPU) when train.device_memory_gb does not say."""
IDLE_ADVICE = 0.25
"""Share of the step every stage idles above which the dry run says what would fill the bubble."""


@dataclass(frozen=True)
class Replanner:
    """Plans the same model with one setting changed, priced with the same costs."""

    model: GPTConfig
    partition_method: str
    seed: int
    profile: DeviceProfile | None
    """The costs' device profile (None: analytic), priced again at each setting's shape and precision."""
    rates: DeviceRates

    def plan(self, recompute: RecomputeConfig, run: RunShape, schedule: str) -> tuple[int, float] | None:
        """(the largest stage's predicted peak bytes, the predicted step) of the setting's layout; None where it plans
        nothing (a budget no plan fits, a schedule it refuses)."""
        costs = None
        if self.profile is not None and self.profile.signature.precision == run.target.precision:  # else analytic
            costs = profile_prices(self.profile, Shape.of(self.model, run.micro_batch_size), run.target)
        try:
            layout = build_layout(
                self.model,
                recompute,
                run,
                self.partition_method,
                self.seed,
                costs,
                self.rates,
                schedule,
                price_alternatives=False,
            )
        except ValueError:
            return None
        chosen = next(
            o for o in layout.schedule_options if o.schedule == layout.schedule and o.plans == tuple(layout.plans)
        )
        return max(chosen.peak_bytes), chosen.step_time_s


def verdict_lines(
    plan: RunPlan,
    memory_bytes: int,
    memory_name: str,
    replanner: Replanner,
    recompute: RecomputeConfig,
    run: RunShape,
    schedule: str,
) -> list[str]:
    """One line per stage (per rank under a schedule with virtual stages, whose chunks share it) against
    `memory_bytes` (`memory_name` says whose memory it is), the change that helps most when one is over, and the
    bubble advice. `schedule`: parallel.schedule as set."""
    virtual = plan.virtual
    if virtual is not None:
        unit = "rank"
        peaks = [a + s for a, s in zip(virtual.activation_bytes_per_rank, virtual.state_bytes_per_rank)]
    else:
        unit, peaks = "stage", [s.predicted_peak_bytes for s in plan.stages]
    lines = [f"verdict against {gib_text(memory_bytes)} GiB per rank ({memory_name}):"]
    for index, peak in enumerate(peaks):
        state = "fits" if peak <= memory_bytes else f"over by {gib_text(peak - memory_bytes)} GiB"
        lines.append(f"{unit} {index}: predicted peak {gib_text(peak)} GiB: {state}")
    over = sum(peak > memory_bytes for peak in peaks)
    speed = f", {plan.tokens_per_s:,.0f} tokens/s predicted" if plan.tokens_per_s else ""
    if not over:
        lines.append(f"verdict: fits: all {len(peaks)} {unit}s within {gib_text(memory_bytes)} GiB{speed}")
        return lines + (_bubble_advice(plan, replanner, recompute, run, schedule) if virtual is None else [])
    lines.append(f"verdict: does not fit: {over} of {len(peaks)} {unit}s over {gib_text(memory_bytes)} GiB")
    if virtual is None:
        lines.append(_most_helpful(plan, memory_bytes, replanner, recompute, run, schedule))
    elif not isinstance(recompute, AutoRecompute):  # the alternatives are priced on one stage per rank only
        lines.append(
            f"+recompute=auto recompute.budget_gb={memory_bytes / GIB:.4g} recompute.reserve_gb=0 plans each rank's "
            "chunks against it"
        )
    return lines


def _most_helpful(
    plan: RunPlan, memory_bytes: int, replanner: Replanner, recompute: RecomputeConfig, run: RunShape, schedule: str
) -> str:
    """Of the changes that fit every stage, the fastest per token (a half-size micro-batch halves the step and the
    tokens); if none fits, the one that lowers the largest peak most. Each is said in tokens/s beside this plan's."""
    settings: list[tuple[str, RecomputeConfig, RunShape, str]] = []
    fixed = "1f1b" if schedule == "auto" else schedule
    if not isinstance(recompute, AutoRecompute):
        auto = AutoRecompute(budget_gb=memory_bytes / GIB, reserve_gb=0.0)
        settings.append((f"+recompute=auto recompute.budget_gb={memory_bytes / GIB:.4g}", auto, run, "auto"))
        full = FullRecompute(interval="stage")
        if recompute != full:
            settings.append(("+recompute=full recompute.interval=stage", full, run, fixed))
    settings += [(name, recompute, other, schedule) for name, other in alternatives(replanner.model, run)]
    priced = []
    for name, setting_recompute, setting_run, setting_schedule in settings:
        other = replanner.plan(setting_recompute, setting_run, setting_schedule)
        if other is not None:
            peak, step = other
            priced.append((name, peak, step, setting_run.tokens_per_step(replanner.model.seq_len) / step))
    now = f" against {plan.tokens_per_s:,.0f} now" if plan.tokens_per_s else ""
    fitting = [p for p in priced if p[1] <= memory_bytes]
    if fitting:
        name, peak, step, speed = max(fitting, key=lambda p: p[3])
        return (
            f"helps most: {name} (largest stage peak {gib_text(peak)} GiB, predicted step {step:.4g} s, "
            f"{speed:,.0f} tokens/s{now})"
        )
    if priced:
        name, peak, step, speed = min(priced, key=lambda p: p[1])
        return (
            f"helps most, still over: {name} (largest stage peak {gib_text(peak)} GiB, predicted step {step:.4g} s, "
            f"{speed:,.0f} tokens/s{now})"
        )
    return "no single change planned here fits"


def _bubble_advice(
    plan: RunPlan, replanner: Replanner, recompute: RecomputeConfig, run: RunShape, schedule: str
) -> list[str]:
    """When every stage idles more than IDLE_ADVICE of the step: the fastest schedule setting the options left out,
    and twice the micro-batches, each with its predicted time per micro-batch."""
    st = plan.step_time
    if st is None or min(st.stage_idle_s) <= IDLE_ADVICE * st.predicted_step_time_s:
        return []
    idle = ", ".join(f"{t / st.predicted_step_time_s:.0%}" for t in st.stage_idle_s)
    lines = [f"bubble: the stages idle {idle} of the predicted step"]
    chosen = st.predicted_step_time_s
    barred = [(name, o) for name, o in st.by_schedule.items() if not o["allowed"] and o["fits"]]
    if run.target.compiled is not None:  # train.compile runs 1f1b without early recompute: the others are refused
        barred = []
    if barred:
        name, option = min(barred, key=lambda item: item[1]["step_time_s"])
        if option["step_time_s"] < chosen:
            how = "parallel.schedule=auto and recompute.early=null (the planner chooses)"
            if not isinstance(recompute, AutoRecompute):
                kind, early = name.split("+")[0], name.endswith("+early")
                how = f"parallel.schedule={kind}" + (" recompute.early=true" if early else "")
            lines.append(f"  {name} would be {chosen / option['step_time_s'] - 1:.0%} faster: {how}")
    more = replace(run, micro_batches=2 * run.micro_batches)
    doubled = replanner.plan(recompute, more, schedule)
    if doubled is not None:
        per_micro_batch = doubled[1] / more.micro_batches
        lines.append(
            f"  train.micro_batches={more.micro_batches}: {per_micro_batch:.4g} s per micro-batch against "
            f"{chosen / run.micro_batches:.4g} s now (a smaller bubble per token)"
        )
    return lines
