"""`recompute.profile=true`: time what each recompute choice redoes, on one block, on the real device.

The forward of each part runs in training mode (dropout on, as recompute replays it) under no_grad, a
few times after a warm-up; the median seconds replace the analytic FLOP/byte costs of the auto planner.
"""

import statistics
import time
from collections.abc import Callable

import torch

from model import Block, GPTConfig
from parallel.shapes import TORCH_DTYPES


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


def profile_block(
    model: GPTConfig, micro_batch_size: int, device: str, precision: str, repeats: int = 5
) -> dict[str, float]:
    """Seconds of the forward of the whole block and of each part selective recompute can redo."""
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
        return {name: _median_seconds(fn, device, repeats) for name, fn in parts.items()}
