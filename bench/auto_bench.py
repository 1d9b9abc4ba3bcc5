"""Auto recompute against uniform full and selective, side by side, at a budget between them.

    DS_ACCELERATOR=cpu .venv/bin/python -m bench.auto_bench

2 stages, 6 micro-batches (stage 0 holds 2 in flight, stage 1 one). The budget is three quarters of the
way from what uniform full recompute needs on stage 0 to what uniform selective needs there. Every plan
runs all its stages in one process (parallel/measurement/local_stages.py, the pipeline's own StagePlan code);
steps are interleaved (full, auto, selective, none, full, ...) and timed as process CPU time on one
thread, so other processes on a shared machine do not count. "Measured peak" = the planner's parameter,
gradient, optimizer and pipe-buffer bytes + in-flight x the activation bytes the meter measured + the
largest segment's recompute working set. Not a test: timings depend on the machine.
"""

import argparse
import statistics
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

import torch

from model import GPTConfig
from parallel.measurement.device_profile import measure_to
from parallel.measurement.local_stages import LocalPipeline
from parallel.planning.config import AutoRecompute, FullRecompute, NoRecompute, SelectiveRecompute
from parallel.planning.curve_seconds import profile_prices, profile_seconds
from parallel.planning.layout import build_layout
from parallel.planning.run_plan import plan_run
from parallel.planning.shapes import GIB, MIB, RunShape, Shape, Target, Topology

STAGES, MICRO_BATCHES = 2, 6


class Plan:
    def __init__(self, name: str, cfg: GPTConfig, recompute, run: RunShape, costs=None):
        self.name = name
        self.layout = build_layout(cfg, recompute, run, "type:Block", 0, costs)
        self.plan = plan_run(cfg, recompute, self.layout, run)
        self.pipe = LocalPipeline(self.layout, "fp32")

    def measured_peak(self, batches) -> list[int]:
        """Per stage: the predicted peak with its planned activations (bytes per micro-batch x in flight) replaced by
        the ones the stage's meter measures."""
        for stage in self.pipe.stages:
            stage.meter.reset()
        self.pipe.step(batches[:1], measure=True)
        self.zero_grad()
        peaks = []
        for i, stage in enumerate(self.pipe.stages):
            s = self.plan.stages[i]
            measured = stage.meter.bytes_per_micro_batch()[0]
            in_flight = s.in_flight_microbatches
            peaks.append(s.predicted_peak_bytes + in_flight * (measured - s.activation_bytes_per_microbatch))
        return peaks

    def zero_grad(self) -> None:
        for p in self.pipe.parameters():
            p.grad = None

    def step_cpu_seconds(self, batches) -> float:
        start = time.process_time()
        self.pipe.step(batches)
        self.zero_grad()
        return time.process_time() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--micro-batch-size", type=int, default=1)
    parser.add_argument("--dropout", type=float, default=0.1)
    parser.add_argument("--reps", type=int, default=7)
    args = parser.parse_args()
    torch.set_num_threads(1)
    cfg = GPTConfig(
        n_layer=args.layers,
        n_head=8,
        n_embd=256,
        seq_len=args.seq_len,
        vocab_size=256,
        dropout=args.dropout,
        attention="math",
    )
    target = Target("cpu", "fp32")
    run = RunShape(Topology(STAGES), target, micro_batches=MICRO_BATCHES, micro_batch_size=args.micro_batch_size)
    shape = Shape.of(cfg, args.micro_batch_size)

    full = Plan("full(1)", cfg, FullRecompute(interval="1"), run)
    selective = Plan("selective", cfg, SelectiveRecompute(), run)
    need_full, need_sel = (p.plan.stages[0].predicted_peak_bytes for p in (full, selective))
    budget = need_full + 0.75 * (need_sel - need_full)
    auto_cfg = AutoRecompute(budget_gb=budget / GIB, reserve_gb=0.0)
    with tempfile.TemporaryDirectory() as tmp:  # this process's device profile (one thread, no links)
        profile = measure_to(Path(tmp) / "profile.json", "cpu", "fp32", links=False)
    plans = [
        full,
        Plan("auto", cfg, auto_cfg, run),
        Plan("auto(profiled)", cfg, auto_cfg, run, profile_prices(profile, shape, target)),
        selective,
        Plan("none", cfg, NoRecompute(), run),
    ]

    g = torch.Generator().manual_seed(0)
    batches = [
        (
            torch.randint(0, 256, (args.micro_batch_size, cfg.seq_len), generator=g),
            torch.randint(0, 256, (args.micro_batch_size, cfg.seq_len), generator=g),
        )
        for _ in range(MICRO_BATCHES)
    ]
    for plan in plans:
        plan.step_cpu_seconds(batches)  # warm-up
    times = {plan.name: [] for plan in plans}
    for _ in range(args.reps):  # interleaved: every plan sees the same machine state
        for plan in plans:
            times[plan.name].append(plan.step_cpu_seconds(batches))
    tokens = MICRO_BATCHES * args.micro_batch_size * cfg.seq_len
    full_tps = [tokens / t for t in times["full(1)"]]

    print(
        f"torch {torch.__version__}; L={cfg.n_layer} h=256 a=8 s={cfg.seq_len} b={args.micro_batch_size} "
        f"dropout={cfg.dropout} fp32 math attention; {STAGES} stages, {MICRO_BATCHES} micro-batches; "
        f"{args.reps} interleaved repetitions, CPU time on 1 thread"
    )
    print(
        f"stage 0 needs: uniform full(1) {need_full / MIB:.2f} MiB, uniform selective {need_sel / MIB:.2f} MiB "
        f"-> budget {budget / MIB:.2f} MiB (recompute.budget_gb={budget / GIB:.6f})"
    )
    seconds = {k: v for k, v in asdict(profile_seconds(profile, shape, target)).items() if v is not None}
    print("device profile priced (s per micro-batch): " + ", ".join(f"{k} {v:.4g}" for k, v in seconds.items()))
    print()
    print(
        "| plan | stage 0 choices | stage 1 choices | measured peak MiB (s0, s1) | fits | tokens/s (median) "
        "| / full(1): min, median, max |"
    )
    print("|---|---|---|---|---|---|---|")
    for plan in plans:
        peaks = plan.measured_peak(batches)
        tps = [tokens / t for t in times[plan.name]]
        ratios = sorted(a / b for a, b in zip(tps, full_tps))  # same repetition: same machine state
        choices = [",".join(sorted(set(st["choices"]))) for st in plan.layout.as_dict()]
        fits = "yes" if max(peaks) <= budget else "no"
        print(
            f"| {plan.name} | {choices[0]} | {choices[1]} | {peaks[0] / MIB:.2f}, {peaks[1] / MIB:.2f} | {fits} | "
            f"{statistics.median(tps):.0f} | {ratios[0]:.3f}, {statistics.median(ratios):.3f}, {ratios[-1]:.3f} |"
        )


if __name__ == "__main__":
    main()
