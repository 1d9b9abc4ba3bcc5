"""The planner's regret: at three budgets per shape, the plans `+recompute=auto` weighed that fit, each run for real,
against auto's own choice.

    DS_ACCELERATOR=cpu .venv/bin/python -m bench.planner_regret [--profile P] [--rounds R] [--steps S] [--keep DIR]

Shapes A and B of bench/step_time_bench.py (2 stages of 2 blocks, 4 micro-batches, fp32, one thread per rank). The
budgets are a quarter, half and three quarters of the way from auto's floor (the smallest peak any plan it may choose
reaches, on the fullest stage) to no recompute's peak there. At each budget:

- the time objective: auto priced by the run's stage measured at start-up (train.prices=measured, the default);
- the FLOP objective: auto priced analytically (train.prices=analytic);
- the fastest whole-run plans auto weighed, by simulated step (the dry run's `considered`: up to 8);
- uniform full(1).

Every plan runs under 1F1B without early recompute on DeepSpeed's type:Block partition, so only the plan differs:
auto's two objectives through their dry runs' plan.json, the others written as plan files, all run with
`+recompute=plan recompute.file=...` (full(1) as `+recompute=full`). Each round runs every plan of every budget once;
auto's regret is its median step over rounds against the fastest plan's median.
"""

import argparse
import json
import math
import statistics
import tempfile
from pathlib import Path

import torch

from bench.real_runs import (
    STAGES,
    TRACE_STEP,
    Variant,
    dry_run_plan,
    read_result,
    run_dir_of,
    run_rounds,
)
from bench.step_time_bench import MICRO_BATCHES, SEED, SHAPES, TARGET, measure_profile
from model import GPTConfig
from parallel.planning.config import AutoRecompute, NoRecompute
from parallel.planning.layout import build_layout
from parallel.planning.shapes import GIB, MIB, RunShape, Topology

FRACTIONS = (0.25, 0.5, 0.75)
"""Where the budgets sit between auto's floor and no recompute's peak."""
FIXED = ("parallel.schedule=1f1b", "recompute.early=false")
AUTO_TIME, AUTO_FLOP, FULL = "auto time", "auto flop", "full(1)"


def budgets(cfg: GPTConfig) -> list[float]:
    """Bytes per rank at FRACTIONS of the way from auto's floor to no recompute's peak, on the stage that needs most
    (what fits never depends on the prices)."""
    run = RunShape(Topology(STAGES), TARGET, micro_batches=MICRO_BATCHES, micro_batch_size=1)
    roomy = build_layout(cfg, AutoRecompute(budget_gb=1024.0, reserve_gb=0.0), run, "type:Block", SEED)
    floor = max(b.least_bytes for b in roomy.budgets)
    plain = max(build_layout(cfg, NoRecompute(), run, "type:Block", SEED).peak_bytes)
    return [floor + f * (plain - floor) for f in FRACTIONS]


def dry_run(cfg: GPTConfig, overrides: tuple[str, ...], run_dir: Path) -> dict:
    """plan.json of the dry run of `overrides` (real_runs.dry_run_plan); a refusal ends the bench."""
    plan = dry_run_plan(cfg, Variant("dry run", MICRO_BATCHES, None, "type:Block", overrides, ()), run_dir)
    if isinstance(plan, str):
        raise SystemExit(f"dry run of {' '.join(overrides)}: {plan}")
    return plan


def plan_text(stages: list[dict]) -> str:
    """A whole-run plan in a few words: per stage, its segments and selective blocks."""

    def stage(plan: dict) -> str:
        parts = [f"full{tuple(s)}" + ("n" if plan["nested"] else "") for s in plan["segments"]]
        parts += [f"{i}:" + "+".join(m) for i, m in plan["selective"].items()]
        return ",".join(parts) or "none"

    return " | ".join(stage(p) for p in stages)


def candidates(
    cfg: GPTConfig, budget: float, priced: tuple[str, ...], folder: Path
) -> list[tuple[Variant, float, str]]:
    """Every plan measured at `budget`, as variants run with `+recompute=plan` (full(1) with `+recompute=full`), each
    with its predicted step under the time objective's prices and its plan in a few words; kept in `folder` and read
    back from there by a later invocation with the same --keep (the runs have moved the prices' residuals since)."""
    kept = folder / "candidates.json"
    if kept.is_file():
        return [
            (Variant(name, MICRO_BATCHES, None, "type:Block", tuple(overrides), ()), predicted, text)
            for name, overrides, predicted, text in json.loads(kept.read_text())
        ]
    out = _candidates(cfg, budget, priced, folder)
    kept.write_text(json.dumps([(v.name, v.overrides, predicted, text) for v, predicted, text in out]))
    return out


def _candidates(
    cfg: GPTConfig, budget: float, priced: tuple[str, ...], folder: Path
) -> list[tuple[Variant, float, str]]:
    auto = ("+recompute=auto", f"recompute.budget_gb={budget / GIB:.9f}", "recompute.reserve_gb=0", *FIXED)
    time_plan = dry_run(cfg, (*priced, *auto), folder / "dry-auto-time")
    flop_plan = dry_run(cfg, ("train.prices=analytic", *auto), folder / "dry-auto-flop")
    layers = [s["layers"] for s in time_plan["stages"]]
    plans = {AUTO_TIME: [s["plan"] for s in time_plan["stages"]], AUTO_FLOP: [s["plan"] for s in flop_plan["stages"]]}
    for rank, considered in enumerate(time_plan["considered"], 1):
        plans.setdefault(f"weighed {rank}", considered["stages"])
    out, seen = [], set()
    for name, stages in plans.items():
        key = json.dumps(stages, sort_keys=True)
        if key in seen:
            continue
        seen.add(key)
        path = folder / f"{name.replace(' ', '-')}.json"
        path.write_text(json.dumps({"stages": [{"layers": lay, "plan": p} for lay, p in zip(layers, stages)]}))
        overrides = (*priced, "+recompute=plan", f"recompute.file={path}", *FIXED)
        predicted = dry_run(cfg, overrides, folder / f"dry-{path.stem}")["predicted_step_time_s"]
        out.append((Variant(name, MICRO_BATCHES, None, "type:Block", overrides, ()), predicted, plan_text(stages)))
    full = (*priced, "+recompute=full", *FIXED)
    full_plan = dry_run(cfg, full, folder / "dry-full")
    fits = max(s["predicted_peak_bytes"] for s in full_plan["stages"]) <= budget
    if fits:  # uniform full(1) is a plan auto could choose only where it fits
        variant = Variant(FULL, MICRO_BATCHES, None, "type:Block", full, ())
        out.append((variant, full_plan["predicted_step_time_s"], "full(1) on every block"))
    return out


def report(
    shape: str, budget: float, measured: dict[str, list[float]], found: list[tuple[Variant, float, str]]
) -> None:
    """The budget's table, fastest measured first, and auto's regret: its median step over the fastest plan's median
    (a ratio of medians: the fastest of one round's noisy steps would flatter whichever plan drew the quiet moment)."""
    medians = {name: statistics.median(times) for name, times in measured.items()}
    fastest = min(medians.values())
    rounds = len(next(iter(measured.values())))
    print(f"\nshape {shape}, budget {budget / MIB:.2f} MiB per rank ({rounds} rounds)")
    print(
        "| plan | blocks per stage | predicted s | measured s (median of rounds) | each round's s | over the fastest |"
    )
    print("|---|---|---|---|---|---|")
    described = {variant.name: (predicted, text) for variant, predicted, text in found}
    for name, median in sorted(medians.items(), key=lambda item: item[1]):
        predicted, text = described[name]
        each = ", ".join(f"{t:.3f}" for t in measured[name])
        print(f"| {name} | {text} | {predicted:.3f} | {median:.3f} | {each} | {median / fastest:.3f} |")
    print(f"regret of auto (time objective): {medians[AUTO_TIME] / fastest:.3f}x the fastest measured plan")
    if AUTO_FLOP in medians:
        print(f"time objective's speed over the FLOP objective's: {medians[AUTO_FLOP] / medians[AUTO_TIME]:.3f}x")
    else:  # both objectives chose one plan
        print("time and FLOP objectives chose the same plan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--profile", type=Path, help="a device profile of this machine (1 thread); default: measure")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--shapes", nargs="+", choices=tuple(SHAPES), default=tuple(SHAPES))
    parser.add_argument(
        "--keep", type=Path, help="keep the runs and plan files here; again: reads what is there, runs the rest"
    )
    args = parser.parse_args()
    if args.steps < TRACE_STEP:
        raise SystemExit(f"--steps={args.steps}: at least {TRACE_STEP} (the traced step)")
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix="planner_regret-") as tmp:
        root = args.keep or Path(tmp)
        profile = args.profile or root / "device_profile.json"
        if args.profile is None:
            measure_profile(profile, smoke=False)
        priced = ("train.prices=measured", f"train.device_profile={profile}")
        todo = {}
        for shape in args.shapes:
            cfg = SHAPES[shape]
            for index, budget in enumerate(budgets(cfg)):
                found = candidates(cfg, budget, priced, root / f"{shape}-budget{index + 1}")
                todo[shape, budget] = found
                print(f"shape {shape} budget {budget / MIB:.2f} MiB: {len(found)} plans", flush=True)
                for variant, predicted, text in found:
                    print(f"  {variant.name}: {text} (predicted {predicted:.3f} s)", flush=True)
        measured: dict[tuple[str, float], dict[str, list[float]]] = {key: {} for key in todo}
        for k in range(args.rounds):
            for (shape, budget), found in todo.items():
                folder = root / f"{shape}-{budget:.0f}-round{k + 1}"
                # runs an earlier invocation with this --keep finished are read, not repeated
                done = [v for v, _, _ in found if (run_dir_of(folder, 0, v) / "summary.json").is_file()]
                results = [read_result(v, k, run_dir_of(folder, 0, v), math.nan, math.nan) for v in done]
                left = [v for v, _, _ in found if v not in done]
                for result in results + run_rounds(
                    SHAPES[shape], left, 1, args.steps, folder, k + 1, f"{shape} {budget / MIB:.2f} MiB"
                ):
                    measured[shape, budget].setdefault(result.variant.name, []).append(result.median_step_s)
        for (shape, budget), found in todo.items():
            report(shape, budget, measured[shape, budget], found)


if __name__ == "__main__":
    main()
