"""Recompute modes side by side: measured vs planned activation bytes per stage, step time, FLOPs.

    DS_ACCELERATOR=cpu .venv/bin/python -m bench.recompute_bench

Runs every stage of a 2-stage layout in one process (parallel/measurement/local_stages.py: the same StagePlan and
run_stage code as the DeepSpeed pipeline, with the engine's clone of the stage input), so all modes are
timed interleaved in one run on the same machine state. Time is the process CPU time of a step on one
intra-op thread (default): on a shared machine it leaves out the time other processes hold the cores,
which wall-clock time does not; the minimum over the repetitions is reported, with the wall-clock median
beside it. Prints markdown tables. Not a test: timings depend on the machine; docs/recompute_benchmark.md
holds a run.
"""

import argparse
import platform
from functools import partial

import torch
from torch.utils.flop_counter import FlopCounterMode

from bench.interleaved import interleaved, least_cpu, median_wall
from model import GPTConfig
from parallel.measurement.local_stages import LocalPipeline
from parallel.planning.config import FullRecompute, NoRecompute, SelectiveRecompute
from parallel.planning.layout import build_layout
from parallel.planning.run_plan import plan_run
from parallel.planning.shapes import MIB, RunShape, Target, Topology

MODES = {
    "none": NoRecompute(),
    "selective": SelectiveRecompute(modules=["core_attn"]),
    "selective+mlp_act+ln": SelectiveRecompute(modules=["core_attn", "mlp_act", "layernorm"]),
    "full(1)": FullRecompute(interval="1"),
    "full(stage)": FullRecompute(interval="stage"),
}
TIMEABLE = {
    **MODES,
    "nested(2)": FullRecompute(interval="2", nested=True),
    "nested(4)": FullRecompute(interval="4", nested=True),
    "nested(stage)": FullRecompute(interval="stage", nested=True),
    "full(1) bf16 stash": FullRecompute(interval="1", compress="bf16"),
    "full(1) fp8 stash": FullRecompute(interval="1", compress="fp8"),
}
"""What `--timed` may name: MODES, and nested checkpoints and compressed stashes (issue 29)."""


def model_config(n_layer: int, seq_len: int, dropout: float, attention: str) -> GPTConfig:
    return GPTConfig(
        n_layer=n_layer, n_head=8, n_embd=256, seq_len=seq_len, vocab_size=256, dropout=dropout, attention=attention
    )


class Mode:
    def __init__(self, cfg: GPTConfig, recompute, micro_batch_size: int, micro_batches: int, precision: str):
        run = RunShape(
            Topology(2), Target("cpu", precision), micro_batches=micro_batches, micro_batch_size=micro_batch_size
        )
        self.layout = build_layout(cfg, recompute, run, "type:Block", seed=0)
        self.pipe = LocalPipeline(self.layout, precision)
        self.plan = plan_run(cfg, recompute, self.layout, run)

    def zero_grad(self) -> None:
        for p in self.pipe.parameters():
            p.grad = None

    def measure(self, batches) -> list[int]:
        for stage in self.pipe.stages:
            stage.meter.reset()
        self.pipe.step(batches[:1], measure=True)
        self.zero_grad()
        return [stage.meter.bytes_per_micro_batch()[0] for stage in self.pipe.stages]

    def planned(self) -> list[int]:
        return [s.activation_bytes_per_microbatch for s in self.plan.stages]

    def step(self, batches) -> None:
        """One training step, its gradients then dropped."""
        self.pipe.step(batches)
        self.zero_grad()

    def counted_flops(self, batches) -> int:
        with FlopCounterMode(display=False) as counter:
            self.pipe.step(batches)
        self.zero_grad()
        return counter.get_total_flops()


def batches_for(cfg: GPTConfig, micro_batch_size: int, micro_batches: int):
    g = torch.Generator().manual_seed(0)
    return [
        (
            torch.randint(0, cfg.vocab_size, (micro_batch_size, cfg.seq_len), generator=g),
            torch.randint(0, cfg.vocab_size, (micro_batch_size, cfg.seq_len), generator=g),
        )
        for _ in range(micro_batches)
    ]


def mib(n: int) -> str:
    return f"{n / MIB:.2f}"


def bytes_table(shapes, dropout: float, attention: str, modes: dict) -> list[str]:
    lines = [
        f"### Activation bytes per micro-batch, per stage (MiB), dropout={dropout}, attention={attention}",
        "",
        "| shape | mode | stage 0 measured | stage 0 planned | stage 1 measured | stage 1 planned | "
        "max error | total / none |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for n_layer, b, s in shapes:
        cfg = model_config(n_layer, s, dropout, attention)
        batches = batches_for(cfg, b, 1)
        none_total = None
        for name, recompute in modes.items():
            mode = Mode(cfg, recompute, b, 1, "fp32")
            measured, planned = mode.measure(batches), mode.planned()
            error = max(abs(m - p) / p for m, p in zip(measured, planned))
            none_total = none_total or sum(measured)
            lines.append(
                f"| L={n_layer} b={b} s={s} | {name} | {mib(measured[0])} | {mib(planned[0])} | "
                f"{mib(measured[1])} | {mib(planned[1])} | {100 * error:.2f}% | "
                f"{sum(measured) / none_total:.3f} |"
            )
            del mode
    return lines


def timing_table(cfg: GPTConfig, b: int, micro_batches: int, reps: int, modes: dict) -> list[str]:
    built = {name: Mode(cfg, recompute, b, micro_batches, "fp32") for name, recompute in modes.items()}
    batches = batches_for(cfg, b, micro_batches)
    seconds = interleaved({name: partial(mode.step, batches) for name, mode in built.items()}, reps)
    cpu, wall = least_cpu(seconds), median_wall(seconds)
    base = cpu["none"]
    full_overhead = cpu["full(1)"] - base
    lines = [
        f"### Step time, dropout={cfg.dropout}, attention={cfg.attention} "
        f"(L={cfg.n_layer} b={b} s={cfg.seq_len}, {micro_batches} micro-batches, {reps} interleaved repetitions)",
        "",
        "| mode | CPU s/step (min) | overhead vs none | overhead / full(1)'s | wall s/step (median) |",
        "|---|---|---|---|---|",
    ]
    for name, t in cpu.items():
        overhead = t - base
        share = overhead / full_overhead if full_overhead > 0 else float("nan")
        lines.append(f"| {name} | {t:.3f} | {100 * overhead / base:+.1f}% | {share:.2f} | {wall[name]:.3f} |")
    return lines


def flops_table(cfg: GPTConfig, b: int, modes: dict) -> list[str]:
    lines = [
        f"### FLOPs per step, dropout={cfg.dropout} (L={cfg.n_layer} b={b} s={cfg.seq_len}, 1 micro-batch), GFLOP",
        "",
        "| mode | model (6(N+hV)+12Lhs) | planner matmul+recompute | FlopCounterMode | hardware / model |",
        "|---|---|---|---|---|",
    ]
    batches = batches_for(cfg, b, 1)
    for name, recompute in modes.items():
        mode = Mode(cfg, recompute, b, 1, "fp32")
        flops = mode.plan.flops
        planned = sum(s.hardware_flops_per_step for s in mode.plan.stages)
        counted = mode.counted_flops(batches)
        lines.append(
            f"| {name} | {flops.model_flops_per_step / 1e9:.2f} | {planned / 1e9:.2f} | "
            f"{counted / 1e9:.2f} | {flops.hardware_over_model:.3f} |"
        )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=8, help="blocks (split over 2 stages)")
    parser.add_argument("--reps", type=int, default=21, help="interleaved timing repetitions")
    parser.add_argument("--micro-batches", type=int, default=1, help="micro-batches per timed step")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--sections", nargs="+", choices=("bytes", "time", "flops"), default=["bytes", "time", "flops"])
    parser.add_argument(
        "--timed", nargs="+", choices=TIMEABLE, default=["none", "selective", "full(1)", "full(stage)"],
        help="the modes of the timing and FLOP tables",
    )  # fmt: skip
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    shapes = [(args.layers, 1, 512), (args.layers, 2, 256), (args.layers // 2, 1, 1024)]
    print(
        f"torch {torch.__version__}, {platform.processor() or platform.machine()}, "
        f"{torch.get_num_threads()} threads; n_embd=256 n_head=8 vocab=256 fp32 2 stages; "
        f"5as/h = {5 * 8 * 512 / 256:.0f} at s=512\n"
    )
    main_off = model_config(args.layers, 512, 0.0, "math")
    main_on = model_config(args.layers, 512, 0.1, "math")
    timed = {k: TIMEABLE[k] for k in args.timed}
    three = {k: MODES[k] for k in ("none", "selective", "full(1)")}
    sections = {
        "bytes": [
            lambda: bytes_table(shapes, 0.1, "math", MODES),
            lambda: bytes_table(shapes[:1], 0.0, "math", MODES),
            lambda: bytes_table(shapes[:1], 0.0, "sdpa", three),
        ],
        "time": [
            lambda: timing_table(main_off, 1, args.micro_batches, args.reps, timed),
            lambda: timing_table(main_on, 1, args.micro_batches, args.reps, timed),
            lambda: timing_table(model_config(args.layers, 512, 0.0, "sdpa"), 1, args.micro_batches, args.reps, three),
        ],
        "flops": [lambda: flops_table(main_on, 1, timed), lambda: flops_table(main_off, 1, timed)],
    }
    for name in args.sections:
        for table in sections[name]:
            print("\n".join(table() + [""]), flush=True)


if __name__ == "__main__":
    main()
