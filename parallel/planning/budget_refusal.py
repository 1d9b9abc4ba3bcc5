"""The refusal of a recompute.budget_gb that no plan fits: the smallest budget that does, and each setting that
would lower it, with the smallest budget the planner finds under that setting (parallel/planning/layout.py prices
them)."""

import math
from dataclasses import replace

from model import GPTConfig
from parallel.planning.auto_recompute import StageBudget
from parallel.planning.config import AutoRecompute
from parallel.planning.shapes import GIB, RunShape, Topology


def smallest_budget_gb(auto: AutoRecompute, budgets: list[StageBudget], nesting: bool = True) -> float:
    """The smallest recompute.budget_gb every stage fits in (without nested segments, with `nesting` false), rounded
    up to three significant digits so that the figure quoted really fits."""
    gb = max(b.least_bytes if nesting else b.least_bytes_unnested for b in budgets) / GIB + auto.reserve_gb
    step = 10.0 ** (math.floor(math.log10(gb)) - 2)
    return round(math.ceil(gb / step) * step, 12)


def alternatives(model: GPTConfig, run: RunShape) -> list[tuple[str, RunShape]]:
    """The settings that hold less per rank, each with the run it makes, leaving out what is already set: twice the
    stages (while every stage still gets a block), half the micro-batch, bf16 instead of fp32, and the optimizer
    state sharded over more data-parallel ranks (ZeRO-1, or bf16's optimizer, which shards at ZeRO-0)."""
    topology, target = run.topology, run.target
    stages, dp = 2 * topology.pipeline_stages, topology.data_parallel_size
    out = []
    if stages <= model.n_layer:
        out.append((f"parallel.pipeline_stages={stages}", replace(run, topology=Topology(stages, dp))))
    if run.micro_batch_size > 1:
        size = run.micro_batch_size // 2
        out.append((f"train.micro_batch_size={size}", replace(run, micro_batch_size=size)))
    if target.precision == "fp32":
        out.append(("train.precision=bf16", replace(run, target=replace(target, precision="bf16"))))
    if target.precision == "bf16" or run.zero_stage == 1:
        wider = Topology(topology.pipeline_stages, 2 * dp)
        out.append((f"parallel.data_parallel_size={2 * dp}", replace(run, topology=wider)))
    else:
        wider = Topology(topology.pipeline_stages, max(2, dp))
        setting = "parallel.zero_stage=1" + (" with parallel.data_parallel_size=2" if dp == 1 else "")
        out.append((setting, replace(run, topology=wider, zero_stage=1)))
    return out


class BudgetTooSmall(ValueError):
    """recompute.budget_gb fits no plan on some stage. `priced`: (setting, the smallest budget under it) for each of
    `alternatives`; those below this run's own smallest budget are named. `where`: what each budget's `stage` counts,
    `stage`, or `rank` where a rank's chunks share the budget (parallel/planning/virtual_auto.py's RankBudget)."""

    def __init__(
        self, auto: AutoRecompute, budgets: list[StageBudget], priced: list[tuple[str, float]], where: str = "stage"
    ):
        self.smallest_gb = smallest_budget_gb(auto, budgets)
        failing = ", ".join(str(b.stage) for b in budgets if b.choice is None)
        message = (
            f"recompute.budget_gb={auto.budget_gb} does not fit {where} {failing}, not even with the plan that holds "
            f"least: the smallest budget that fits every {where} is recompute.budget_gb={self.smallest_gb:g} (with "
            f"recompute.reserve_gb={auto.reserve_gb})"
        )
        unnested = smallest_budget_gb(auto, budgets, nesting=False)
        if unnested > self.smallest_gb:
            nested = ", ".join(str(b.stage) for b in budgets if b.least_bytes < b.least_bytes_unnested)
            message += (
                f", reached with nested checkpoints on {where} {nested} (auto nests a {where} where nothing else fits; "
                f"without nesting the smallest budget is {unnested:g})"
            )
        if where == "rank" and auto.early is True:
            message += (
                ", each chunk that recomputes doing it early as recompute.early=true asks (recompute.early=null "
                "recomputes early only where that fits)"
            )
        helps = [f"{setting} fits at {gb:g}" for setting, gb in priced if gb < self.smallest_gb]
        if helps:
            message += ". Also helps (the smallest budget the planner finds with it): " + ", ".join(helps)
        super().__init__(message)
