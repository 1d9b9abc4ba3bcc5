"""Below full recompute's floor again (issue 29): nested checkpoints and compressed stashes, in bytes.

    DS_ACCELERATOR=cpu .venv/bin/python -m bench.nested_compress_bench

1. Nested: stage 0 of a 4-stage pipeline (8 micro-batches, so 4 in flight on stage 0) holding 8 blocks at the Llama
   family's proportions (MLP 3.5 x the width, grouped-query attention 4:2, untied head), scaled down to h = 128 and
   256 tokens, and at 1,024 tokens (at 256 the gradients DeepSpeed's ReduceGrads flattens outweigh what nesting
   keeps, and bound the peak: at a real model's length the activations dominate): its activation bytes (the measured
   peak of live tensors, parallel/measurement/stage_replay.py, minus the parameters, gradients and optimizer state)
   under full(1), full(stage) and nested full(2), full(4) and full(stage), with what the planner predicted.
2. Compressed stashes, same stage under full(1): the bytes one micro-batch keeps (the saved-tensor meter, on every
   stage of the pipeline run in one process) with the segment inputs stored as they are, as bf16 and as fp8; in an
   fp32 run and in a bf16 run; and stage 0's measured activation bytes in the fp32 run (the replay is fp32 only).
3. The floor `recompute=auto` reaches (the smallest predicted peak of any plan, per stage) without nesting (today's),
   with it, and with fp8 stashes allowed too (`recompute.compress=fp8`), planned for CUDA bf16: gpt2 on 4 stages
   (8 micro-batches of 8 x 1024), llama3-8b on 4 stages x 2 data-parallel (8 micro-batches of 1 x 8192); its
   activation part is the floor less the parameters, gradients and optimizer state.

Bytes are exact and do not depend on the machine's load. `--time REPS` also times stage 0's step under each nested
mode at 1,024 tokens (the stage replay, the modes interleaved in REPS rounds): run it on a quiet machine. Prints
markdown; docs/nested_compress.md holds a run.
"""

import argparse
from dataclasses import replace

import torch

from bench.interleaved import interleaved, least_cpu, median_wall
from model import GPTConfig
from parallel.measurement.local_stages import LocalPipeline
from parallel.measurement.stage_replay import StageReplay
from parallel.planning.config import AutoRecompute, FullRecompute, RecomputeConfig
from parallel.planning.layout import build_layout
from parallel.planning.run_plan import plan_run
from parallel.planning.shapes import GIB, MIB, RunShape, Target, Topology

LLAMA_SCALED = GPTConfig(
    arch="llama", activation="silu", bias=False, dropout=0.0, tie_embeddings=False, attention="sdpa",
    n_layer=32, n_head=4, n_kv_head=2, n_embd=128, intermediate_size=448, seq_len=256, vocab_size=256,
)  # fmt: skip
FOUR_STAGES = RunShape(Topology(4), Target("cpu", "fp32"), micro_batches=8, micro_batch_size=1)
GPT2 = GPTConfig(n_layer=12, n_head=12, n_embd=768, seq_len=1024, vocab_size=50257)
LLAMA3_8B = GPTConfig(
    arch="llama", activation="silu", bias=False, dropout=0.0, tie_embeddings=False, attention="sdpa",
    n_layer=32, n_head=32, n_kv_head=8, n_embd=4096, intermediate_size=14336, seq_len=8192, vocab_size=128256,
    rope_theta=500000.0,
)  # fmt: skip
FLOOR_RUNS = {
    "gpt2, 4 stages, 8 x (8 x 1024)": (GPT2, RunShape(Topology(4), Target("cuda", "bf16"), 8, 8)),
    "llama3-8b, 4 stages x 2 data-parallel, 8 x (1 x 8192)": (
        LLAMA3_8B,
        RunShape(Topology(4, 2), Target("cuda", "bf16"), 8, 1),
    ),
}


def states_bytes(stage) -> int:
    return stage.param_bytes + stage.grad_bytes + stage.optimizer_bytes


def stage0_activations(recompute: RecomputeConfig, model: GPTConfig = LLAMA_SCALED) -> tuple[int, int]:
    """Stage 0's (measured, predicted) activation bytes: the peak less the parameters, gradients and optimizer."""
    layout = build_layout(model, recompute, FOUR_STAGES, "type:Block", 0)
    stage = plan_run(model, recompute, layout, FOUR_STAGES).stages[0]
    measured = StageReplay(layout, 0, FOUR_STAGES).measure_peak()
    assert measured.unaccounted_bytes == 0
    return measured.peak_bytes - states_bytes(stage), stage.predicted_peak_bytes - states_bytes(stage)


def kept_per_micro_batch(recompute: RecomputeConfig, precision: str) -> tuple[int, int]:
    """Stage 0's (measured, planned) bytes kept per micro-batch, every stage run in one process."""
    run = replace(FOUR_STAGES, target=Target("cpu", precision))
    layout = build_layout(LLAMA_SCALED, recompute, run, "type:Block", 0)
    plan = plan_run(LLAMA_SCALED, recompute, layout, run)
    pipe = LocalPipeline(layout, precision)
    g = torch.Generator().manual_seed(0)
    tokens = [torch.randint(0, LLAMA_SCALED.vocab_size, (1, LLAMA_SCALED.seq_len), generator=g) for _ in range(4)]
    pipe.step([(tokens[i], tokens[i + 2]) for i in range(2)], measure=True)
    return pipe.stages[0].meter.bytes_per_micro_batch()[0], plan.stages[0].activation_bytes_per_microbatch


NESTED_MODES = {
    "full(1)": FullRecompute(interval="1"),
    "full(stage)": FullRecompute(interval="stage"),
    "nested full(2)": FullRecompute(interval="2", nested=True),
    "nested full(4)": FullRecompute(interval="4", nested=True),
    "nested full(stage)": FullRecompute(interval="stage", nested=True),
}


def nested_table(model: GPTConfig) -> list[str]:
    rows = {name: stage0_activations(recompute, model) for name, recompute in NESTED_MODES.items()}
    base = rows["full(1)"][0]
    lines = [
        "| stage 0 under | activation bytes, measured (MiB) | predicted (MiB) | predicted / measured | / full(1) |",
        "|---|---|---|---|---|",
    ]
    for name, (measured, predicted) in rows.items():
        lines.append(
            f"| {name} | {measured / MIB:.3f} | {predicted / MIB:.3f} | {predicted / measured:.3f} | "
            f"{measured / base:.3f} |"
        )
    return lines


def compression_table() -> list[str]:
    lines = [
        "| run | segment inputs stored | kept per micro-batch, measured (KiB) | planned (KiB) | / as they are |",
        "|---|---|---|---|---|",
    ]
    for precision, formats in (("fp32", ("none", "bf16", "fp8")), ("bf16", ("none", "fp8"))):
        rows = {c: kept_per_micro_batch(FullRecompute(interval="1", compress=c), precision) for c in formats}
        for compress, (measured, planned) in rows.items():
            ratio = measured / rows["none"][0]
            lines.append(f"| {precision} | {compress} | {measured / 1024:.1f} | {planned / 1024:.1f} | {ratio:.3f} |")
    fp32 = {c: stage0_activations(FullRecompute(interval="1", compress=c)) for c in ("none", "bf16", "fp8")}
    lines += [
        "",
        "| fp32, stage 0, full(1) | activation bytes at peak, measured (MiB) | predicted (MiB) | / as they are |",
        "|---|---|---|---|",
    ]
    for compress, (measured, predicted) in fp32.items():
        lines.append(
            f"| {compress} | {measured / MIB:.3f} | {predicted / MIB:.3f} | {measured / fp32['none'][0]:.3f} |"
        )
    return lines


def floor_table() -> list[str]:
    lines = [
        "| run | stage | floor today (GiB) | with nesting | and fp8 stashes | activation part: nesting / today | "
        "nesting and fp8 / today |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, (model, run) in FLOOR_RUNS.items():
        lossy = AutoRecompute(budget_gb=1e6, reserve_gb=0.0, compress="fp8")
        layout = build_layout(model, lossy, run, "type:Block", 0)
        stages = plan_run(model, lossy, layout, run).stages
        floors = []
        for budget, stage in zip(layout.budgets, stages):
            today, nested, fp8 = budget.least_bytes_today, budget.least_bytes_exact, budget.least_bytes
            floors.append((today, nested, fp8))
            states = states_bytes(stage)
            lines.append(
                f"| {name} | {budget.stage} | {today / GIB:.2f} | {nested / GIB:.2f} | {fp8 / GIB:.2f} | "
                f"{(nested - states) / (today - states):.3f} | {(fp8 - states) / (today - states):.3f} |"
            )
        largest = [max(f[i] for f in floors) / GIB for i in range(3)]
        lines.append(
            f"| {name} | smallest budget (the largest floor) | {largest[0]:.2f} | {largest[1]:.2f} | "
            f"{largest[2]:.2f} | | |"
        )
    return lines


def nested_step_table(model: GPTConfig, reps: int) -> list[str]:
    """Stage 0's training step (its 8 micro-batches, in the stage replay) per nested mode, the modes interleaved
    in each of `reps` rounds: process CPU seconds (min) and wall seconds (median), each against full(1)'s."""
    replays = {}
    for name, recompute in NESTED_MODES.items():
        layout = build_layout(model, recompute, FOUR_STAGES, "type:Block", 0)
        replays[name] = StageReplay(layout, 0, FOUR_STAGES)
    seconds = interleaved({name: replay.step for name, replay in replays.items()}, reps)
    cpu, wall = least_cpu(seconds), median_wall(seconds)
    lines = [
        f"| stage 0 under | CPU s/step (min of {reps}) | x full(1) | wall s/step (median) | x full(1) |",
        "|---|---|---|---|---|",
    ]
    for name in replays:
        lines.append(
            f"| {name} | {cpu[name]:.3f} | {cpu[name] / cpu['full(1)']:.3f} | {wall[name]:.3f} | "
            f"{wall[name] / wall['full(1)']:.3f} |"
        )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--time", type=int, default=0, metavar="REPS",
        help="also time stage 0's step per nested mode at 1,024 tokens, REPS interleaved rounds (a quiet machine)",
    )  # fmt: skip
    args = parser.parse_args()
    torch.manual_seed(0)
    longer = replace(LLAMA_SCALED, seq_len=4 * LLAMA_SCALED.seq_len)
    for model in (LLAMA_SCALED, longer):
        print(f"## Nested checkpoints: stage 0 of 4, 8 blocks, 4 micro-batches in flight, {model.seq_len} tokens\n")
        print("\n".join(nested_table(model)) + "\n")
    if args.time:
        print(f"## Stage 0's step at {longer.seq_len} tokens (stage replay, 8 micro-batches, one intra-op thread)\n")
        torch.set_num_threads(1)
        print("\n".join(nested_step_table(longer, args.time)) + "\n")
    print("\n## Compressed stashes under full(1), same stage\n")
    print("\n".join(compression_table()))
    print("\n## The floor auto reaches: today, with nesting, and with fp8 stashes allowed too (CUDA bf16, planned)\n")
    print("\n".join(floor_table()))


if __name__ == "__main__":
    main()
