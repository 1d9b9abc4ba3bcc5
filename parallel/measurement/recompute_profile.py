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

import torch

from model import Block, GPTConfig, gpt_layers
from model.fused_loss import HeadLoss
from model.layers import FinalNorm, PositionEmbedding, TokenEmbedding
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


def profile_block(
    model: GPTConfig, micro_batch_size: int, device: str, precision: str, repeats: int = 5
) -> dict[str, float]:
    """Seconds of the forward of the whole block and of each part selective recompute can redo (autograd
    off, as recompute's cost); of the block's forward with autograd on and its backward (`block_forward`,
    `block_backward`), forward / backward of the embeddings (`embedding_*`) and of the final norm, LM head
    and loss (`head_*`), all for one micro-batch; and an AdamW step's seconds per parameter."""
    dtype = TORCH_DTYPES[precision]
    block = Block(model, seed=0, layer_index=0).to(device=device, dtype=dtype).train()
    x = torch.randn(micro_batch_size, model.seq_len, model.n_embd, device=device, dtype=dtype)  # (B, T, C)
    B, T, C = x.shape
    with torch.no_grad():
        q, k, v = (
            t.view(B, T, model.n_head, C // model.n_head).transpose(1, 2)
            for t in block.attn.c_attn(block.ln_1(x)).split(C, dim=2)
        )  # 3 x (B, nh, T, hs)
        hidden = block.mlp.c_fc(block.ln_2(x))  # (B, T, 4C)
        parts = {
            "block": lambda: block(x),
            "core_attn": lambda: block.attn.core(q, k, v),
            "mlp": lambda: block.mlp(x),
            "mlp_act": lambda: block.mlp.act(hidden),
            "layernorm": lambda: (block.ln_1(x), block.ln_2(x)),
        }
        seconds = {name: _median_seconds(fn, device, repeats) for name, fn in parts.items()}
    x_grad = x.detach().requires_grad_()
    seconds["block_forward"], seconds["block_backward"] = _forward_and_backward(lambda: block(x_grad), device, repeats)
    # AdamW over the block's parameters (their gradients are there from the backward just timed), per parameter.
    optimizer = torch.optim.AdamW(block.parameters())
    params = sum(p.numel() for p in block.parameters())
    seconds["optimizer_per_param"] = _median_seconds(optimizer.step, device, repeats) / params

    wte = TokenEmbedding(model, seed=0).to(device=device, dtype=dtype).train()
    wpe = PositionEmbedding(model, seed=0, layer_index=1).to(device=device, dtype=dtype).train()
    norm = FinalNorm(model, seed=0, layer_index=2).to(device=device, dtype=dtype).train()
    tokens = torch.randint(model.vocab_size, (B, T), device=device)  # (B, T)
    seconds["embedding_forward"], seconds["embedding_backward"] = _forward_and_backward(
        lambda: wpe(wte(tokens)), device, repeats
    )
    recipes = gpt_layers(model, seed=0)  # the head and loss training runs: unfused, or model.loss_chunk_tokens
    head, loss = recipes[-1].forward_fn, HeadLoss.of(recipes)
    seconds["head_forward"], seconds["head_backward"] = _forward_and_backward(
        lambda: loss(head(wte, norm(x_grad)), tokens, wte.wte.weight), device, repeats
    )
    return seconds
