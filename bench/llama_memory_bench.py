"""The Llama block's activation memory: planned against measured bytes at two shapes, and the planner against the
per-block formula of docs/llama.md at Llama-3-8B's shape, printed side by side in one run.

    DS_ACCELERATOR=cpu .venv/bin/python -m bench.llama_memory_bench

Each shape trains one step of 2 micro-batches through a 2-stage layout in one process
(parallel/measurement/local_stages.py: the StagePlan and run_stage code the DeepSpeed pipeline runs), in every
recompute mode below, fp32 and bf16, and compares each stage's bytes per micro-batch (the saved-tensor meter)
with the plan's. Bytes do not depend on the machine's load. Prints markdown; docs/llama.md holds a run.
"""

import argparse
from dataclasses import replace

import torch

from model import GPTConfig
from parallel.measurement.local_stages import LocalPipeline
from parallel.planning.budget_refusal import BudgetTooSmall
from parallel.planning.config import AutoRecompute, FullRecompute, NoRecompute, SelectiveRecompute
from parallel.planning.layout import build_layout
from parallel.planning.memory_model import block_full_items, llama_block_items, total
from parallel.planning.plan_record import PaperBytes
from parallel.planning.run_plan import plan_run
from parallel.planning.shapes import RunShape, Shape, Target, Topology

MODES = {
    "none": NoRecompute(),
    "selective core_attn": SelectiveRecompute(modules=["core_attn"]),
    "selective mlp_act+layernorm": SelectiveRecompute(modules=["mlp_act", "layernorm"]),
    "selective mlp+layernorm": SelectiveRecompute(modules=["mlp", "layernorm"]),
    "full(1)": FullRecompute(interval="1"),
    "auto": None,  # AutoRecompute at 1.05 x the smallest budget that fits the shape: a mixed plan
}
LLAMA = {"arch": "llama", "activation": "silu", "bias": False, "dropout": 0.0, "vocab_size": 256}
SHAPES = {
    "tiny-llama (L4 h64 a4 g2 f176 s64, untied, sdpa)": GPTConfig(
        n_layer=4, n_head=4, n_kv_head=2, n_embd=64, intermediate_size=176, seq_len=64, tie_embeddings=False, **LLAMA
    ),
    "L4 h256 a8 g2 f688 s256, tied, math, fused loss": GPTConfig(
        n_layer=4, n_head=8, n_kv_head=2, n_embd=256, intermediate_size=688, seq_len=256, attention="math",
        loss_chunk_tokens=128, **LLAMA,
    ),
}  # fmt: skip
LLAMA3_8B = Shape(b=1, s=8192, h=4096, a=32, vocab=128256, dropout=False, attention="sdpa", arch="llama", g=8, f=14336)


def tight_auto(cfg: GPTConfig, run: RunShape) -> AutoRecompute:
    try:
        build_layout(cfg, AutoRecompute(budget_gb=1e-6, reserve_gb=0.0), run, "type:Block", seed=0)
    except BudgetTooSmall as refusal:
        return AutoRecompute(budget_gb=1.05 * refusal.smallest_gb, reserve_gb=0.0)
    raise AssertionError("a 1 KiB budget fitted")


def measured_and_planned(cfg: GPTConfig, recompute, precision: str) -> list[tuple[int, int]]:
    """(measured, planned) bytes per micro-batch of each stage."""
    run = RunShape(Topology(2), Target("cpu", precision), micro_batches=2, micro_batch_size=2)
    recompute = recompute or tight_auto(cfg, run)
    layout = build_layout(cfg, recompute, run, "type:Block", seed=0)
    plan = plan_run(cfg, recompute, layout, run)
    pipe = LocalPipeline(layout, precision)
    g = torch.Generator().manual_seed(0)
    batches = [tuple(torch.randint(0, cfg.vocab_size, (2, cfg.seq_len), generator=g) for _ in range(2))] * 2
    pipe.step(batches, measure=True)
    stages = zip(pipe.stages, plan.stages)
    return [
        (stage.meter.bytes_per_micro_batch()[0], planned.activation_bytes_per_microbatch) for stage, planned in stages
    ]


def formula_rows() -> list[str]:
    """Llama-3-8B: the planner's bytes per block against PaperBytes (docs/llama.md's formula)."""
    target, paper = Target("cuda", "bf16"), PaperBytes.of(LLAMA3_8B)
    explicit = replace(LLAMA3_8B, attention="math")
    lse = 4 * LLAMA3_8B.b * LLAMA3_8B.a * LLAMA3_8B.s
    rows = [
        ("explicit, none", llama_block_items(explicit, target), paper.none, "sbh(16 + 6f/h + 2as/h) + 8sb + 4sh/a"),
        (
            "explicit, core_attn",
            llama_block_items(explicit, target, ("core_attn",)),
            paper.selective,
            "sbh(12 + 4g/a + 6f/h) + 8sb + 4sh/a",
        ),
        ("SDPA, none", llama_block_items(LLAMA3_8B, target), paper.selective + lse, "the same + 4asb = 34sbh + ..."),
        ("full", block_full_items(LLAMA3_8B, target, True), paper.full, "2sbh"),
    ]
    return [f"| {name} | {total(items):,} | {formula:,.0f} | {terms} |" for name, items, formula, terms in rows]


def main(argv=None) -> int:
    argparse.ArgumentParser(description=__doc__.split("\n")[0]).parse_args(argv)
    lines = [
        "| shape | mode | precision | stage 0 measured / planned | stage 1 measured / planned | off by |",
        "|---|---|---|---:|---:|---:|",
    ]
    worst = 0
    for shape_name, cfg in SHAPES.items():
        for mode, recompute in MODES.items():
            for precision in ("fp32", "bf16"):
                pairs = measured_and_planned(cfg, recompute, precision)
                off = max(abs(m - p) for m, p in pairs)
                worst = max(worst, off)
                cells = " | ".join(f"{m:,} / {p:,}" for m, p in pairs)
                lines.append(f"| {shape_name} | {mode} | {precision} | {cells} | {off} |")
    lines.append(f"\nplanned = measured: largest difference {worst} bytes over {len(lines) - 2} runs")
    lines += [
        "",
        "Llama-3-8B, one block, bf16 on CUDA, b=1, s=8192 (bytes): the planner against docs/llama.md's formula",
        "",
        "| attention, recompute | planner | formula | formula's terms |",
        "|---|---:|---:|---|",
        *formula_rows(),
    ]
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
