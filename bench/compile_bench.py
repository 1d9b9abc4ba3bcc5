"""train.compile against eager, per recompute mode: what compiling cost, tokens/s, and the activation bytes each keeps.

    DS_ACCELERATOR=cpu .venv/bin/python -m bench.compile_bench              # the issue's probe shape, one thread
    DS_ACCELERATOR=cpu .venv/bin/python -m bench.compile_bench --n-layer 2 --seq-len 128 --steps 3   # a quick look

Every stage of a 2-stage layout runs in this process (parallel/measurement/local_stages.py), eager and with each
block compiled (parallel/runtime/compile_blocks.py), for each mode train.compile accepts. Dynamo forgets what it
compiled before each compiled pipeline, so each pays its own compile (inductor's on-disk cache, TORCHINDUCTOR_CACHE_DIR,
may still serve kernels it built earlier: point it at an empty directory for a cold figure). Compile is the first
step's wall-clock time less the eager first step's; tokens/s is the median of the later steps' wall-clock. The
activation bytes are each stage's saved tensors for one micro-batch (the activation meter's, which sees what a
compiled block's graph saves), eager's layout eager and compiled, then the layout planned from a compiled block measured
at this shape (parallel/measurement/compiled_bytes.py, after the timed steps, so its compiles warm no timed cache):
its compiled stages' metered bytes beside the plan's.
Not a test; time it on a quiet machine: the load average is printed beside the figures.
"""

import argparse
import os
import statistics
import time
from dataclasses import replace

import torch

from model import GPTConfig
from parallel.measurement.compiled_bytes import compiled_options, measure_compiled_blocks
from parallel.measurement.local_stages import LocalPipeline
from parallel.planning.config import FullRecompute, NoRecompute, SelectiveRecompute
from parallel.planning.layout import build_layout
from parallel.planning.run_plan import plan_run
from parallel.planning.shapes import RunShape, Target, Topology

MODES = {
    "none": NoRecompute(),
    "full(1)": FullRecompute(interval="1"),
    "selective core_attn": SelectiveRecompute(modules=["core_attn"]),
    "selective mlp_act": SelectiveRecompute(modules=["mlp_act"]),
    "selective core_attn+mlp": SelectiveRecompute(modules=["core_attn", "mlp"]),
}


def timed_steps(pipe: LocalPipeline, batches, steps: int) -> list[float]:
    seconds = []
    for _ in range(steps):
        start = time.perf_counter()
        pipe.step(batches)
        seconds.append(time.perf_counter() - start)
        for p in pipe.parameters():
            p.grad = None
    return seconds


def activation_bytes(pipe: LocalPipeline, batches) -> list[int]:
    for stage in pipe.stages:
        stage.meter.reset()
    pipe.step(batches[:1], measure=True)
    for p in pipe.parameters():
        p.grad = None
    return [stage.meter.bytes_per_micro_batch()[0] for stage in pipe.stages]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--n-layer", type=int, default=4)
    parser.add_argument("--n-embd", type=int, default=256)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--micro-batch-size", type=int, default=2)
    parser.add_argument("--micro-batches", type=int, default=4)
    parser.add_argument("--dropout", type=float, default=0.1)
    parser.add_argument("--steps", type=int, default=6, help="steps timed per pipeline, the first one compiling")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    config = GPTConfig(
        n_layer=args.n_layer, n_head=8, n_embd=args.n_embd, seq_len=args.seq_len, vocab_size=256, dropout=args.dropout
    )
    run = RunShape(Topology(2), Target("cpu", "fp32"), args.micro_batches, args.micro_batch_size)
    data = torch.Generator().manual_seed(0)
    shape = (args.micro_batch_size, args.seq_len)
    batches = [(torch.randint(0, 256, shape, generator=data),) * 2 for _ in range(args.micro_batches)]
    tokens = args.micro_batches * args.micro_batch_size * args.seq_len
    print(f"load average at start: {os.getloadavg()[0]:.2f}; {args.threads} intra-op thread(s); {config}")
    print("| mode | compile s | eager tok/s | compiled tok/s | compiled / eager | eager bytes per stage "
          "| compiled bytes per stage | compiled plan's bytes per stage: metered | planned |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|")
    for name, recompute in MODES.items():
        layout = build_layout(config, recompute, run, "type:Block", seed=0)
        eager = LocalPipeline(layout)
        eager_s = timed_steps(eager, batches, args.steps)
        torch._dynamo.reset()
        compiled = LocalPipeline(layout, compile=True)
        compiled_s = timed_steps(compiled, batches, args.steps)
        eager_rate = tokens / statistics.median(eager_s[1:])
        compiled_rate = tokens / statistics.median(compiled_s[1:])
        # the plan counts a compiled block measured at this shape, and may then plan another layout than eager's
        blocks = measure_compiled_blocks(config, args.micro_batch_size, run.target, compiled_options(recompute))
        compiled_run = replace(run, target=replace(run.target, compiled=blocks))
        compiled_layout = build_layout(config, recompute, compiled_run, "type:Block", seed=0)
        planned = plan_run(config, recompute, compiled_layout, compiled_run)
        torch._dynamo.reset()
        metered = LocalPipeline(compiled_layout, compile=True)
        timed_steps(metered, batches, 1)  # compiles (from the cache the measurement filled)
        print(
            f"| {name} | {compiled_s[0] - eager_s[0]:.1f} | {eager_rate:,.0f} | {compiled_rate:,.0f} | "
            f"{compiled_rate / eager_rate:.2f} | {activation_bytes(eager, batches)} | "
            f"{activation_bytes(compiled, batches)} | {activation_bytes(metered, batches)} | "
            f"{[stage.activation_bytes_per_microbatch for stage in planned.stages]} |"
        )
    print(f"load average at end: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
