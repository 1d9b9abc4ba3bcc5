"""A traced step's time per stage: busy, idle (the pipeline bubble), recompute, and the mean cost of each
instruction per micro-batch (what a step-time simulator replays).

Busy is compute: loading a micro-batch, forward, backward (the recompute inside it included; under zb-h1 its
two halves, B and W), early recompute and the optimizer step. Everything else is idle: the gaps between
instructions and the send/recv and gradient all-reduces, which mostly wait for a peer (docs/measurement.md:
gloo's point-to-point is a rendezvous).
A stage's figures are the mean over its data-parallel ranks; under a virtual-stage schedule a "stage" is a pipeline
rank, its chunks together, and its communication is one interval per programme boundary (EXCHANGE).
"""

import statistics

from parallel.measurement.trace import RECOMPUTE, RankTrace, StepTrace
from parallel.planning.virtual_sim import EXCHANGE, RECEIVE_WAIT

CATEGORY = {
    "LoadMicroBatch": "load",
    "ForwardPass": "forward",
    "BackwardPass": "backward",
    "BackwardInput": "backward B",
    "BackwardWeight": "backward W",
    "RecomputeEarly": "early recompute",
    RECOMPUTE: "recompute",
    "SendActivation": "p2p",
    "RecvActivation": "p2p",
    "SendGrad": "p2p",
    "RecvGrad": "p2p",
    EXCHANGE: "p2p",
    RECEIVE_WAIT: "p2p",
    "ReduceTiedGrads": "reduce",
    "ReduceGrads": "reduce",
    "OptimizerStep": "optimizer",
}
"""The category of each traced interval: its colour in timeline.png and its `cat` in trace.json."""

BUSY = ("load", "forward", "backward", "backward B", "backward W", "early recompute", "optimizer")


def _seconds(rank: RankTrace, categories: tuple[str, ...]) -> float:
    return sum(i.duration_s for i in rank.instructions if CATEGORY[i.name] in categories)


def _mean_duration(ranks: list[RankTrace], name: str) -> float | None:
    durations = [i.duration_s for r in ranks for i in r.instructions if i.name == name]
    return statistics.fmean(durations) if durations else None


def _costs(ranks: list[RankTrace]) -> dict:
    """Mean seconds per instruction on one stage (None where the stage runs none of it)."""
    backwards = sum(1 for r in ranks for i in r.instructions if i.name in ("BackwardPass", "BackwardInput"))
    recompute = sum(i.duration_s for r in ranks for i in r.recomputes)
    p2p = [i.duration_s for r in ranks for i in r.instructions if CATEGORY[i.name] == "p2p"]
    return {
        "load_s": _mean_duration(ranks, "LoadMicroBatch"),
        "forward_s": _mean_duration(ranks, "ForwardPass"),
        "backward_s": _mean_duration(ranks, "BackwardPass"),
        "backward_input_s": _mean_duration(ranks, "BackwardInput"),
        "backward_weight_s": _mean_duration(ranks, "BackwardWeight"),
        "early_recompute_s": _mean_duration(ranks, "RecomputeEarly"),
        "recompute_s": recompute / backwards if backwards else 0.0,
        "reduce_tied_grads_s": _mean_duration(ranks, "ReduceTiedGrads"),
        "reduce_grads_s": _mean_duration(ranks, "ReduceGrads"),
        "optimizer_s": _mean_duration(ranks, "OptimizerStep"),
        "p2p_min_s": min(p2p) if p2p else None,
    }


def stage_times(trace: StepTrace) -> dict:
    """The summary.json entries of a traced step (docs/outputs.md)."""
    step = trace.step_time_s
    by_stage = [[r for r in trace.ranks if r.stage == s] for s in range(trace.stages)]
    busy = [statistics.fmean(_seconds(r, BUSY) for r in ranks) for ranks in by_stage]
    idle = [step - b for b in busy]
    return {
        "traced_step": trace.step,
        "traced_step_time_s": step,
        "trace_clock_skew_s": trace.clock_skew_s,
        "stage_busy_s": busy,
        "stage_idle_s": idle,
        "bubble_fraction_per_stage": [i / step for i in idle],
        "recompute_s_per_stage": [
            statistics.fmean(sum(i.duration_s for i in r.recomputes) for r in ranks) for ranks in by_stage
        ],
        "trace_costs": [_costs(ranks) for ranks in by_stage],
    }
