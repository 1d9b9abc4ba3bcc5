"""stagecheck's recompute modes against a Hugging Face peer (GPT-2, or Llama), interleaved in one invocation.

    (transformers, the peer, is pinned in requirements.txt; it uses the installed torch)
    DS_ACCELERATOR=cpu .venv/bin/python -m bench.peer_bench [--rounds 15] [--steps 1] [--attention math]
    DS_ACCELERATOR=cpu .venv/bin/python -m bench.peer_bench --arch llama --attention sdpa --dropout 0

`--arch llama` trains stagecheck's Llama block (model.arch=llama: RMSNorm, rotary, grouped-query attention with
--kv-heads, SwiGLU of --ffn) against `transformers.LlamaForCausalLM` of the same shape (untied head), no dropout.

Every configuration trains the same GPT shape, single process, on the same batches (the synthetic token
source), with the same optimizer (torch AdamW): stagecheck's model as one pipeline stage run by
parallel/measurement/local_stages.py (the StagePlan and run_stage code the DeepSpeed pipeline runs) in each recompute
mode, and `transformers.GPT2LMHeadModel` built from the config.json an export writes (random weights,
nothing downloaded) with gradient checkpointing off and on. The configurations run in rounds, A B C D E, B C D E A, ...
so a noisy machine slows them alike; each ratio is taken within a round and printed as min / median / max over
rounds. Activation bytes per micro-batch are measured the same way for both models: stagecheck's
ActivationMeter (saved-tensor hooks, each storage once, parameters excluded) on one forward, plus what a
non-reentrant checkpoint keeps by reference (its inputs), reported through parallel/recompute's observers
by stagecheck's segments and, here, by a wrapper around each HF layer's checkpoint function.
Not a test: figures depend on the machine. docs/peer_benchmark.md holds a run.
"""

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

from data import SyntheticDataConfig, open_token_source
from model import GPTConfig, lm_loss
from model.hf.format import hf_config_from_model
from parallel.measurement.activation_meter import ActivationMeter
from parallel.measurement.local_stages import LocalPipeline
from parallel.planning.config import FullRecompute, NoRecompute, SelectiveRecompute
from parallel.planning.layout import build_layout
from parallel.planning.shapes import MIB, RunShape, Target, Topology
from parallel.runtime.recompute import note_stored  # the observers stagecheck's own segments report to

STAGECHECK_MODES = {
    "stagecheck none": NoRecompute(),
    "stagecheck full(1)": FullRecompute(interval="1"),
    "stagecheck selective": SelectiveRecompute(modules=["core_attn"]),
}
HF_MODES = {"HF checkpointing off": False, "HF checkpointing on": True}
SEED = 1234


def adamw(params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=6e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


class Stagecheck:
    """stagecheck's GPT as a single pipeline stage (the whole model in one process)."""

    def __init__(self, cfg: GPTConfig, recompute):
        torch.manual_seed(SEED)
        run = RunShape(Topology(1), Target("cpu", "fp32"), micro_batches=1, micro_batch_size=1)
        self.pipe = LocalPipeline(build_layout(cfg, recompute, run, "parameters", SEED), "fp32")
        for stage in self.pipe.stages:
            stage.train()
        self.optimizer = adamw(self.pipe.parameters())

    def step(self, x: torch.Tensor, y: torch.Tensor) -> float:
        loss = self.pipe.step([(x, y)])
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return float(loss)

    def activation_bytes(self, x: torch.Tensor, y: torch.Tensor) -> int:
        for stage in self.pipe.stages:
            stage.meter.reset()
        self.pipe.step([(x, y)], measure=True)
        self.optimizer.zero_grad(set_to_none=True)
        return sum(stage.meter.bytes_per_micro_batch()[0] for stage in self.pipe.stages)


def _hf_peer(cfg: GPTConfig):
    """The HF model of `cfg`'s shape, from the config.json an export writes (model/hf/format.py), and its layers."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(
        **hf_config_from_model(cfg),
        use_cache=False,
        bos_token_id=0,
        eos_token_id=0,  # byte vocabulary
        # stagecheck's `math` (explicit QK^T, softmax, dropout, x V) is HF's eager path; `sdpa` is sdpa.
        attn_implementation="eager" if cfg.attention == "math" else "sdpa",
    )
    model = AutoModelForCausalLM.from_config(config)
    return model, model.model.layers if cfg.arch == "llama" else model.transformer.h


class HuggingFace:
    """transformers' GPT2LMHeadModel or LlamaForCausalLM of the same shape; `checkpointing` turns gradient
    checkpointing on."""

    def __init__(self, cfg: GPTConfig, checkpointing: bool):
        torch.manual_seed(SEED)
        self.model, layers = _hf_peer(cfg)
        self.model.train()
        if checkpointing:
            enable = getattr(self.model, "activation_checkpointing_enable", None)
            if enable is not None:
                enable()
            else:  # transformers < 5
                self.model.gradient_checkpointing_enable()
            for layer in layers:  # report what the checkpoint keeps, as stagecheck does
                layer._gradient_checkpointing_func = _observed(layer._gradient_checkpointing_func)
        self.meter = ActivationMeter(self.model.parameters)
        self.optimizer = adamw(self.model.parameters())

    def _loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return lm_loss(self.model(input_ids=x).logits, y)  # the same loss on the same labels as stagecheck

    def step(self, x: torch.Tensor, y: torch.Tensor) -> float:
        loss = self._loss(x, y)
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss.item()

    def activation_bytes(self, x: torch.Tensor, y: torch.Tensor) -> int:
        self.meter.reset()
        with self.meter.record():
            loss = self._loss(x, y)
        loss.backward()
        self.optimizer.zero_grad(set_to_none=True)
        return self.meter.bytes_per_micro_batch()[0]


def _observed(checkpoint_func):
    """HF's checkpoint function, reporting the inputs a non-reentrant checkpoint keeps to the meter."""

    def func(function, *args, **kwargs):
        note_stored(*args)
        return checkpoint_func(function, *args, **kwargs)

    return func


def timed(config, batches) -> tuple[float, float]:
    """Tokens per second over `batches` (forward, backward and optimizer step each): per second of wall
    time, and per second of this process's CPU time (all its threads), which other processes on a shared
    machine disturb far less."""
    tokens = sum(x.numel() for x, _ in batches)
    wall, cpu = time.perf_counter(), time.process_time()
    for x, y in batches:
        config.step(x, y)
    return tokens / (time.perf_counter() - wall), tokens / (time.process_time() - cpu)


def spread(values: list[float]) -> dict:
    return {"min": min(values), "median": statistics.median(values), "max": max(values)}


def fmt(s: dict, digits: int = 2) -> str:
    return f"{s['min']:.{digits}f} / {s['median']:.{digits}f} / {s['max']:.{digits}f}"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=4, help="transformer blocks")
    parser.add_argument("--embd", type=int, default=256, help="hidden size h")
    parser.add_argument("--heads", type=int, default=8, help="attention heads a")
    parser.add_argument("--seq-len", type=int, default=512, help="tokens per sequence s")
    parser.add_argument("--micro-batch-size", type=int, default=2, help="sequences per step b")
    parser.add_argument("--dropout", type=float, default=0.1, help="gpt2 only: llama has none")
    parser.add_argument("--arch", choices=("gpt2", "llama"), default="gpt2", help="the block, and the HF peer")
    parser.add_argument("--kv-heads", type=int, default=2, help="llama: key/value heads g")
    parser.add_argument("--ffn", type=int, default=688, help="llama: SwiGLU width f")
    parser.add_argument(
        "--attention",
        choices=("math", "sdpa"),
        default="math",
        help="stagecheck model.attention; HF runs eager for math, sdpa for sdpa",
    )
    parser.add_argument("--rounds", type=int, default=15, help="interleaved rounds (ratios are per round)")
    parser.add_argument("--steps", type=int, default=1, help="timed training steps per configuration and round")
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch intra-op threads (0: torch's default; 1 keeps CPU time free of thread spinning)",
    )
    parser.add_argument(
        "--clock",
        choices=("cpu", "wall"),
        default="cpu",
        help="what tokens/s and the figures are per: process CPU time (robust on a shared "
        "machine) or wall time; the other is printed beside",
    )
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    llama = {"arch": "llama", "n_kv_head": args.kv_heads, "intermediate_size": args.ffn, "activation": "silu"}
    cfg = GPTConfig(
        n_layer=args.layers,
        n_head=args.heads,
        n_embd=args.embd,
        seq_len=args.seq_len,
        vocab_size=256,
        dropout=0.0 if args.arch == "llama" else args.dropout,
        attention=args.attention,
        **({**llama, "bias": False, "tie_embeddings": False} if args.arch == "llama" else {}),
    )
    source = open_token_source(SyntheticDataConfig(), cfg.vocab_size)
    configs = {name: Stagecheck(cfg, recompute) for name, recompute in STAGECHECK_MODES.items()}
    configs.update({name: HuggingFace(cfg, on) for name, on in HF_MODES.items()})
    n_params = {
        name: sum(
            p.numel()
            for p in (c.pipe.parameters() if isinstance(c, Stagecheck) else c.model.parameters())
            if p.requires_grad
        )
        for name, c in configs.items()
    }
    batch = lambda step: source.batch(SEED, step, 0, 0, args.micro_batch_size, cfg.seq_len)  # noqa: E731

    x, y = batch(0)
    first_loss = {name: c.step(x, y) for name, c in configs.items()}  # warm-up (allocator, kernels)
    act = {name: c.activation_bytes(x, y) for name, c in configs.items()}
    wall: dict[str, list[float]] = {name: [] for name in configs}
    cpu: dict[str, list[float]] = {name: [] for name in configs}
    names = list(configs)
    for r in range(args.rounds):
        batches = [batch(1 + r * args.steps + i) for i in range(args.steps)]
        # A B C D E, then B C D E A, ...: each configuration takes each position in turn, so neither a
        # position in the round nor a load change on the machine favours one of them.
        for name in names[r % len(names) :] + names[: r % len(names)]:
            w, c = timed(configs[name], batches)
            wall[name].append(w)
            cpu[name].append(c)
    rounds = cpu if args.clock == "cpu" else wall

    pairs = {
        "stagecheck none / HF checkpointing off": ("stagecheck none", "HF checkpointing off"),
        "stagecheck full(1) / HF checkpointing on": ("stagecheck full(1)", "HF checkpointing on"),
        "stagecheck selective / HF checkpointing off": ("stagecheck selective", "HF checkpointing off"),
        "stagecheck full(1) / stagecheck none": ("stagecheck full(1)", "stagecheck none"),
        "stagecheck selective / stagecheck none": ("stagecheck selective", "stagecheck none"),
        "HF checkpointing on / HF checkpointing off": ("HF checkpointing on", "HF checkpointing off"),
    }
    ratio = lambda series, num, den: spread([a / b for a, b in zip(series[num], series[den])])  # noqa: E731
    ratios = {label: ratio(rounds, num, den) for label, (num, den) in pairs.items()}
    other = wall if args.clock == "cpu" else cpu
    other_ratios = {label: ratio(other, num, den) for label, (num, den) in pairs.items()}
    other_clock = "wall" if args.clock == "cpu" else "cpu"

    lines = [
        f"shape: {cfg.arch}, {cfg.n_layer} layers, h={cfg.n_embd}, a={cfg.n_head}, g={cfg.kv_heads}, "
        f"f={cfg.mlp_width}, s={cfg.seq_len}, b={args.micro_batch_size}, "
        f"vocab {cfg.vocab_size}, dropout {cfg.dropout}, attention {cfg.attention} (HF "
        f"{'eager' if cfg.attention == 'math' else 'sdpa'}), fp32, single process, AdamW",
        f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, load average "
        f"{os.getloadavg()[0]:.1f} at the end, torch {torch.__version__}, {torch.get_num_threads()} threads; "
        f"{args.rounds} rounds x {args.steps} steps, interleaved; tokens/s per second of {args.clock} time",
        "",
        f"| configuration | parameters | activation bytes / micro-batch | vs HF off | tokens/s ({args.clock}) "
        f"min / median / max | tokens/s ({other_clock}) median | first loss |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name in configs:
        lines.append(
            f"| {name} | {n_params[name]:,} | {act[name]:,} ({act[name] / MIB:.1f} MiB) | "
            f"{act[name] / act['HF checkpointing off']:.3f} | {fmt(spread(rounds[name]), 0)} | "
            f"{statistics.median(other[name]):,.0f} | {first_loss[name]:.4f} |"
        )
    lines += [
        "",
        f"| ratio of tokens/s (same round) | {args.clock}: min / median / max | {other_clock}: min / median / max |",
        "|---|---:|---:|",
    ]
    lines += [f"| {label} | {fmt(s)} | {fmt(other_ratios[label])} |" for label, s in ratios.items()]
    none_ratio = ratios["stagecheck none / HF checkpointing off"]
    full_ratio = ratios["stagecheck full(1) / HF checkpointing on"]
    full_bytes, hf_on_bytes = act["stagecheck full(1)"], act["HF checkpointing on"]
    met = lambda ok: "met" if ok else "NOT met"  # noqa: E731
    lines += [
        "",
        f"- stagecheck none tokens/s >= 1.0 x HF checkpointing off: median ratio {none_ratio['median']:.3f} "
        f"(min {none_ratio['min']:.2f}): {met(none_ratio['median'] >= 1.0)}",
        f"- stagecheck full(1) tokens/s >= 1.0 x HF checkpointing on: median ratio {full_ratio['median']:.3f} "
        f"(min {full_ratio['min']:.2f}): {met(full_ratio['median'] >= 1.0)}; at <= activation bytes: "
        f"{full_bytes:,} vs {hf_on_bytes:,} ({full_bytes / hf_on_bytes:.3f}x): {met(full_bytes <= hf_on_bytes)}",
    ]
    print("\n".join(lines))
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "args": vars(args) | {"json": str(args.json)},
                    "activation_bytes": act,
                    "tokens_per_s_wall": wall,
                    "tokens_per_s_cpu": cpu,
                    "ratios": ratios,
                    f"ratios_{other_clock}": other_ratios,
                    "parameters": n_params,
                    "first_loss": first_loss,
                },
                indent=2,
            )
            + "\n"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
