"""The simulator's prediction against real 2-rank runs, and the time objective against the FLOP one.

    DS_ACCELERATOR=cpu .venv/bin/python -m bench.step_time_bench [--profile PATH] [--prices measured|curves]
        [--rounds R] [--steps S] [--smoke]

`--prices` (default measured, train.prices' default): the runs' plans are priced by their own stage, replayed at each
shape at start-up (parallel/measurement/stage_prices.py), with the profile's links; `curves`: by the profile's curves.
`--reprice PROFILE [--reprice-with corrected]` also dry-runs every variant priced by that profile's curves, or by
those curves corrected by the other shapes measured on this device (`train.prices=corrected`: each shape held out of
its own correction, as a shape this device cannot build is priced), beside the runs' own prediction.

Every variant is a real `deepspeed --num_gpus 2 train.py` run on CPU (gloo, one thread per rank), read back from
its summary.json, metrics.jsonl and traced step. Variants are interleaved in rounds (every variant of every shape
once per round; bench/real_runs.py).

- Figure 1: the run's own predicted step (`predicted_step_time_s`: the plan start-up made, the same the dry run
  prints, with no trace of the run) against the measured median step, for none, selective, full(1), full(stage) and
  auto, under 1F1B, ZB-H1 and 1F1B with early recompute, and for none, selective and full(1) under interleaved 1F1B,
  ZB-V and V-Half (2 chunks per rank; traced, but without a trace replay: a rank's traced costs mix its chunks), at
  two shapes (priced as `--prices` says). The profile is measured once at the start
  (`python -m parallel.measurement.device_profile`'s measurement: 2 processes at once, one thread each, as the runs'
  ranks), or read from `--profile`; it never sees these shapes.
- Figure 2: the time-objective auto (`--prices` costs, `balanced`, `parallel.schedule=auto`, `recompute.early=null`)
  against the FLOP-objective auto (analytic costs, `parameters`, 1F1B), at the same budget: tokens/s per round.

Not a test: timings depend on the machine. docs/step_time_benchmark.md gives the figures.
"""

import argparse
import math
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from bench.real_runs import (
    REPO,
    STAGES,
    TRACE_STEP,
    Result,
    Variant,
    dry_run_plan,
    launch_env,
    read_result,
    run_dir_of,
    run_rounds,
    traced_costs,
)
from model import GPTConfig
from parallel.planning.config import AutoRecompute, FullRecompute, NoRecompute, SelectiveRecompute
from parallel.planning.layout import build_layout
from parallel.planning.plan_record import RunPlan
from parallel.planning.run_plan import plan_run
from parallel.planning.shapes import GIB, MIB, RunShape, Target, Topology
from parallel.planning.step_sim import simulate_stages
from parallel.planning.virtual_program import VIRTUAL_SCHEDULES

SEED, TARGET, MICRO_BATCHES = 1234, Target("cpu", "fp32"), 4
SHAPES = {
    "A": GPTConfig(n_layer=4, n_head=8, n_embd=256, seq_len=256, vocab_size=256, dropout=0.1, attention="math"),
    "B": GPTConfig(n_layer=4, n_head=6, n_embd=384, seq_len=128, vocab_size=256, dropout=0.0, attention="sdpa"),
}
SMOKE = {"S": GPTConfig(n_layer=2, n_head=4, n_embd=64, seq_len=64, vocab_size=256, dropout=0.1, attention="math")}
SCHEDULES = {
    "1f1b": ("parallel.schedule=1f1b", "recompute.early=false"),
    "zb-h1": ("parallel.schedule=zb-h1", "recompute.early=false"),
    "1f1b+early": ("parallel.schedule=1f1b", "recompute.early=true"),
}


def budget_between_full_and_selective(cfg: GPTConfig) -> float:
    """Bytes three quarters of the way from full(1)'s stage-0 need to selective's (bench/auto_bench.py's budget)."""
    run = RunShape(Topology(STAGES), TARGET, micro_batches=MICRO_BATCHES, micro_batch_size=1)
    needs = []
    for recompute in (FullRecompute(interval="1"), SelectiveRecompute()):
        layout = build_layout(cfg, recompute, run, "type:Block", SEED)
        needs.append(plan_run(cfg, recompute, layout, run).stages[0].predicted_peak_bytes)
    return needs[0] + 0.75 * (needs[1] - needs[0])


def variants(budget_gb: float, profile: Path, prices: str) -> list[Variant]:
    """`prices`: train.prices of the time-objective runs (measured: the stage replay at each run's shape, with the
    profile's links; curves: the profile's curves)."""
    priced = (f"train.prices={prices}", f"train.device_profile={profile}")
    auto = ("+recompute=auto", f"recompute.budget_gb={budget_gb:.9f}", "recompute.reserve_gb=0")
    auto_cfg = AutoRecompute(budget_gb=budget_gb, reserve_gb=0.0)
    modes = {
        "selective": (SelectiveRecompute(), "type:Block", ("+recompute=selective",)),
        "full(1)": (FullRecompute(interval="1"), "type:Block", ("+recompute=full",)),
        "full(stage)": (FullRecompute(interval="stage"), "type:Block", ("+recompute=full", "recompute.interval=stage")),
        "auto": (auto_cfg, "balanced", auto),
    }
    out = [
        Variant(
            f"none {kind}", MICRO_BATCHES, NoRecompute(), "type:Block", (*priced, f"parallel.schedule={kind}"), (1,)
        )
        for kind in ("1f1b", "zb-h1")
    ]
    for name, (recompute, partition, overrides) in modes.items():
        for kind, schedule in SCHEDULES.items():
            out.append(
                Variant(f"{name} {kind}", MICRO_BATCHES, recompute, partition, (*priced, *overrides, *schedule), (1,))
            )
    # the schedules with virtual stages (2 chunks per rank, one block each): their prediction is the virtual plan's
    virtual = {"none": (NoRecompute(), ()), **{m: (modes[m][0], modes[m][2]) for m in ("selective", "full(1)")}}
    for name, (recompute, overrides) in virtual.items():
        for kind in VIRTUAL_SCHEDULES:
            schedule = (*priced, *overrides, f"parallel.schedule={kind}")
            out.append(Variant(f"{name} {kind}", MICRO_BATCHES, recompute, "type:Block", schedule, (1,)))
    out.append(
        Variant(
            "auto time",
            MICRO_BATCHES,
            auto_cfg,
            "balanced",
            (*priced, *auto, "parallel.schedule=auto", "recompute.early=null"),
            (2,),
        )
    )
    flop = ("train.prices=analytic", *auto, *SCHEDULES["1f1b"])
    out.append(Variant("auto flop", MICRO_BATCHES, auto_cfg, "parameters", flop, (2,)))
    return out


def measure_profile(path: Path, smoke: bool) -> None:
    """The device profile the runs are priced by: two processes at once, one thread each, as the runs' ranks."""
    command = [sys.executable, "-m", "parallel.measurement.device_profile", "--threads", "1", "--ranks", "2"]
    command += ["--out", str(path), *(["--quick"] if smoke else [])]
    subprocess.run(command, cwd=REPO, env=launch_env(), check=True)


def dry_run_prediction(cfg: GPTConfig, variant: Variant, scratch: Path) -> tuple[float, list] | str:
    """The variant's dry run (`train.py ... dry_run=true`, no launcher, one thread as a rank has): its
    predicted_step_time_s and each stage's choices, or the start-up's refusal (a budget the schedule cannot fit)."""
    plan = dry_run_plan(cfg, variant, scratch / variant.name.replace(" ", "-").replace("(", "").replace(")", ""))
    if isinstance(plan, str):
        return plan
    return RunPlan.from_json(plan).predicted_step_time_s, [stage["choices"] for stage in plan["stages"]]


def kept_results(root: Path, shapes: dict[str, GPTConfig], todo: dict[str, list[Variant]]) -> dict[str, list[Result]]:
    """The results of the runs under `root` (rounds as its folders; a run that did not finish is left out; launch
    wall and CPU seconds are not kept: nan, printed as `-`; run_rounds prints them as each run ends)."""
    results: dict[str, list[Result]] = {shape: [] for shape in shapes}
    for shape in shapes:
        for k in range(len(list(root.glob(f"{shape}-round*")))):
            for variant in todo[shape]:
                run_dir = run_dir_of(root / f"{shape}-round{k + 1}", 0, variant)
                if (run_dir / "summary.json").is_file():
                    results[shape].append(read_result(variant, k, run_dir, math.nan, math.nan))
    return results


def _pct(predicted: float | None, measured: float) -> str:
    return "-" if predicted is None else f"{100 * (predicted - measured) / measured:+.1f}%"


def figure_1(results: dict[str, list[Result]], repriced: dict[tuple[str, str], tuple[float, list]], how: str) -> None:
    """`repriced`: (shape, variant) -> the dry run's prediction under `how` (train.prices) and its stages' choices; one
    whose plan is not the run's own (auto's choice under other prices) is shown and not counted."""
    print("## Figure 1: the dry run's prediction against the measured median step\n")
    print(
        "| shape | variant | layout blocks | measured median s | predicted s | error | repriced s | error "
        "| trace replay s | error | bubble per stage | wall s/launch | CPU s/launch |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    within, within_again, total = 0, 0, 0
    errors, errors_again = [], []
    for shape, shape_results in results.items():
        for name in dict.fromkeys(r.variant.name for r in shape_results if 1 in r.variant.figures):
            rs = [r for r in shape_results if r.variant.name == name]
            measured = statistics.median(r.median_step_s for r in rs)
            predicted = statistics.median(r.summary["predicted_step_time_s"] for r in rs)
            traced = [
                simulate_stages(traced_costs(r.summary), MICRO_BATCHES).step_time_s
                for r in rs
                if "trace_costs" in r.summary and not r.summary["virtual"]  # a virtual rank's costs mix its chunks
            ]
            replay = statistics.median(traced) if traced else None
            blocks = "/".join(str(len(s["choices"])) for s in rs[-1].summary["layout"])
            bubbles = ", ".join(f"{b:.2f}" for b in rs[-1].summary.get("bubble_fraction_per_stage", []))
            wall, cpu = (statistics.median(getattr(r, k) for r in rs) for k in ("launch_wall_s", "launch_cpu_s"))
            again, choices = repriced.get((shape, name), (None, None))
            other_plan = again is not None and choices != [s["choices"] for s in rs[-1].summary["layout"]]
            within += abs(predicted - measured) <= 0.10 * measured
            errors.append(abs(predicted - measured) / measured)
            if again is not None and not other_plan:
                within_again += abs(again - measured) <= 0.10 * measured
                errors_again.append(abs(again - measured) / measured)
            total += 1
            print(
                f"| {shape} | {name} | {blocks} | {measured:.3f} | {predicted:.3f} | {_pct(predicted, measured)} "
                f"| {'-' if again is None else f'{again:.3f}'}{' (another plan)' if other_plan else ''} "
                f"| {_pct(again, measured)} "
                f"| {'-' if replay is None else f'{replay:.3f}'} | {_pct(replay, measured)} | {bubbles} "
                f"| {'-' if math.isnan(wall) else f'{wall:.0f}'} | {'-' if math.isnan(cpu) else f'{cpu:.0f}'} |"
            )
    if not total:
        print("\nno run of this figure (--only left them out)\n")
        return
    print(
        f"\nwithin 10%: {within} of {total} (the runs' own prediction), mean absolute error "
        f"{100 * statistics.mean(errors):.1f}%"
    )
    if errors_again:
        print(
            f"repriced (train.prices={how}): {within_again} of {len(errors_again)} within 10% (runs whose repriced "
            f"plan is their own), mean absolute error {100 * statistics.mean(errors_again):.1f}%"
        )
    print()


def figure_2(results: dict[str, list[Result]], rounds: int) -> None:
    print("## Figure 2: time-objective auto against FLOP-objective auto (tokens/s)\n")
    print("| shape | round | auto time | auto flop | ratio | auto time layout | auto flop layout |")
    print("|---|---|---|---|---|---|---|")
    for shape, rs in results.items():
        if not {"auto time", "auto flop"} <= {r.variant.name for r in rs}:
            continue
        ratios = []
        for k in range(rounds):
            by_name = {r.variant.name: r for r in rs if r.round == k}
            time_run, flop_run = by_name["auto time"], by_name["auto flop"]
            ratios.append(time_run.tokens_per_s / flop_run.tokens_per_s)
            layouts = [" | ".join(",".join(s["choices"]) for s in r.summary["layout"]) for r in (time_run, flop_run)]
            print(
                f"| {shape} | {k + 1} | {time_run.tokens_per_s:.0f} | {flop_run.tokens_per_s:.0f} | {ratios[-1]:.3f} "
                f"| {layouts[0]} | {layouts[1]} |"
            )
        print(f"| {shape} | median | | | {statistics.median(ratios):.3f} | | |")
    print("\ntarget: >= 1.05\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--profile", type=Path, help="a device profile of this machine (1 thread); default: measure")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument(
        "--prices", choices=("measured", "curves"), default="measured", help="train.prices of the priced runs"
    )
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--smoke", action="store_true", help="2 blocks, n_embd 64, seq 64, a quick profile, 3 steps")
    parser.add_argument("--keep", type=Path, help="keep the run directories under this directory")
    parser.add_argument("--shapes", nargs="+", choices=tuple(SHAPES), default=tuple(SHAPES))
    parser.add_argument("--only", nargs="+", help="run only the variants whose name starts with one of these")
    parser.add_argument("--from", dest="kept", type=Path, help="read the runs of an earlier --keep DIR: no launch")
    parser.add_argument(
        "--reprice", type=Path, help="also dry-run every variant with this profile (e.g. one measured after the runs)"
    )
    parser.add_argument(
        "--reprice-with",
        choices=("curves", "corrected"),
        default="curves",
        help="train.prices of --reprice's dry runs: the profile's curves, or those curves corrected by the other "
        "shapes measured on this device (each shape held out of its own correction)",
    )
    args = parser.parse_args()
    rounds, steps = (1, 3) if args.smoke else (args.rounds, args.steps)
    if steps < TRACE_STEP:
        raise SystemExit(f"--steps={steps}: at least {TRACE_STEP} (the traced step)")
    torch.set_num_threads(1)
    shapes = SMOKE if args.smoke else {name: SHAPES[name] for name in args.shapes}
    with tempfile.TemporaryDirectory(prefix="step_time_bench-") as tmp:
        root = args.keep or Path(tmp)
        profile = args.profile or root / "device_profile.json"
        if args.profile is None and args.kept is None:
            measure_profile(profile, args.smoke)
        todo = {}
        for shape, cfg in shapes.items():
            budget = budget_between_full_and_selective(cfg)
            todo[shape] = [
                v
                for v in variants(budget / GIB, profile, args.prices)
                if not args.only or v.name.startswith(tuple(args.only))
            ]
            print(
                f"shape {shape}: L={cfg.n_layer} h={cfg.n_embd} a={cfg.n_head} s={cfg.seq_len} b=1 "
                f"dropout={cfg.dropout} {cfg.attention} attention, {MICRO_BATCHES} micro-batches; auto budget "
                f"{budget / MIB:.2f} MiB; {len(todo[shape])} variants",
                flush=True,
            )
        print(
            f"torch {torch.__version__}; {STAGES} ranks on CPU, one thread each; profile {profile}; {rounds} rounds",
            flush=True,
        )
        for shape, cfg in shapes.items() if not args.kept else ():  # what start-up refuses is said and left out
            for variant in list(todo[shape]):
                planned = dry_run_prediction(cfg, variant, root / "planned" / shape)
                if isinstance(planned, str):
                    print(f"shape {shape} {variant.name}: refused at start-up: {planned}", flush=True)
                    todo[shape].remove(variant)
        if not args.kept:
            for k in range(rounds):
                for shape, cfg in shapes.items():
                    folder = root / f"{shape}-round{k + 1}"
                    # runs an earlier invocation with this --keep finished are kept, not repeated
                    left = [v for v in todo[shape] if not (run_dir_of(folder, 0, v) / "summary.json").is_file()]
                    run_rounds(cfg, left, 1, steps, folder)
        results = kept_results(args.kept or root, shapes, todo)
        repriced = {}
        if args.reprice:
            for shape, cfg in shapes.items():
                budget = budget_between_full_and_selective(cfg)
                for variant in variants(budget / GIB, args.reprice, args.reprice_with):
                    if variant.name in {r.variant.name for r in results[shape]}:
                        predicted = dry_run_prediction(cfg, variant, root / f"repriced-{args.reprice_with}" / shape)
                        if not isinstance(predicted, str):
                            repriced[shape, variant.name] = predicted
    print()
    figure_1(results, repriced, args.reprice_with)
    figure_2(results, rounds)


if __name__ == "__main__":
    main()
