"""Below full recompute's floor, parts 1 and 2 of issue 14: the fused LM-head loss and 1-bit dropout masks.

    DS_ACCELERATOR=cpu .venv/bin/python -m bench.memory_floor_bench [--rounds 9]

Fused loss (model.loss_chunk_tokens): the planned last stage of model=gpt2 (4 stages, 8 x 1024, bf16, CUDA) fused
and unfused; the measured and planned bytes of the last stage on CPU at vocab 50257 and a small width; the last
stage's forward + backward seconds, unfused and at several chunk sizes, at that shape and at the tiny model.
Packed masks (model.packed_dropout): measured and planned bytes per block with dropout on, none and selective,
packed and not, at 5 a s / h = 80, against Korthikanti et al.'s mask shares; and a block's forward + backward
seconds, packed and not.

Time is process CPU time on one intra-op thread (other processes' use of the cores is left out), in interleaved
rounds (every variant once per round, the order reversed every other round); the median per variant is printed.
Bytes are exact. Prints markdown tables; docs/memory_floor.md holds a run.
"""

import argparse
import dataclasses
from collections.abc import Callable

import torch

from bench.interleaved import interleaved, median_cpu
from model import GPTConfig
from parallel.measurement.local_stages import LocalPipeline
from parallel.planning.config import NoRecompute, RecomputeConfig, SelectiveRecompute
from parallel.planning.layout import build_layout
from parallel.planning.run_plan import plan_run
from parallel.planning.shapes import GIB, MIB, RunShape, Target, Topology

SMALL_WIDE_VOCAB = GPTConfig(n_layer=4, n_head=4, n_embd=128, seq_len=128, vocab_size=50257, dropout=0.1)
TINY = GPTConfig(n_layer=4, n_head=4, n_embd=128, seq_len=128, vocab_size=256, dropout=0.1)
GPT2 = GPTConfig(n_layer=12, n_head=12, n_embd=768, seq_len=1024, vocab_size=50257)
# 5 a s / h = 80 (a = 4, s = 512, h = 128): Korthikanti et al.'s GPT-3 175B has 5 a s / h = 80 too.
MASK_SHAPE = GPTConfig(n_layer=2, n_head=4, n_embd=128, seq_len=512, vocab_size=256, dropout=0.1, attention="math")


def pipeline(cfg: GPTConfig, recompute: RecomputeConfig, micro_batch_size: int, precision: str = "fp32"):
    run = RunShape(Topology(2), Target("cpu", precision), micro_batches=1, micro_batch_size=micro_batch_size)
    layout = build_layout(cfg, recompute, run, "type:Block", seed=0)
    return LocalPipeline(layout, precision), plan_run(cfg, recompute, layout, run)


def batch(cfg: GPTConfig, micro_batch_size: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, cfg.vocab_size, (micro_batch_size, cfg.seq_len + 1), generator=g)
    return [(tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())]


def measured_and_planned(cfg: GPTConfig, recompute: RecomputeConfig, micro_batch_size: int, precision: str):
    """Per stage: (measured, planned) activation bytes of one micro-batch."""
    pipe, plan = pipeline(cfg, recompute, micro_batch_size, precision)
    pipe.step(batch(cfg, micro_batch_size), measure=True)
    return [
        (s.meter.bytes_per_micro_batch()[0], p.activation_bytes_per_microbatch)
        for s, p in zip(pipe.stages, plan.stages)
    ]


def gpt2_dry_run_table() -> list[str]:
    run = RunShape(Topology(4), Target("cuda", "bf16"), micro_batches=8, micro_batch_size=8)
    lines = [
        "| recompute | partition | unfused last stage GiB/micro-batch | fused | fused / unfused |",
        "|---|---|---|---|---|",
    ]
    for name, recompute in (("none", NoRecompute()), ("selective", SelectiveRecompute())):
        for partition in ("type:Block", "balanced"):
            last = []
            for chunk in (0, GPT2.loss_chunk_tokens):
                cfg = dataclasses.replace(GPT2, loss_chunk_tokens=chunk)
                plan = plan_run(cfg, recompute, build_layout(cfg, recompute, run, partition, seed=0), run)
                last.append(plan.stages[-1].activation_bytes_per_microbatch)
            lines.append(
                f"| {name} | {partition} | {last[0] / GIB:.3f} | {last[1] / GIB:.3f} | {last[1] / last[0]:.3f} |"
            )
    return lines


def cpu_bytes_table(micro_batch_size: int) -> list[str]:
    lines = [
        "| precision | loss | last stage measured MiB | planned MiB | measured drop MiB | planned drop MiB |",
        "|---|---|---|---|---|---|",
    ]
    for precision in ("fp32", "bf16"):
        rows = []
        for chunk in (0, SMALL_WIDE_VOCAB.loss_chunk_tokens):
            cfg = dataclasses.replace(SMALL_WIDE_VOCAB, loss_chunk_tokens=chunk)
            rows.append(measured_and_planned(cfg, NoRecompute(), micro_batch_size, precision)[-1])
        (m0, p0), (m1, p1) = rows
        for name, (m, p) in (("unfused", rows[0]), (f"fused ({SMALL_WIDE_VOCAB.loss_chunk_tokens})", rows[1])):
            drop = f"{(m0 - m1) / MIB:.3f} | {(p0 - p1) / MIB:.3f}" if m == m1 else "- | -"
            lines.append(f"| {precision} | {name} | {m / MIB:.3f} | {p / MIB:.3f} | {drop} |")
    return lines


def last_stage_step(cfg: GPTConfig, micro_batch_size: int) -> Callable[[], None]:
    """Forward, loss and backward of the last of two stages on a received (B, T, C) input, as on its rank."""
    pipe, _ = pipeline(cfg, NoRecompute(), micro_batch_size)
    stage = pipe.stages[-1]
    received = torch.randn(micro_batch_size, cfg.seq_len, cfg.n_embd, generator=torch.Generator().manual_seed(1))
    (_, labels) = batch(cfg, micro_batch_size)[0]

    def step() -> None:
        x = received.clone().requires_grad_()
        pipe.loss(stage(x.clone()), labels, pipe.head_weight).backward()
        for p in stage.parameters():
            p.grad = None

    return step


def fused_time_table(cfg: GPTConfig, micro_batch_size: int, chunks: list[int], rounds: int) -> list[str]:
    variants = {
        chunk: last_stage_step(dataclasses.replace(cfg, loss_chunk_tokens=chunk), micro_batch_size)
        for chunk in [0, *chunks]
    }
    medians = median_cpu(interleaved({str(c): v for c, v in variants.items()}, rounds))
    base = medians["0"]
    lines = [
        f"vocab {cfg.vocab_size}, h {cfg.n_embd}, {micro_batch_size} x {cfg.seq_len} tokens, "
        f"2 blocks + final norm + head + loss (the last of 2 stages), fp32, {rounds} rounds:",
        "",
        "| loss_chunk_tokens | median s | vs unfused |",
        "|---|---|---|",
    ]
    for chunk, seconds in medians.items():
        lines.append(f"| {chunk if chunk != '0' else '0 (unfused)'} | {seconds:.4f} | {seconds / base - 1:+.1%} |")
    return lines


def mask_bytes_table(micro_batch_size: int, precision: str) -> list[str]:
    """Per-block bytes with dropout on, none and selective, packed and not: measured == planned, and the share
    of a block's bytes packing saves, against Korthikanti et al.'s mask share x 7/8."""
    a, s, h = MASK_SHAPE.n_head, MASK_SHAPE.seq_len, MASK_SHAPE.n_embd
    paper_mask_share = {"none": (2 + a * s / h) / (34 + 5 * a * s / h), "selective": 2 / 34}
    lines = [
        f"5as/h = {5 * a * s // h}, {precision} on CPU, per block (stage 1 of 2, which holds one block and the head):",
        "",
        "| recompute | packed | measured block bytes | planned | saved by packing | paper: mask share x 7/8 |",
        "|---|---|---|---|---|---|",
    ]
    for name, recompute in (("none", NoRecompute()), ("selective", SelectiveRecompute())):
        per_block = {}
        for packed in (False, True):
            cfg = dataclasses.replace(MASK_SHAPE, packed_dropout=packed)
            pipe, plan = pipeline(cfg, recompute, micro_batch_size, precision)
            pipe.step(batch(cfg, micro_batch_size), measure=True)
            # stage 0 = embeddings + 1 block; the block's bytes are stage 0's less the embeddings' planned bytes
            embeddings = sum(layer.bytes for layer in plan.stages[0].layer_activation_bytes if layer.name != "Block")
            measured = pipe.stages[0].meter.bytes_per_micro_batch()[0] - embeddings
            planned = plan.stages[0].activation_bytes_per_microbatch - embeddings
            per_block[packed] = measured
            saved = "-" if not packed else f"{1 - measured / per_block[False]:.1%}"
            paper = "-" if not packed else f"{paper_mask_share[name] * 7 / 8:.1%}"
            lines.append(f"| {name} | {packed} | {measured} | {planned} | {saved} | {paper} |")
    return lines


def block_step(cfg: GPTConfig, micro_batch_size: int) -> Callable[[], None]:
    pipe, _ = pipeline(cfg, NoRecompute(), micro_batch_size)
    batches = batch(cfg, micro_batch_size)

    def step() -> None:
        pipe.step(batches)
        for p in pipe.parameters():
            p.grad = None

    return step


def mask_time_table(micro_batch_size: int, rounds: int) -> list[str]:
    variants = {
        str(packed): block_step(dataclasses.replace(MASK_SHAPE, packed_dropout=packed), micro_batch_size)
        for packed in (False, True)
    }
    medians = median_cpu(interleaved(variants, rounds))
    return [
        f"a whole 2-stage step (2 blocks, attention=math, dropout 0.1, {micro_batch_size} x {MASK_SHAPE.seq_len}, "
        f"fp32), {rounds} rounds: unpacked {medians['False']:.4f} s, packed {medians['True']:.4f} s "
        f"({medians['True'] / medians['False'] - 1:+.1%})"
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--chunks", type=int, nargs="+", default=[64, 128, 256, 1024])
    args = parser.parse_args()
    torch.set_num_threads(1)
    sections = [
        lambda: ["## Fused loss: the last stage of model=gpt2 in the dry run (4 stages, 8 x 1024, bf16, CUDA)", ""],
        gpt2_dry_run_table,
        lambda: ["", "## Fused loss: measured bytes of the last stage on CPU (vocab 50257, h 128, 4 x 128 tokens)", ""],
        lambda: cpu_bytes_table(micro_batch_size=4),
        lambda: ["", "## Fused loss: time of the last stage", ""],
        lambda: fused_time_table(SMALL_WIDE_VOCAB, 8, args.chunks, args.rounds),
        lambda: [""],
        lambda: fused_time_table(TINY, 8, args.chunks, args.rounds),
        lambda: ["", "## Packed dropout masks: bytes", ""],
        lambda: mask_bytes_table(micro_batch_size=1, precision="fp32"),
        lambda: [""],
        lambda: mask_bytes_table(micro_batch_size=1, precision="bf16"),
        lambda: ["", "## Packed dropout masks: time", ""],
        lambda: mask_time_table(micro_batch_size=1, rounds=args.rounds),
    ]
    for section in sections:  # each printed as soon as it is measured
        print("\n".join(section()), flush=True)


if __name__ == "__main__":
    main()
