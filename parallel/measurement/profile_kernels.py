"""The workloads of a device profile: for each curve of parallel/planning/device_profile_file.py's CURVES, a
callable per size that runs that kernel once, on the model's own modules and functions where it has them
(the attention core, the fused and unfused loss, Llama's RMSNorm, rotary embedding and SwiGLU product), so the
profile times what training runs.

A family (`families`) lists its sizes, builds the workloads of one size, {curve: {x: workload}} (x: the curve's
x for the tensors the workload holds), and bounds the bytes they hold, so the profile builds, times and frees one
size at a time and skips the sizes that would not fit in the device's free memory (`sizes_that_fit`). A backward
workload reruns the backward of one retained graph (`torch.autograd.grad`, which accumulates nothing), so it times
the backward alone.
"""

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from model import GPTConfig
from model.attention import AttentionCore
from model.fused_loss import chunked_lm_loss
from model.gpt import lm_loss
from model.layers import head_logits
from model.llama_layers import SwiGLU
from model.rms_norm import RMSNorm
from model.rotary import apply_rotary, rotary_cos_sin
from parallel.planning.device_profile_file import GQA_GROUPS, HEAD_SIZES, attention_curve

Workloads = dict[str, dict[float, Callable[[], object]]]

WIDTH = 512
"""Channels of the elementwise and normalisation workloads (their cost follows the elements, not the width)."""
LOSS_WIDTH, LOSS_VOCAB, LOSS_CHUNK = 128, 8192, 128
EMBEDDING_ROWS = 1024
ROTARY_HEAD_SIZE = 64
"""Head size of the rotary workload (its cost follows the elements: two multiplies, a rotate-half, an add)."""


def _geometric(low: float, high: float, points: int) -> list[float]:
    return [low * (high / low) ** (i / (points - 1)) for i in range(points)]


def _backward(out: torch.Tensor, inputs: tuple[torch.Tensor, ...]) -> Callable[[], object]:
    grad = torch.randn_like(out)
    return lambda: torch.autograd.grad(out, inputs, grad, retain_graph=True)


def matmul(device: str, dtype: torch.dtype, flops: float) -> Workloads:
    """(8c, c) x (c, 2c): a transformer's tokens x width x a multiple of the width."""
    c = _matmul_width(flops)
    a = torch.randn(8 * c, c, device=device, dtype=dtype)
    b = torch.randn(c, 2 * c, device=device, dtype=dtype)
    return {"matmul": {32.0 * c**3: lambda: a @ b}}


def _matmul_width(flops: float) -> int:
    return max(4, round((flops / 32) ** (1 / 3)))


def _llama(**fields) -> GPTConfig:
    """A Llama-family config for the workloads of its own modules (the fields they read; the rest valid)."""
    return GPTConfig(arch="llama", activation="silu", bias=False, tie_embeddings=False, intermediate_size=4, **fields)


def elementwise(device: str, dtype: torch.dtype, elements: float) -> Workloads:
    """LayerNorm, GELU, dropout (its RNG included), a residual add, the embedding's gather and scatter; Llama's
    RMSNorm (model/rms_norm.py), rotary embedding (model/rotary.py) and SwiGLU product (model/llama_layers.py)."""
    rows = _rows(elements)
    size = float(rows * WIDTH)
    rms_norm = RMSNorm(WIDTH, 1e-5).to(device, dtype)
    swiglu = SwiGLU()
    x = torch.randn(rows, WIDTH, device=device, dtype=dtype, requires_grad=True)
    weight = torch.ones(WIDTH, device=device, dtype=dtype, requires_grad=True)
    bias = torch.zeros(WIDTH, device=device, dtype=dtype, requires_grad=True)
    y = torch.randn(rows, WIDTH, device=device, dtype=dtype)
    table = torch.randn(EMBEDDING_ROWS, WIDTH, device=device, dtype=dtype, requires_grad=True)
    ids = torch.randint(EMBEDDING_ROWS, (rows,), device=device)
    up = torch.randn(rows, WIDTH, device=device, dtype=dtype, requires_grad=True)
    heads = x.view(1, rows, WIDTH // ROTARY_HEAD_SIZE, ROTARY_HEAD_SIZE).transpose(1, 2)  # (1, heads, T, hs)
    config = _llama(n_embd=WIDTH, n_head=WIDTH // ROTARY_HEAD_SIZE, seq_len=rows)
    cos, sin = rotary_cos_sin(config, 0, rows, dtype, torch.device(device))  # (T, hs) each
    curves: Workloads = {"add": {size: lambda: torch.add(x.detach(), y)}}
    for name, forward, inputs in (
        ("layernorm", lambda: F.layer_norm(x, (WIDTH,), weight, bias), (x, weight, bias)),
        ("gelu", lambda: F.gelu(x), (x,)),
        ("dropout", lambda: F.dropout(x, 0.1, training=True), (x,)),
        ("embedding", lambda: F.embedding(ids, table), (table,)),
        ("rmsnorm", lambda: rms_norm(x), (x, rms_norm.weight)),
        ("rotary", lambda: apply_rotary(heads, cos, sin), (x,)),
        ("swiglu", lambda: swiglu(x, up), (x, up)),
    ):
        curves[name] = {size: forward}
        curves[name + "_backward"] = {size: _backward(forward(), inputs)}
    return curves


def _rows(elements: float) -> int:
    return max(8, round(elements / WIDTH))


def attention(device: str, dtype: torch.dtype, seq: float) -> Workloads:
    """model/attention.py's AttentionCore, each kernel with and without dropout, at 4 heads of each of HEAD_SIZES
    over a sequence of `seq` (the curve's x is the score elements, b x heads x s x s); and without dropout with
    4 / GQA_GROUPS key/value heads (grouped-query attention: SDPA's enable_gqa, the explicit kernel's repeat)."""
    seq = round(seq)
    curves: Workloads = {}
    for head_size in HEAD_SIZES:
        q, k, v = (
            torch.randn(1, 4, seq, head_size, device=device, dtype=dtype, requires_grad=True) for _ in range(3)
        )  # (B, nh, T, hs)
        for kernel in ("sdpa", "math"):
            for dropout in (0.0, 0.1):
                config = GPTConfig(n_head=4, n_embd=4 * head_size, seq_len=seq, dropout=dropout, attention=kernel)
                core = AttentionCore(config).to(device).train()
                name = attention_curve(kernel, bool(dropout), head_size)
                curves[name] = {4.0 * seq * seq: lambda core=core, qkv=(q, k, v): core(*qkv)}
                curves[name + "_backward"] = {4.0 * seq * seq: _backward(core(q, k, v), (q, k, v))}
            k_g, v_g = (t[:, : 4 // GQA_GROUPS].detach().requires_grad_() for t in (k, v))  # (B, g, T, hs)
            config = _llama(n_head=4, n_kv_head=4 // GQA_GROUPS, n_embd=4 * head_size, seq_len=seq, attention=kernel)
            core = AttentionCore(config).to(device).train()
            name = attention_curve(kernel, False, head_size, grouped=True)
            curves[name] = {4.0 * seq * seq: lambda core=core, qkv=(q, k_g, v_g): core(*qkv)}
            curves[name + "_backward"] = {4.0 * seq * seq: _backward(core(q, k_g, v_g), (q, k_g, v_g))}
    return curves


def losses(device: str, dtype: torch.dtype, tokens: float) -> Workloads:
    """The LM head and its loss, fused and chunked (model/fused_loss.py) or over whole logits (model/gpt.py's
    lm_loss), on `tokens` tokens (x: tokens x width x vocabulary)."""
    tokens = round(tokens)
    weight = torch.randn(LOSS_VOCAB, LOSS_WIDTH, device=device, dtype=dtype, requires_grad=True)
    hidden = torch.randn(tokens, LOSS_WIDTH, device=device, dtype=dtype, requires_grad=True)  # (N, C)
    labels = torch.randint(LOSS_VOCAB, (tokens,), device=device)
    size = float(tokens * LOSS_WIDTH * LOSS_VOCAB)
    curves: Workloads = {}
    for name, forward in (
        ("loss_chunked", lambda: chunked_lm_loss(hidden, weight, labels, LOSS_CHUNK)),
        ("loss_unfused", lambda: lm_loss(head_logits(hidden, weight), labels)),
    ):
        curves[name] = {size: forward}
        curves[name + "_backward"] = {size: _backward(forward(), (hidden, weight))}
    return curves


def optimizer(device: str, dtype: torch.dtype, params: float) -> Workloads:
    """torch's AdamW over 12 tensors (a block's weights and biases), as DeepSpeed steps a stage's parameters."""
    tensors = [torch.zeros(max(1, round(params / 12)), device=device, dtype=dtype) for _ in range(12)]
    for t in tensors:
        t.requires_grad_()
        t.grad = torch.randn_like(t)
    adamw = torch.optim.AdamW(tensors, lr=1e-6)
    return {"adamw": {float(sum(t.numel() for t in tensors)): adamw.step}}


WORKSPACE_BYTES = 64 * 2**20
"""What a family's kernels may take beside its tensors (cuBLAS's workspace comes from the caching allocator)."""


@dataclass(frozen=True)
class Family:
    name: str
    sizes: list[float]
    """The sizes asked for, ascending (a workload's x may round them)."""
    build: Callable[[float], Workloads]
    """One size's workloads, every curve of the family."""
    tensor_bytes: Callable[[float], float]
    """An upper bound of the bytes of the tensors one size's workloads hold, with what a timed call allocates."""

    def bytes_at(self, size: float) -> float:
        """An upper bound of the device memory one size takes: its tensors and the kernels' workspaces."""
        return self.tensor_bytes(size) + WORKSPACE_BYTES


def families(device: str, dtype: torch.dtype, points: int, grid: dict) -> list[Family]:
    """Every compute family of a profile over `grid`'s ranges (parallel/measurement/device_profile.py). The byte
    bounds count each family's tensors with room to spare: the retained graphs of its backward workloads (their
    outputs, the gradients they are fed, what autograd saved) and a call's temporaries."""
    d = torch.finfo(dtype).bits // 8
    elements, seqs = _geometric(WIDTH * 8, grid["max_elements"], points), _geometric(32, grid["max_seq"], points)
    tokens = _geometric(64, grid["max_tokens"], points)
    loss_weight = 2 * LOSS_VOCAB * LOSS_WIDTH * d  # the head's weight and its gradient
    return [
        Family(
            "matmul",
            _geometric(1e5, grid["max_flops"], points),
            lambda flops: matmul(device, dtype, flops),
            lambda flops: 26 * _matmul_width(flops) ** 2 * d,  # a, b and the product
        ),
        Family(
            "elementwise",
            elements,
            lambda n: elementwise(device, dtype, n),
            # 3 inputs, an output and its gradient for each of 7 retained graphs, masks and a call's temporaries
            lambda n: 32 * _rows(n) * WIDTH * d + 2 * EMBEDDING_ROWS * WIDTH * d,
        ),
        Family(
            "attention",
            sorted({round(s) for s in seqs}),
            lambda seq: attention(device, dtype, seq),
            # per head size: the explicit kernel's retained scores (3 graphs) and a call's, plus q, k, v and outputs
            lambda seq: len(HEAD_SIZES) * (16 * 4 * seq * seq * d + 64 * 4 * seq * max(HEAD_SIZES) * d),
        ),
        Family(
            "losses",
            sorted({round(t) for t in tokens}),
            lambda n: losses(device, dtype, n),
            lambda n: 32 * round(n) * LOSS_VOCAB + loss_weight,  # whole logits, in fp32 inside the loss, twice
        ),
        Family(
            "optimizer",
            _geometric(1.2e4, grid["max_elements"] * 4, points),
            lambda n: optimizer(device, dtype, n),
            lambda n: 8 * n * d,  # parameters, gradients, two moments and the step's temporaries
        ),
    ]


def sizes_that_fit(family: Family, free_bytes: int | None, share: float = 0.5) -> list[float]:
    """The family's sizes whose workloads fit in `share` of `free_bytes` (None: no bound, a CPU's memory): one
    size is built at a time, and the rest of the free memory is for the allocator's cache and the kernels'
    workspaces."""
    if free_bytes is None:
        return list(family.sizes)
    return [size for size in family.sizes if family.bytes_at(size) <= share * free_bytes]
