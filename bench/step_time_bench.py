"""Predicted against measured pipeline step time, and plans against time: real 2-rank training runs.

    DS_ACCELERATOR=cpu .venv/bin/python -m bench.step_time_bench [--rounds R] [--steps S] [--smoke]

Every variant is a real `deepspeed --num_gpus 2 train.py` run on CPU (gloo, one thread per rank), read back
from its summary.json, metrics.jsonl and traced step. Variants are interleaved in rounds (every variant once
per round), so a ratio within one round compares runs that saw the same machine state (bench/real_runs.py).

- Figure 1: the simulator's predicted step time against the measured median, for none, selective,
  full(interval=1), full(interval=stage) and auto, at 4 and 8 micro-batches, with measured costs.
- Figure 2: at a budget between uniform full and selective (3/4 of the way from full(1)'s stage-0 need to
  selective's, as bench/auto_bench.py), the time-planned auto (balanced partition, profiled costs) against
  uniform full and today's auto (parameters partition, analytic costs): tokens/s ratios per round.
- Figure 3: the plans the time objective and the FLOP objective choose, and which ran faster.

Not a test: timings depend on the machine. docs/step_time_benchmark.md explains the figures.
"""

import argparse
import json
import statistics
import tempfile
from pathlib import Path

import torch

from bench.real_runs import STAGES, TRACE_STEP, Result, Variant, model_config, run_rounds, traced_costs
from model import GPTConfig
from parallel.measurement.recompute_profile import profile_block
from parallel.planning.auto_recompute import measured_costs
from parallel.planning.config import AutoRecompute, FullRecompute, NoRecompute, SelectiveRecompute
from parallel.planning.layout import build_layout
from parallel.planning.run_plan import plan_run
from parallel.planning.shapes import GIB, MIB, RunShape, Shape, Target, Topology
from parallel.planning.step_sim import simulate_stages

SEED, TARGET = 1234, Target("cpu", "fp32")
BUDGET_MICRO_BATCHES = 8


def run_shape(micro_batches: int) -> RunShape:
    return RunShape(Topology(STAGES), TARGET, micro_batches=micro_batches, micro_batch_size=1)


def budget_between_full_and_selective(cfg: GPTConfig) -> tuple[float, float, float]:
    """(budget, full(1)'s stage-0 need, selective's) in bytes, from the planner, as bench/auto_bench.py."""
    run = run_shape(BUDGET_MICRO_BATCHES)
    needs = []
    for recompute in (FullRecompute(interval="1"), SelectiveRecompute()):
        layout = build_layout(cfg, recompute, run, "type:Block", SEED)
        needs.append(plan_run(cfg, recompute, layout, run).stages[0].predicted_peak_bytes)
    need_full, need_sel = needs
    return need_full + 0.75 * (need_sel - need_full), need_full, need_sel


def variants(budget_gb: float) -> list[Variant]:
    def auto(profile: bool) -> tuple[str, ...]:
        return (
            "+recompute=auto",
            f"recompute.budget_gb={budget_gb:.9f}",
            "recompute.reserve_gb=0",
            f"recompute.profile={str(profile).lower()}",
        )

    auto_cfg = AutoRecompute(budget_gb=budget_gb, reserve_gb=0.0)
    out = []
    for m in (4, 8):
        fig2 = (2,) if m == BUDGET_MICRO_BATCHES else ()
        out += [
            Variant(f"none m{m}", m, NoRecompute(), "type:Block", ("+recompute=none",), (1,)),
            Variant(f"selective m{m}", m, SelectiveRecompute(), "type:Block", ("+recompute=selective",), (1,)),
            Variant(f"full(1) m{m}", m, FullRecompute(interval="1"), "type:Block", ("+recompute=full",), (1, *fig2)),
            Variant(
                f"full(stage) m{m}",
                m,
                FullRecompute(interval="stage"),
                "type:Block",
                ("+recompute=full", "recompute.interval=stage"),
                (1, *fig2),
            ),
            Variant(f"auto time m{m}", m, auto_cfg, "balanced", auto(True), (1, *fig2, *((3,) if fig2 else ()))),
        ]
    m = BUDGET_MICRO_BATCHES
    out.append(Variant(f"auto flop m{m}", m, auto_cfg, "parameters", auto(False), (2, 3)))
    return out


def trace_replay_s(summary: dict) -> float | None:
    """The traced step's own mean instruction costs replayed through the simulator."""
    if "trace_costs" not in summary:
        return None
    return simulate_stages(traced_costs(summary), summary["micro_batches"]).step_time_s


def profile_replay_s(cfg: GPTConfig, variant: Variant, summary: dict, seconds: dict) -> float | None:
    """The run's layout priced with the bench's own profile (measured once, in this process, one thread):
    the measured-cost prediction for modes where `recompute.profile` does not apply. None when the plan
    rebuilt here differs from the run's (auto plans depend on the costs)."""
    run = run_shape(variant.micro_batches)
    table = measured_costs(Shape.of(cfg, 1), TARGET, seconds)
    layout = build_layout(cfg, variant.recompute, run, variant.partition, SEED, table)
    if layout.as_dict() != summary["layout"]:
        return None
    return plan_run(cfg, variant.recompute, layout, run).predicted_step_time_s


def measured_peak_bytes(result: Result) -> list[int | None]:
    """Per stage: the predicted peak with its planned activations (bytes per micro-batch x in flight) replaced by
    the measured ones (as bench/auto_bench.py)."""
    s = result.summary
    out = []
    for i in range(len(s["layout"])):
        measured = s["peak_activation_bytes_per_stage"][i]
        if measured is None:
            out.append(None)
            continue
        planned = s["planned_activation_bytes_per_stage"][i] * s["in_flight_microbatches_per_stage"][i]
        out.append(s["predicted_peak_bytes_per_stage"][i] - planned + measured)
    return out


def _pct(predicted: float | None, measured: float) -> str:
    return "-" if predicted is None else f"{100 * (predicted - measured) / measured:+.1f}%"


def _s(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def _layout_text(summary: dict) -> str:
    parts = []
    for st in summary["layout"]:
        counts: dict[str, int] = {}
        for c in st["choices"]:
            counts[c] = counts.get(c, 0) + 1
        plan = "+".join(f"{n}x{c}" for c, n in counts.items()) or "no blocks"
        parts.append(f"s{st['stage']} L{st['layers'][0]}..{st['layers'][1] - 1}: {plan}")
    return "; ".join(parts)


def figure_1(results: list[Result]) -> None:
    print("## Figure 1: predicted against measured step time (measured costs)\n")
    print(
        "| variant | costs used | measured median s | run's predicted s | predicted, measured costs s | error "
        "| trace replay s | error | bubble per stage | wall s/launch | CPU s/launch |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for name in dict.fromkeys(r.variant.name for r in results if 1 in r.variant.figures):
        rs = [r for r in results if r.variant.name == name]
        measured = statistics.median(r.median_step_s for r in rs)
        own = statistics.median(r.summary["predicted_step_time_s"] for r in rs)
        profiled = rs[0].variant.overrides[-1] == "recompute.profile=true"
        costs = "run's profile" if profiled else "bench profile"
        replays = [r.replayed["profile"] for r in rs if r.replayed["profile"] is not None]
        predicted = own if profiled else (statistics.median(replays) if replays else None)
        traced = statistics.median(r.replayed["trace"] for r in rs if r.replayed["trace"] is not None)
        wall, cpu = (statistics.median(getattr(r, k) for r in rs) for k in ("launch_wall_s", "launch_cpu_s"))
        bubbles = ", ".join(f"{b:.2f}" for b in rs[-1].summary.get("bubble_fraction_per_stage", []))
        print(
            f"| {name} | {costs} | {measured:.3f} | {own:.3f} | {_s(predicted)} | {_pct(predicted, measured)} "
            f"| {traced:.3f} | {_pct(traced, measured)} | {bubbles} | {wall:.0f} | {cpu:.0f} |"
        )
    print(
        "\nmeasured median: steps after the first two (the traced step 3 included), median over rounds; "
        "`run's predicted` is summary.json predicted_step_time_s (auto with recompute.profile=true: the run's "
        "measured costs; other modes: analytic, recompute.profile exists only for auto); wall and CPU time "
        "are of the whole launch (start-up included): per-step CPU time is not logged.\n"
    )


def figure_2(results: list[Result], budget: float, rounds: int) -> None:
    print(f"## Figure 2: plans against time at budget {budget / MIB:.2f} MiB per rank\n")
    names = [n for n in dict.fromkeys(r.variant.name for r in results if 2 in r.variant.figures)]
    time_name = next(n for n in names if n.startswith("auto time"))
    print("| variant | partition | layout | tokens/s (median) | measured peak MiB per stage | fits |")
    print("|---|---|---|---|---|---|")
    for name in names:
        rs = [r for r in results if r.variant.name == name]
        peaks = measured_peak_bytes(rs[-1])
        fits = "yes" if all(p is not None and p <= budget for p in peaks) else "no"
        text = ", ".join("-" if p is None else f"{p / MIB:.2f}" for p in peaks)
        tps = statistics.median(r.tokens_per_s for r in rs)
        print(f"| {name} | {rs[0].variant.partition} | {_layout_text(rs[-1].summary)} | {tps:.0f} | {text} | {fits} |")
    print(f"\n| round | {' | '.join(f'{time_name} / {n}' for n in names if n != time_name)} |")
    print("|---|" + "---|" * (len(names) - 1))
    ratios: dict[str, list[float]] = {n: [] for n in names if n != time_name}
    for k in range(rounds):
        by_name = {r.variant.name: r for r in results if r.round == k}
        row = []
        for n in ratios:
            ratios[n].append(by_name[time_name].tokens_per_s / by_name[n].tokens_per_s)
            row.append(f"{ratios[n][-1]:.3f}")
        print(f"| {k + 1} | {' | '.join(row)} |")
    print(f"| median | {' | '.join(f'{statistics.median(v):.3f}' for v in ratios.values())} |")
    print(
        "\ntargets: >= 1.10 against uniform full, >= 1.05 against today's auto (auto flop); the auto plans must fit "
        "the budget (uniform full's fit is shown for reference: the budget is taken from stage 0's need).\n"
    )


def figure_3(results: list[Result]) -> None:
    print("## Figure 3: the time objective against the FLOP objective\n")
    names = [n for n in dict.fromkeys(r.variant.name for r in results if 3 in r.variant.figures)]
    rs = {n: [r for r in results if r.variant.name == n] for n in names}
    layouts = {n: rs[n][-1].summary["layout"] for n in names}
    differ = len({json.dumps(v) for v in layouts.values()}) > 1
    for n in names:
        step = statistics.median(r.median_step_s for r in rs[n])
        print(f"- {n}: {_layout_text(rs[n][-1].summary)}; median step {step:.3f} s")
    if differ:
        fastest = min(names, key=lambda n: statistics.median(r.median_step_s for r in rs[n]))
        print(f"\nThe plans differ; {fastest} measured faster.\n")
    else:
        print("\nThe two objectives chose the same plan at this shape.\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--smoke", action="store_true", help="2 blocks, n_embd 64, seq 64, 1 round, 3 steps")
    parser.add_argument("--keep", type=Path, help="keep the run directories under this directory")
    args = parser.parse_args()
    rounds, steps = (1, 3) if args.smoke else (args.rounds, args.steps)
    if steps < TRACE_STEP:
        raise SystemExit(f"--steps={steps}: at least {TRACE_STEP} (the traced step)")
    torch.set_num_threads(1)
    cfg = model_config(args.smoke)
    budget, need_full, need_sel = budget_between_full_and_selective(cfg)
    seconds = profile_block(cfg, 1, "cpu", "fp32")
    todo = variants(budget / GIB)
    print(
        f"torch {torch.__version__}; L={cfg.n_layer} h={cfg.n_embd} a={cfg.n_head} s={cfg.seq_len} b=1 "
        f"dropout={cfg.dropout} fp32 math attention; {STAGES} ranks on CPU, OMP_NUM_THREADS=1 each; "
        f"{rounds} interleaved rounds of {len(todo)} runs, {steps} steps each"
    )
    print(
        f"stage 0 needs at {BUDGET_MICRO_BATCHES} micro-batches: uniform full(1) {need_full / MIB:.2f} MiB, "
        f"uniform selective {need_sel / MIB:.2f} MiB -> budget {budget / MIB:.2f} MiB "
        f"(recompute.budget_gb={budget / GIB:.9f}, reserve_gb=0)"
    )
    print("bench profile (s per micro-batch): " + ", ".join(f"{k} {v:.4g}" for k, v in seconds.items()) + "\n")
    with tempfile.TemporaryDirectory(prefix="step_time_bench-") as tmp:
        results = run_rounds(cfg, todo, rounds, steps, args.keep or Path(tmp))
    for result in results:
        result.replayed = {
            "trace": trace_replay_s(result.summary),
            "profile": profile_replay_s(cfg, result.variant, result.summary, seconds),
        }
    print()
    figure_1(results)
    figure_2(results, budget, rounds)
    figure_3(results)


if __name__ == "__main__":
    main()
