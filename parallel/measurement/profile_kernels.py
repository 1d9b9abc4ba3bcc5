"""The workloads of a device profile: for each curve of parallel/planning/device_profile_file.py's CURVES, a
callable per size that runs that kernel once, on the model's own modules and functions where it has them
(the attention core, the fused and unfused loss, Llama's RMSNorm, rotary embedding and SwiGLU product), so the
profile times what training runs.

Each family returns {curve: {size: workload}}: a size is the curve's x for the tensors the workload holds. A
backward workload reruns the backward of one retained graph (`torch.autograd.grad`, which accumulates nothing),
so it times the backward alone.
"""

from collections.abc import Callable

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


def matmuls(device: str, dtype: torch.dtype, points: int, max_flops: float) -> Workloads:
    """(8c, c) x (c, 2c): a transformer's tokens x width x a multiple of the width."""
    curve = {}
    for flops in _geometric(1e5, max_flops, points):
        c = max(4, round((flops / 32) ** (1 / 3)))
        a = torch.randn(8 * c, c, device=device, dtype=dtype)
        b = torch.randn(c, 2 * c, device=device, dtype=dtype)
        curve[32.0 * c**3] = lambda a=a, b=b: a @ b
    return {"matmul": curve}


def _llama(**fields) -> GPTConfig:
    """A Llama-family config for the workloads of its own modules (the fields they read; the rest valid)."""
    return GPTConfig(arch="llama", activation="silu", bias=False, tie_embeddings=False, intermediate_size=4, **fields)


def elementwise(device: str, dtype: torch.dtype, points: int, max_elements: float) -> Workloads:
    """LayerNorm, GELU, dropout (its RNG included), a residual add, the embedding's gather and scatter; Llama's
    RMSNorm (model/rms_norm.py), rotary embedding (model/rotary.py) and SwiGLU product (model/llama_layers.py)."""
    names = ("layernorm", "gelu", "dropout", "add", "embedding", "rmsnorm", "rotary", "swiglu")
    curves: Workloads = {name: {} for name in names}
    for name in list(curves):
        curves[name + "_backward"] = {}
    curves.pop("add_backward")
    rms_norm = RMSNorm(WIDTH, 1e-5).to(device, dtype)
    swiglu = SwiGLU()
    for elements in _geometric(WIDTH * 8, max_elements, points):
        rows = max(8, round(elements / WIDTH))
        size = float(rows * WIDTH)
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
        for name, forward, inputs in (
            ("layernorm", lambda x=x, w=weight, b=bias: F.layer_norm(x, (WIDTH,), w, b), (x, weight, bias)),
            ("gelu", lambda x=x: F.gelu(x), (x,)),
            ("dropout", lambda x=x: F.dropout(x, 0.1, training=True), (x,)),
            ("embedding", lambda ids=ids, t=table: F.embedding(ids, t), (table,)),
            ("rmsnorm", lambda x=x: rms_norm(x), (x, rms_norm.weight)),
            ("rotary", lambda q=heads, cos=cos, sin=sin: apply_rotary(q, cos, sin), (x,)),
            ("swiglu", lambda gate=x, up=up: swiglu(gate, up), (x, up)),
        ):
            curves[name][size] = forward
            curves[name + "_backward"][size] = _backward(forward(), inputs)
        curves["add"][size] = lambda x=x, y=y: torch.add(x.detach(), y)
    return curves


def attention(device: str, dtype: torch.dtype, points: int, max_seq: int) -> Workloads:
    """model/attention.py's AttentionCore, each kernel with and without dropout, at 4 heads of each of HEAD_SIZES
    over growing sequences (the curve's x is the score elements, b x heads x s x s); and without dropout with
    4 / GQA_GROUPS key/value heads (grouped-query attention: SDPA's enable_gqa, the explicit kernel's repeat)."""
    curves: Workloads = {}
    for seq in sorted({round(s) for s in _geometric(32, max_seq, points)}):
        for head_size in HEAD_SIZES:
            q, k, v = (
                torch.randn(1, 4, seq, head_size, device=device, dtype=dtype, requires_grad=True) for _ in range(3)
            )  # (B, nh, T, hs)
            for kernel in ("sdpa", "math"):
                for dropout in (0.0, 0.1):
                    config = GPTConfig(n_head=4, n_embd=4 * head_size, seq_len=seq, dropout=dropout, attention=kernel)
                    core = AttentionCore(config).to(device).train()
                    name = attention_curve(kernel, bool(dropout), head_size)
                    curves.setdefault(name, {})[4.0 * seq * seq] = lambda core=core, qkv=(q, k, v): core(*qkv)
                    curves.setdefault(name + "_backward", {})[4.0 * seq * seq] = _backward(core(q, k, v), (q, k, v))
                k_g, v_g = (t[:, : 4 // GQA_GROUPS].detach().requires_grad_() for t in (k, v))  # (B, g, T, hs)
                config = _llama(
                    n_head=4, n_kv_head=4 // GQA_GROUPS, n_embd=4 * head_size, seq_len=seq, attention=kernel
                )
                core = AttentionCore(config).to(device).train()
                name = attention_curve(kernel, False, head_size, grouped=True)
                curves.setdefault(name, {})[4.0 * seq * seq] = lambda core=core, qkv=(q, k_g, v_g): core(*qkv)
                backward = _backward(core(q, k_g, v_g), (q, k_g, v_g))
                curves.setdefault(name + "_backward", {})[4.0 * seq * seq] = backward
    return curves


def losses(device: str, dtype: torch.dtype, points: int, max_tokens: int) -> Workloads:
    """The LM head and its loss, fused and chunked (model/fused_loss.py) or over whole logits (model/gpt.py's
    lm_loss), on growing token counts (x: tokens x width x vocabulary)."""
    curves: Workloads = {name: {} for name in ("loss_chunked", "loss_chunked_backward", "loss_unfused")}
    curves["loss_unfused_backward"] = {}
    weight = torch.randn(LOSS_VOCAB, LOSS_WIDTH, device=device, dtype=dtype, requires_grad=True)
    for tokens in sorted({round(t) for t in _geometric(64, max_tokens, points)}):
        hidden = torch.randn(tokens, LOSS_WIDTH, device=device, dtype=dtype, requires_grad=True)  # (N, C)
        labels = torch.randint(LOSS_VOCAB, (tokens,), device=device)
        size = float(tokens * LOSS_WIDTH * LOSS_VOCAB)
        for name, forward in (
            ("loss_chunked", lambda h=hidden, y=labels: chunked_lm_loss(h, weight, y, LOSS_CHUNK)),
            ("loss_unfused", lambda h=hidden, y=labels: lm_loss(head_logits(h, weight), y)),
        ):
            curves[name][size] = forward
            curves[name + "_backward"][size] = _backward(forward(), (hidden, weight))
    return curves


def optimizer(device: str, dtype: torch.dtype, points: int, max_params: float) -> Workloads:
    """torch's AdamW over 12 tensors (a block's weights and biases), as DeepSpeed steps a stage's parameters."""
    curve = {}
    for params in _geometric(1.2e4, max_params, points):
        tensors = [torch.zeros(max(1, round(params / 12)), device=device, dtype=dtype) for _ in range(12)]
        for t in tensors:
            t.requires_grad_()
            t.grad = torch.randn_like(t)
        adamw = torch.optim.AdamW(tensors, lr=1e-6)
        curve[float(sum(t.numel() for t in tensors))] = adamw.step
    return {"adamw": curve}
