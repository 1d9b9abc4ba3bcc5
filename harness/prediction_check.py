"""The plan's step-time prediction against what the run measured, in summary.json's `prediction`: the whole step
(the median after warm-up) and, on a traced step, each instruction kind per stage. A step more than
`TOLERANCE` off its prediction is said at the end of the run: plans priced by such costs (auto, balanced, the
schedule and early-recompute choice) may choose wrongly.

A run priced by measured prices learns from its traced step: the residual of each kind of instruction (measured /
predicted, over the stages) is written beside the prices (`residuals_path`), and the next plan at that shape scales the
prices by it (harness/price_source.py): the stage replay times a stage alone, the run's ranks share the machine."""

import json
import statistics
from pathlib import Path

from harness.files import atomic_write_json
from parallel.measurement.trace import StepTrace
from parallel.planning.plan_record import RunPlan

TOLERANCE = 0.10
"""How far the measured step may be from the prediction before the run says so."""


def traced_instruction_seconds(trace: StepTrace) -> list[dict[str, float]]:
    """Per stage, the mean seconds of each instruction kind over the traced step (and its data-parallel ranks)."""
    out = []
    for stage in range(trace.stages):
        durations: dict[str, list[float]] = {}
        for rank in trace.ranks:
            if rank.stage == stage:
                for interval in rank.instructions:
                    durations.setdefault(interval.name, []).append(interval.duration_s)
        out.append({name: statistics.fmean(values) for name, values in durations.items()})
    return out


def prediction_record(plan: RunPlan, measured_step_s: float, trace: StepTrace | None) -> dict:
    """summary.json's `prediction` (docs/outputs.md): per stage, or under a virtual-stage schedule per rank (its
    chunks' instructions together, as its trace has them)."""
    predicted = plan.predicted_step_time_s
    record = {
        "predicted_step_time_s": predicted,
        "measured_step_time_s": measured_step_s,
        "error": measured_step_s / predicted - 1,
        "costs": plan.prediction_costs,
    }
    if trace is not None and plan.instruction_s:
        record["per_stage"] = [
            {
                name: {
                    "predicted_s": seconds,
                    "measured_s": traced.get(name),
                    "ratio": traced[name] / seconds if seconds and name in traced else None,
                }
                for name, seconds in predicted_stage.items()
            }
            for predicted_stage, traced in zip(plan.instruction_s, traced_instruction_seconds(trace))
        ]
        record["by_kind"] = residuals(record["per_stage"])
    return record


def residuals(per_stage: list[dict[str, dict]]) -> dict[str, dict[str, float]]:
    """Per instruction kind, over the stages that traced it: the predicted and the measured seconds summed, and their
    ratio (measured / predicted): what the prices of that kind missed on this run."""
    sums: dict[str, list[float]] = {}
    for stage in per_stage:
        for name, entry in stage.items():
            if entry["measured_s"] is not None and entry["predicted_s"]:
                total = sums.setdefault(name, [0.0, 0.0])
                total[0] += entry["predicted_s"]
                total[1] += entry["measured_s"]
    return {
        name: {"predicted_s": predicted, "measured_s": measured, "ratio": measured / predicted}
        for name, (predicted, measured) in sums.items()
    }


def prediction_warning(record: dict) -> str | None:
    """The end-of-run line of a step further than TOLERANCE from its prediction, else None."""
    if abs(record["error"]) <= TOLERANCE:
        return None
    return (
        f"stagecheck: the measured step ({record['measured_step_time_s']:.4g} s) is {record['error']:+.0%} off the "
        f"plan's prediction ({record['predicted_step_time_s']:.4g} s, {record['costs']} costs): plans priced by these "
        f"costs may choose wrongly; summary.json's `prediction` compares each instruction of a traced step "
        f"(train.trace_step)"
    )


LEARNT_KINDS = {
    "ForwardPass": "forward",
    "BackwardPass": "backward",
    "BackwardInput": "backward_input",
    "BackwardWeight": "weight_grad",
    "OptimizerStep": "optimizer",
}
"""The traced instructions whose residual the prices learn, and the kind of parts each scales
(parallel/planning/block_prices.py's RESIDUAL_PARTS); sends, receives and reductions are waits as much as work."""
ONE_REPLICA_KINDS = {"ReduceGrads": "reduce_grads"}
"""Learnt too where the data-parallel group is one rank: DeepSpeed's ReduceGrads then waits for no peer (it flattens
the gradients, all-reduces them over a group of one and copies them back), so its time is work, priced per
parameter (it ran at 2x its price in every run docs/step_time_benchmark.md read)."""


ADDED_KINDS = {"BoundaryExchange": "exchange_s"}
"""Traced instructions whose price is a part no replay measures (block_prices.ADDED_PARTS): learnt as seconds, each
run's by what its ranks measured beyond the prediction (the prediction holding the seconds learnt before)."""


def residuals_path(prices: Path) -> Path:
    return prices.with_name(prices.stem + ".residuals.json")


RESIDUAL_WINDOW = 20
"""The runs a kind's factor averages over, at most: past them each new run weighs 1/RESIDUAL_WINDOW, so the factors
follow a host whose speed changed (a shared machine moved to another host, or another load) within a few dozen runs."""


def read_residuals(prices: Path) -> tuple[dict[str, float], int]:
    """The residuals learnt for these prices so far, and from how many runs ({} and 0: none)."""
    residuals, runs, _ = _read_learnt(prices)
    return residuals, runs


def _read_learnt(prices: Path) -> tuple[dict[str, float], int, dict[str, int]]:
    """The residuals, the runs learnt from, and per kind how many of them measured it."""
    path = residuals_path(prices)
    if not path.exists():
        return {}, 0, {}
    data = json.loads(path.read_text())
    residuals = {kind: float(factor) for kind, factor in data["residuals"].items()}
    runs = int(data["runs"])
    observed = {kind: int(data.get("observed", {}).get(kind, runs)) for kind in residuals}
    return residuals, runs, observed


def learn_residuals(record: dict, cost_source: dict, data_parallel: int) -> Path | None:
    """Fold this run's residuals into its measured prices' (a run priced otherwise, or untraced, teaches nothing):
    each kind's factor becomes the geometric mean of what the runs that measured that kind (the last RESIDUAL_WINDOW of
    them, in effect) measured over its unscaled prices (this run's measured / predicted was priced with the factor of
    the runs before it). Counted per kind: BackwardWeight only runs under zb-h1, and a mean over every run would weigh
    each zb-h1 run as one of all (a factor that stayed at 1.01 while every zb-h1 run measured 1.2x). A mean, not the
    last run's ratio: on a shared machine one slow or fast run would otherwise set the next run's prices alone
    (docs/step_time_benchmark.md measured one instruction kind at 0.7x its price in one run, 1.6x in another).
    `data_parallel`: the run's replicas (ONE_REPLICA_KINDS are learnt at one)."""
    if cost_source.get("kind") != "measured" or "by_kind" not in record:
        return None
    prices = Path(cost_source["path"])
    residuals, runs, observed = _read_learnt(prices)
    for name, kind in (LEARNT_KINDS | (ONE_REPLICA_KINDS if data_parallel == 1 else {})).items():
        if name in record["by_kind"]:
            observed[kind] = min(observed.get(kind, 0) + 1, RESIDUAL_WINDOW)
            residuals[kind] = residuals.get(kind, 1.0) * record["by_kind"][name]["ratio"] ** (1 / observed[kind])
    for name, kind in ADDED_KINDS.items():
        missed = _missed_seconds(record.get("per_stage", []), name)
        if missed is not None:
            observed[kind] = min(observed.get(kind, 0) + 1, RESIDUAL_WINDOW)
            learnt = residuals.get(kind, 0.0)
            residuals[kind] = learnt + (max(0.0, learnt + missed) - learnt) / observed[kind]
    path = residuals_path(prices)
    atomic_write_json(path, {"runs": runs + 1, "residuals": residuals, "observed": observed})
    return path


def _missed_seconds(per_stage: list[dict[str, dict]], name: str) -> float | None:
    """The mean over the ranks that traced `name` of its measured seconds less its predicted (None: none traced it;
    its predicted seconds may be 0, where `residuals`' ratio has no meaning)."""
    missed = [
        entry["measured_s"] - entry["predicted_s"]
        for stage in per_stage
        if (entry := stage.get(name)) is not None and entry["measured_s"] is not None
    ]
    return statistics.fmean(missed) if missed else None
