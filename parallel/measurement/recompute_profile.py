"""`recompute.profile=true`: time what each recompute choice redoes, on one block, on the real device, and
the parts of a step the step-time model needs (parallel/planning/step_costs.py).

The forward of each part runs in training mode (dropout on, as recompute replays it) under no_grad, a
few times after a warm-up; the median seconds replace the analytic FLOP/byte costs of the auto planner.
Backward seconds are the median of forward + backward less the median of the same forward with autograd
on: what a backward pass adds, without the recompute a plan would put inside it.
"""

import statistics
import time
from collections.abc import Callable
from functools import partial

import torch

from model import GPTConfig, LlamaBlock, block_range, gpt_layers
from model.fused_loss import HeadLoss
from parallel.planning.shapes import TORCH_DTYPES


def _median_seconds(fn: Callable[[], object], device: str, repeats: int) -> float:
    def sync() -> None:
        if device == "cuda":
            torch.cuda.synchronize()

    fn()  # warm-up: allocator, kernels
    times = []
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _forward_and_backward(forward: Callable[[], torch.Tensor], device: str, repeats: int) -> tuple[float, float]:
    """(forward seconds, backward seconds) of a part whose forward returns what backward starts from."""
    with torch.enable_grad():
        forward_s = _median_seconds(forward, device, repeats)
        both_s = _median_seconds(lambda: forward().float().sum().backward(), device, repeats)
    return forward_s, max(0.0, both_s - forward_s)


def _block_parts(block: torch.nn.Module, x: torch.Tensor) -> dict[str, Callable[[], object]]:
    """The forward of the whole block and of each part selective recompute can redo, on input x (no grad)."""
    if isinstance(block, LlamaBlock):
        attn, norms = block.self_attn, (block.input_layernorm, block.post_attention_layernorm)
        q, k, v = attn._heads(norms[0](x), 0)  # (B, nh, T, hs), (B, g, T, hs) x 2
        act = (block.mlp.gate_proj(norms[1](x)), block.mlp.up_proj(norms[1](x)))  # (B, T, f) each
    else:
        attn, norms = block.attn, (block.ln_1, block.ln_2)
        q, k, v = attn._heads(norms[0](x))  # 3 x (B, nh, T, hs)
        act = (block.mlp.c_fc(norms[1](x)),)  # (B, T, 4C)
    return {
        "block": lambda: block(x),
        "core_attn": lambda: attn.core(q, k, v),
        "mlp": lambda: block.mlp(x),
        "mlp_act": lambda: block.mlp.act(*act),
        "layernorm": lambda: (norms[0](x), norms[1](x)),
    }


def profile_block(
    model: GPTConfig, micro_batch_size: int, device: str, precision: str, repeats: int = 5
) -> dict[str, float]:
    """Seconds of the forward of the whole block and of each part selective recompute can redo (autograd
    off, as recompute's cost); of the block's forward with autograd on and its backward (`block_forward`,
    `block_backward`), forward / backward of the embeddings (`embedding_*`) and of the final norm, LM head
    and loss (`head_*`), all for one micro-batch; and an AdamW step's seconds per parameter. Either architecture:
    the layers are the flat sequence's own."""
    dtype = TORCH_DTYPES[precision]
    recipes = gpt_layers(model, seed=0)  # the head and loss training runs: unfused, or model.loss_chunk_tokens
    blocks = block_range(model)

    def build(index: int) -> torch.nn.Module:
        return recipes[index].build().to(device=device, dtype=dtype).train()

    block = build(blocks.start)
    x = torch.randn(micro_batch_size, model.seq_len, model.n_embd, device=device, dtype=dtype)  # (B, T, C)
    with torch.no_grad():
        seconds = {name: _median_seconds(fn, device, repeats) for name, fn in _block_parts(block, x).items()}
    x_grad = x.detach().requires_grad_()
    seconds["block_forward"], seconds["block_backward"] = _forward_and_backward(lambda: block(x_grad), device, repeats)
    # AdamW over the block's parameters (their gradients are there from the backward just timed), per parameter.
    optimizer = torch.optim.AdamW(block.parameters())
    params = sum(p.numel() for p in block.parameters())
    seconds["optimizer_per_param"] = _median_seconds(optimizer.step, device, repeats) / params

    embeddings = [build(i) for i in range(blocks.start)]  # token embedding (and gpt2's positions)
    norm, head = build(blocks.stop), build(blocks.stop + 1)  # a tied head builds its embedding's module again
    tokens = torch.randint(model.vocab_size, (micro_batch_size, model.seq_len), device=device)  # (B, T)

    def embed() -> torch.Tensor:
        out = tokens
        for layer in embeddings:
            out = layer(out)
        return out

    seconds["embedding_forward"], seconds["embedding_backward"] = _forward_and_backward(embed, device, repeats)
    head_fn = head if recipes[-1].forward_fn is None else partial(recipes[-1].forward_fn, head)
    loss = HeadLoss.of(recipes)
    seconds["head_forward"], seconds["head_backward"] = _forward_and_backward(
        lambda: loss(head_fn(norm(x_grad)), tokens, head.head_weight), device, repeats
    )
    return seconds
