"""The layers of the flat Llama-family sequence: token embedding, N blocks, final RMSNorm, and an untied LM head.

Parameter names inside each layer are Hugging Face's (LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM,
MistralForCausalLM), so a weight map renames the layer prefix only (model/hf/llama_names.py). There are no learned
positions: each block's attention rotates q and k (model/rotary.py). Initialisation: N(0, 0.02) everywhere
(transformers' `initializer_range`), unit RMSNorm gains, zero biases; from (seed, layer index) as model/layers.py
does.
"""

import torch
import torch.nn as nn
import torch.nn.functional as F

from model.attention import AttentionCore
from model.config import GPTConfig
from model.kv_cache import KVCache
from model.layers import gpt2_init_, head_logits
from model.rms_norm import RMSNorm
from model.rotary import apply_rotary, rotary_cos_sin
from model.weight_grad import Linear


def llama_init_(module: nn.Module, config: GPTConfig, seed: int, layer_index: int) -> None:
    """N(0, 0.02) for every weight matrix and embedding (no depth scaling, as transformers initialises Llama),
    zero biases; RMSNorm gains stay 1. GPT-2's initialiser with an unscaled output projection: its scaling
    applies only to modules named c_proj, which llama has none of."""
    gpt2_init_(module, config.n_layer, seed, layer_index)


class LlamaEmbedding(nn.Module):
    """Token ids (B, T) -> embeddings (B, T, C). Tied (model.tie_embeddings), its weight is also the LM head."""

    head_weight_name = "embed_tokens.weight"

    def __init__(self, config: GPTConfig, seed: int, layer_index: int = 0):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.n_embd)
        llama_init_(self, config, seed, layer_index)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(idx)  # (B, T, C)

    @property
    def head_weight(self) -> torch.Tensor:
        return self.embed_tokens.weight


class LlamaAttention(nn.Module):
    """Grouped-query self-attention with rotary positions: nh query heads, g key/value heads, hs channels each
    (model.head_dim; q nh * hs wide, which may differ from C); with model.qk_norm, Qwen3's per-head RMSNorm on q and
    k before they are rotated."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        c, q, kv = config.n_embd, config.q_width, config.kv_width
        self.q_proj = Linear(c, q, bias=config.qkv_bias)
        self.k_proj = Linear(c, kv, bias=config.qkv_bias)
        self.v_proj = Linear(c, kv, bias=config.qkv_bias)
        if config.qk_norm:
            self.q_norm = RMSNorm(config.head_size, config.norm_eps)
            self.k_norm = RMSNorm(config.head_size, config.norm_eps)
        self.core = AttentionCore(config)
        self.o_proj = Linear(q, c, bias=False)

    def _heads(self, x: torch.Tensor, start: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x (B, T, C) of positions start .. start + T - 1 -> rotated q (B, nh, T, hs), rotated k and v
        (B, g, T, hs)."""
        B, T, _ = x.shape
        hs = self.config.head_size
        q = self.q_proj(x).view(B, T, -1, hs)  # (B, T, nh, hs)
        k = self.k_proj(x).view(B, T, -1, hs)  # (B, T, g, hs)
        if self.config.qk_norm:  # over each head's hs channels, before the rotation (transformers' Qwen3)
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)  # (B, nh, T, hs), (B, g, T, hs)
        v = self.v_proj(x).view(B, T, -1, hs).transpose(1, 2)  # (B, g, T, hs)
        cos, sin = rotary_cos_sin(self.config, start, T, x.dtype, x.device)  # (T, hs) each
        return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), v

    def _project(self, y: torch.Tensor) -> torch.Tensor:
        B, nh, T, hs = y.shape
        return self.o_proj(y.transpose(1, 2).reshape(B, T, nh * hs))  # (B, T, nh * hs) -> (B, T, C)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._project(self.core(*self._heads(x, 0)))  # (B, T, C)

    def forward_cached(self, x: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """x (B, T, C) of the T positions after those in `cache`, whose keys and values it adds -> (B, T, C)."""
        q, k, v = self._heads(x, cache.length)
        k, v = cache.append(k, v)  # (B, g, cached + T, hs)
        return self._project(self.core.attend_cached(q, k, v))


class _SwiGLUProduct(torch.autograd.Function):
    """silu(gate) * up, keeping only gate and up for backward: silu(gate) is remade there (elementwise), so the MLP
    keeps two f-wide tensors and their product instead of four (autograd's separate ops also keep silu's output)."""

    @staticmethod
    def forward(ctx, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(gate, up)
        return F.silu(gate) * up

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        gate, up = ctx.saved_tensors
        # silu's own fused backward kernel: one pass where the derivative sig (1 + g (1 - sig)) spelt out takes six
        grad_gate = torch.ops.aten.silu_backward(grad * up, gate)
        return grad_gate, grad * F.silu(gate)


class SwiGLU(nn.Module):
    """gate, up (B, T, f) -> silu(gate) * up (B, T, f). No parameters: the product selective recompute may
    discard (`recompute.modules=[mlp_act]`)."""

    def forward(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return _SwiGLUProduct.apply(gate, up)


class LlamaMLP(nn.Module):
    """down(silu(gate(x)) * up(x)): (B, T, C) -> (B, T, C), f = model.intermediate_size wide inside."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        c, f = config.n_embd, config.mlp_width
        self.gate_proj = Linear(c, f, bias=False)
        self.up_proj = Linear(c, f, bias=False)
        self.act = SwiGLU()
        self.down_proj = Linear(f, c, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x), self.up_proj(x)))  # (B, T, C)


class LlamaBlock(nn.Module):
    """Pre-RMSNorm decoder layer: x + self_attn(input_layernorm(x)), then + mlp(post_attention_layernorm(x))."""

    def __init__(self, config: GPTConfig, seed: int, layer_index: int):
        super().__init__()
        self.input_layernorm = RMSNorm(config.n_embd, config.norm_eps)
        self.self_attn = LlamaAttention(config)
        self.post_attention_layernorm = RMSNorm(config.n_embd, config.norm_eps)
        self.mlp = LlamaMLP(config)
        llama_init_(self, config, seed, layer_index)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))  # (B, T, C)

    def forward_cached(self, x: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """forward() for the T positions after those in `cache` (incremental decoding)."""
        x = x + self.self_attn.forward_cached(self.input_layernorm(x), cache)
        return x + self.mlp(self.post_attention_layernorm(x))  # (B, T, C)


class LlamaFinalNorm(nn.Module):
    def __init__(self, config: GPTConfig, seed: int, layer_index: int):
        super().__init__()
        self.norm = RMSNorm(config.n_embd, config.norm_eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x)


class LMHead(nn.Module):
    """The untied LM head (model.tie_embeddings=false), on the last stage alone: final hidden states (B, T, C) ->
    logits (B, T, vocab); under the fused loss (`returns_logits` false) the hidden states pass through and the loss
    makes the logits chunk by chunk from `head_weight`."""

    head_weight_name = "lm_head.weight"

    def __init__(self, config: GPTConfig, seed: int, layer_index: int, returns_logits: bool):
        super().__init__()
        self.lm_head = Linear(config.n_embd, config.vocab_size, bias=False)
        self.returns_logits = returns_logits
        llama_init_(self, config, seed, layer_index)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return head_logits(x, self.lm_head.weight) if self.returns_logits else x

    @property
    def head_weight(self) -> torch.Tensor:
        return self.lm_head.weight
