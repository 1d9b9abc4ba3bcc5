"""`auto` with per-micro-batch recompute against `auto` without it, side by side: real 2-rank training runs.

    DS_ACCELERATOR=cpu .venv/bin/python -m bench.micro_batch_bench [--rounds R] [--steps S]

A GPT whose attention scores dominate a block's bytes (2 blocks, h=64, s=512, 4 heads, dropout on: the CPU's SDPA
math path keeps the scores, their dropout mask and output) on 2 stages with 4 micro-batches: stage 0 holds 2 in
flight, stage 1 one. The budget is the one, in a scan from the least any plan needs to what `none` needs, where the
planner (analytic costs, as the runs plan) predicts the largest gain of `recompute.per_micro_batch=true`; the two
plans differ there, and both are printed. Each round runs both (`deepspeed --num_gpus 2 train.py`, one thread per
rank; the order alternates between rounds); tokens/s = tokens per step / the run's median step time after warm-up.
The figure: medians over rounds side by side, and the per-round ratio; beside it the CPU seconds per step of
both ranks (a launch of S steps minus one of S/3, over the steps between: start-up cancels, and time spent
waiting for a busy machine's cores does not count). The run's own metered bytes per micro-batch are printed
against the plan's. Not a test: timings depend on the machine.
"""

import argparse
import json
import resource
import statistics
import subprocess
import tempfile
from pathlib import Path

from bench.real_runs import DEEPSPEED, REPO, SKIPPED_STEPS, free_port, launch_env
from model import GPTConfig
from parallel.planning.config import AutoRecompute, NoRecompute
from parallel.planning.layout import build_layout
from parallel.planning.run_plan import plan_run
from parallel.planning.shapes import GIB, MIB, RunShape, Target, Topology

MODEL = GPTConfig(n_layer=2, n_head=4, n_embd=64, seq_len=512, vocab_size=256, dropout=0.1)
RUN = RunShape(Topology(2, 1), Target("cpu", "fp32"), micro_batches=4, micro_batch_size=1)
PARTITION = "balanced"
SCAN_POINTS = 200


def auto(budget_gb: float, per_micro_batch: bool) -> AutoRecompute:
    return AutoRecompute(budget_gb=budget_gb, reserve_gb=0.0, per_micro_batch=per_micro_batch)


def predicted_step_s(budget_gb: float, per_micro_batch: bool) -> float | None:
    try:
        layout = build_layout(MODEL, auto(budget_gb, per_micro_batch), RUN, PARTITION, 0)
    except ValueError:  # the budget fits no plan
        return None
    return plan_run(MODEL, auto(budget_gb, per_micro_batch), layout, RUN).predicted_step_time_s


def best_budget() -> float:
    """The scanned budget with the largest predicted ratio (without / with per-micro-batch recompute)."""
    none = plan_run(MODEL, NoRecompute(), build_layout(MODEL, NoRecompute(), RUN, PARTITION, 0), RUN)
    none_gb = max(s.predicted_peak_bytes for s in none.stages) / GIB
    best, best_ratio = None, 0.0
    for i in range(1, SCAN_POINTS + 1):
        budget = none_gb * i / SCAN_POINTS
        without, with_k = predicted_step_s(budget, False), predicted_step_s(budget, True)
        if without is not None and without / with_k > best_ratio:
            best, best_ratio = budget, without / with_k
    return best


def describe(budget_gb: float, per_micro_batch: bool) -> list[str]:
    recompute = auto(budget_gb, per_micro_batch)
    layout = build_layout(MODEL, recompute, RUN, PARTITION, 0)
    plan = plan_run(MODEL, recompute, layout, RUN)
    return (
        layout.describe()
        + layout.describe_budgets(recompute)[1:]
        + [f"predicted step {plan.predicted_step_time_s:.4g} s"]
    )


def launch(budget_gb: float, per_micro_batch: bool, steps: int, run_dir: Path) -> tuple[dict, float]:
    """One real 2-rank training run: its summary with the median step time after warm-up, and the CPU seconds
    of the whole launch (both ranks and the launcher)."""
    model = [
        f"model.{k}={getattr(MODEL, k)}" for k in ("n_layer", "n_head", "n_embd", "seq_len", "vocab_size", "dropout")
    ]
    cmd = [str(DEEPSPEED), "--num_gpus", "2", "--master_port", str(free_port()), "train.py"]
    cmd += [f"hydra.run.dir={run_dir}", "data=synthetic", "logger=none", "train.device=cpu", "train.precision=fp32"]
    cmd += model + [f"train.steps={steps}", f"train.micro_batches={RUN.micro_batches}", "train.micro_batch_size=1"]
    cmd += ["train.trace_step=0", "train.save_every=0", f"parallel.partition_method={PARTITION}", "+recompute=auto"]
    cmd += [
        f"recompute.budget_gb={budget_gb!r}",
        "recompute.reserve_gb=0",
        f"recompute.per_micro_batch={per_micro_batch}",
    ]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    result = subprocess.run(cmd, cwd=REPO, env=launch_env(), capture_output=True, text=True, timeout=900)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if result.returncode != 0:
        raise SystemExit(
            f"{' '.join(cmd)} exited {result.returncode}\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
        )
    summary = json.loads((run_dir / "summary.json").read_text())
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    summary["median_step_s"] = statistics.median(r["step_time_s"] for r in records if r["step"] > SKIPPED_STEPS)
    return summary, (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()
    short_steps = max(SKIPPED_STEPS + 1, args.steps // 3)
    budget = best_budget()
    print(f"budget {budget:.6g} GiB ({budget * GIB / MIB:.2f} MiB), reserve 0, {RUN.micro_batches} micro-batches")
    for per_micro_batch in (False, True):
        print(f"plan, recompute.per_micro_batch={str(per_micro_batch).lower()}:")
        print("\n".join("  " + line for line in describe(budget, per_micro_batch)))
    tokens = RUN.tokens_per_step(MODEL.seq_len)
    rates: dict[bool, list[float]] = {False: [], True: []}
    cpu: dict[bool, list[float]] = {False: [], True: []}
    last: dict[bool, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for round_ in range(args.rounds):
            order = (False, True) if round_ % 2 == 0 else (True, False)
            for per_micro_batch in order:
                run_dir = Path(tmp) / f"{round_}-{per_micro_batch}"
                summary, long_cpu = launch(budget, per_micro_batch, args.steps, run_dir)
                _, short_cpu = launch(budget, per_micro_batch, short_steps, run_dir.with_name(run_dir.name + "-short"))
                rates[per_micro_batch].append(tokens / summary["median_step_s"])
                cpu[per_micro_batch].append((long_cpu - short_cpu) / (args.steps - short_steps))
                last[per_micro_batch] = summary
            print(
                f"round {round_}: tokens/s without {rates[False][-1]:,.0f} | with {rates[True][-1]:,.0f} | ratio "
                f"{rates[True][-1] / rates[False][-1]:.3f} || CPU s/step without {cpu[False][-1]:.4f} | with "
                f"{cpu[True][-1]:.4f} | ratio {cpu[False][-1] / cpu[True][-1]:.3f}",
                flush=True,
            )
    print("| auto | tokens/s (median of rounds) | ratio | CPU s per step, both ranks (median) | ratio |")
    print("|---|---|---|---|---|")
    for per_micro_batch, name in ((False, "without per-micro-batch recompute"), (True, "with (per_micro_batch=true)")):
        rate, seconds = statistics.median(rates[per_micro_batch]), statistics.median(cpu[per_micro_batch])
        print(
            f"| {name} | {rate:,.0f} | {rate / statistics.median(rates[False]):.3f} | {seconds:.4f} | "
            f"{statistics.median(cpu[False]) / seconds:.3f} |"
        )
    ratios = [w / wo for w, wo in zip(rates[True], rates[False])]
    print(
        f"per-round tokens/s ratio with / without: median {statistics.median(ratios):.3f}, min {min(ratios):.3f}, "
        f"max {max(ratios):.3f}"
    )
    for per_micro_batch in (False, True):
        s = last[per_micro_batch]
        print(
            f"metered bytes per micro-batch, per_micro_batch={str(per_micro_batch).lower()}: "
            f"{s['activation_bytes_per_micro_batch_per_stage']} (planned "
            f"{s['planned_activation_bytes_per_micro_batch_per_stage']}), predicted peak per stage "
            f"{[round(b / MIB, 3) for b in s['predicted_peak_bytes_per_stage']]} MiB"
        )


if __name__ == "__main__":
    main()
