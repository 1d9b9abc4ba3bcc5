"""Convergence of compressed stashes (issue 29, item 5): the loss and the val loss of full(1) with its segment inputs
stored as bf16, fp8 and int8, against the same run stored exactly, on the embedded corpus (data=text's default: this
Python's standard library, byte tokens), for 3 seeds; and the cosine between each compressed run's step-1 gradient and
the exact one, per stage.

    DS_ACCELERATOR=cpu nice -n 19 .venv/bin/python -m bench.compress_convergence [--steps 500] [--out DIR] \
        [--formats bf16 fp8 int8] [--noise-floor]

The model is a 2-stage tiny Llama (untied head, so no tied weight is shared between stages) run in one process
(parallel/measurement/local_stages.py: every stage's programme through the interpreter the engine runs), trained by
AdamW over every stage's parameters. Every variant of a seed starts from the same weights and sees the same batches.
Prints markdown and writes DIR/convergence.png (loss curves, one panel per seed). Nothing is timed.
"""

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from data.config import TextDataConfig
from data.source import open_token_source
from model import GPTConfig
from parallel.measurement.local_stages import LocalPipeline
from parallel.planning.config import FullRecompute
from parallel.planning.layout import build_layout
from parallel.planning.shapes import RunShape, Target, Topology
from parallel.runtime.lr_schedule import lr_factor

MODEL = GPTConfig(
    arch="llama", activation="silu", bias=False, dropout=0.0, tie_embeddings=False, attention="sdpa",
    n_layer=4, n_head=4, n_kv_head=2, n_embd=64, intermediate_size=176, seq_len=64, vocab_size=256,
)  # fmt: skip
RUN = RunShape(Topology(2), Target("cpu", "fp32"), micro_batches=4, micro_batch_size=4)
FORMATS = ("bf16", "fp8", "int8")
REORDERED = "reordered"
"""The noise floor (`--noise-floor`): the exact run with each step's micro-batches taken in reverse order, the same
batches and the same mean loss, only the gradient's sums rounded in another order. Whatever it moves the val loss by,
any perturbation of the trajectory does, a lossless one included."""
SEEDS = (0, 1, 2)
VAL_BATCHES = 32
TAIL = 50
"""The training loss is also given as its mean over the last TAIL steps: one step's loss is one batch's."""
PEAK_LR, WARMUP_STEPS, MIN_LR_RATIO, GRAD_CLIP = 3e-3, 20, 0.1, 1.0
"""Trained as train.py trains: linear warm-up, cosine decay to MIN_LR_RATIO of the peak, the gradient clipped to
GRAD_CLIP (train.grad_clip's default); a run whose rate ends high is still falling steeply, and any perturbation of
its trajectory (a rounding included) shows in the final loss as noise, not as the stash's bias."""


def pipeline(compress: str, seed: int) -> LocalPipeline:
    recompute = FullRecompute(interval="1", compress=compress)
    torch.manual_seed(seed)  # the stages' initial weights
    return LocalPipeline(build_layout(MODEL, recompute, RUN, "type:Block", seed), "fp32")


def micro_batches(source, seed: int, step: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [source.batch(seed, step, 0, m, RUN.micro_batch_size, MODEL.seq_len) for m in range(RUN.micro_batches)]


def stage_grads(pipe: LocalPipeline) -> list[torch.Tensor]:
    return [torch.cat([p.grad.flatten() for p in stage.parameters()]) for stage in pipe.stages]


def val_loss(pipe: LocalPipeline, source, seed: int) -> float:
    batches = [source.val_batch(seed, i, RUN.micro_batch_size, MODEL.seq_len) for i in range(VAL_BATCHES)]
    loss = float(pipe.step(batches))  # the pipeline only trains: its gradients are dropped
    for p in pipe.parameters():
        p.grad = None
    return loss


def train(variant: str, seed: int, steps: int, source) -> dict:
    """`variant`: how the segment inputs are stored (`none`, or one of FORMATS), or REORDERED."""
    pipe = pipeline("none" if variant == REORDERED else variant, seed)
    optimizer = torch.optim.AdamW(pipe.parameters(), lr=PEAK_LR, weight_decay=0.1)
    losses, first_grads = [], None
    for step in range(1, steps + 1):
        batches = micro_batches(source, seed, step)
        losses.append(float(pipe.step(batches[::-1] if variant == REORDERED else batches)))
        if step == 1:
            first_grads = stage_grads(pipe)
        torch.nn.utils.clip_grad_norm_(pipe.parameters(), GRAD_CLIP)
        for group in optimizer.param_groups:
            group["lr"] = PEAK_LR * lr_factor(step, WARMUP_STEPS, steps, MIN_LR_RATIO)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    result = {"losses": losses, "val_loss": val_loss(pipe, source, seed), "first_grads": first_grads}
    print(f"seed {seed}, {variant}: loss {losses[0]:.4f} -> {losses[-1]:.4f}", file=sys.stderr, flush=True)
    return result


def plot(runs: dict, variants: tuple[str, ...], out: Path) -> None:
    import matplotlib  # a benchmark's figure: imported only when drawn

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(SEEDS), figsize=(5 * len(SEEDS), 3.5), sharey=True)
    for ax, seed in zip(axes, SEEDS):
        for compress in variants:
            ax.plot(runs[compress, seed]["losses"], label=compress, linewidth=1)
        ax.set_title(f"seed {seed}")
        ax.set_xlabel("step")
    axes[0].set_ylabel("training loss")
    axes[0].legend(title="segment inputs stored")
    fig.tight_layout()
    fig.savefig(out / "convergence.png", dpi=100)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument("--out", type=Path, default=Path("."))
    parser.add_argument("--formats", nargs="+", choices=FORMATS, default=FORMATS, help="beside the exact run")
    parser.add_argument(
        "--noise-floor", action="store_true", help=f"also the exact run with its micro-batches reordered ({REORDERED})"
    )
    args = parser.parse_args()
    variants = ("none", *((REORDERED,) if args.noise_floor else ()), *args.formats)
    torch.set_num_threads(1)  # a model this small gains nothing from a second thread, which fights for a busy core
    source = open_token_source(TextDataConfig(), MODEL.vocab_size)
    runs = {(c, s): train(c, s, args.steps, source) for s in SEEDS for c in variants}
    print(
        f"{args.steps} steps of {RUN.micro_batches} x {RUN.micro_batch_size} x {MODEL.seq_len} tokens, lr {PEAK_LR} "
        f"warmed up over {WARMUP_STEPS} steps, cosine to {MIN_LR_RATIO} x, clipped at {GRAD_CLIP}\n"
    )
    print(
        f"| seed | stored | first loss | final loss | mean loss, last {TAIL} steps | val loss | val loss / exact | "
        "step-1 grad cosine per stage |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for seed in SEEDS:
        exact = runs["none", seed]
        for compress in variants:
            r = runs[compress, seed]
            cosines = " / ".join(
                f"{float(F.cosine_similarity(g.double(), e.double(), dim=0)):.6f}"  # fp32's rounds past 1
                for g, e in zip(r["first_grads"], exact["first_grads"])
            )
            print(
                f"| {seed} | {compress} | {r['losses'][0]:.4f} | {r['losses'][-1]:.4f} | "
                f"{sum(r['losses'][-TAIL:]) / len(r['losses'][-TAIL:]):.4f} | {r['val_loss']:.4f} | "
                f"{r['val_loss'] / exact['val_loss']:.4f} | {cosines} |"
            )
    args.out.mkdir(parents=True, exist_ok=True)
    plot(runs, variants, args.out)


if __name__ == "__main__":
    main()
