"""The layout a run trains with, planned once at start-up: partition, and each stage's recompute plan
(for `recompute=auto`, chosen against the memory budget, which may refuse the run)."""
from typing import Optional

from parallel.auto_layout import layout_for
from parallel.auto_recompute import GIB, CostTable, StageBudget
from parallel.config import AutoRecompute
from parallel.layout import PipelineLayout
from parallel.memory_model import Target
from parallel.planner import RunShape
from schema.checks import Runtime, Topology
from schema.run import RunConfig


def run_shape(run: RunConfig, topo: Topology, rt: Runtime) -> RunShape:
    t = run.train
    return RunShape(t.micro_batches, t.micro_batch_size, topo.data_parallel_size, run.parallel.zero_stage,
                    Target(rt.device, rt.precision))


def plan_layout(run: RunConfig, topo: Topology, rt: Runtime,
                costs: Optional[CostTable] = None) -> tuple[PipelineLayout, Optional[list[StageBudget]]]:
    return layout_for(run.model, run.recompute, topo.pipeline_stages, run.parallel.partition_method, run.seed,
                      run_shape(run, topo, rt), costs)


def budget_lines(auto: AutoRecompute, budgets: list[StageBudget]) -> list[str]:
    """The auto plan against the budget, one line per stage, for the start-up print and the dry run."""
    usable = auto.budget_gb - auto.reserve_gb
    lines = [f"auto recompute: budget {auto.budget_gb:g} GiB - reserve {auto.reserve_gb:g} GiB = {usable:g} GiB per rank"]
    for b in budgets:
        counts: dict[str, int] = {}
        for choice in b.choice.choices:
            counts[choice] = counts.get(choice, 0) + 1
        plan = ", ".join(f"{n} x {c}" for c, n in counts.items()) or "no blocks"
        lines.append(f"stage {b.stage}: {plan} | {b.in_flight} in flight | predicted peak "
                     f"{b.predicted_peak_bytes / GIB:.4f} of {usable:g} GiB "
                     f"(segment working set {b.choice.working_bytes / GIB:.4f} GiB)")
    return lines


def budget_record(auto: AutoRecompute, budget: StageBudget) -> dict:
    """One stage's side of the budget, for plan.json and summary.json."""
    return {
        "budget_bytes": int((auto.budget_gb - auto.reserve_gb) * GIB),
        "predicted_peak_bytes_with_working_set": budget.predicted_peak_bytes,
        "recompute_working_bytes": budget.choice.working_bytes,
        "least_possible_peak_bytes": budget.least_bytes,
        "recompute_cost": budget.choice.cost,
    }
