"""The layers of the flat GPT sequence: embedding, position embedding, N blocks, final norm.

Each layer initialises its own weights from (seed, layer index), so a layer gets the same weights
whether it is built alone on one pipeline stage or inside the whole unpipelined model.
"""

import math

import torch
import torch.nn as nn

from model.attention import AttentionCore
from model.config import GPTConfig
from model.kv_cache import KVCache
from model.packed_dropout import dropout_layer
from model.weight_grad import Linear, linear

INIT_STD = 0.02


def _layer_generator(seed: int, layer_index: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed * 1_000_003 + layer_index)


def _normal_(tensor: torch.Tensor, std: float, generator: torch.Generator) -> None:
    if tensor.is_meta:  # planning builds layers on the meta device: nothing to fill
        return
    with torch.no_grad():
        tensor.copy_(torch.randn(tensor.shape, generator=generator) * std)


def gpt2_init_(module: nn.Module, n_layer: int, seed: int, layer_index: int) -> None:
    """GPT-2 initialisation: N(0, 0.02) weights, zero biases, unit LayerNorms (their default), and
    residual output projections (`c_proj`) scaled by 1/sqrt(2 n_layer)."""
    generator = _layer_generator(seed, layer_index)
    for name, sub in module.named_modules():
        if isinstance(sub, nn.Linear):
            std = INIT_STD / math.sqrt(2 * n_layer) if name.endswith("c_proj") else INIT_STD
            _normal_(sub.weight, std, generator)
            if sub.bias is not None:
                nn.init.zeros_(sub.bias)
        elif isinstance(sub, nn.Embedding):
            _normal_(sub.weight, INIT_STD, generator)


class TokenEmbedding(nn.Module):
    """Token ids (B, T) -> embeddings (B, T, C). Its weight is also the LM head (tied)."""

    head_weight_name = "wte.weight"

    def __init__(self, config: GPTConfig, seed: int, layer_index: int = 0):
        super().__init__()
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        gpt2_init_(self, config.n_layer, seed, layer_index)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.wte(idx)  # (B, T, C)

    @property
    def head_weight(self) -> torch.Tensor:
        return self.wte.weight


def head_logits(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Hidden states (..., C) -> logits (..., vocab) through the tied weight (vocab, C): the LM head's one matmul,
    for lm_head and the fused loss (model/fused_loss.py) alike. Through model/weight_grad.py's `linear`, so a
    zero-bubble schedule can defer the unfused head's weight gradient."""
    return linear(x, weight)


def lm_head(embedding: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """Final hidden states (B, T, C) -> logits (B, T, vocab) through the tied embedding (its `head_weight`)."""
    return head_logits(x, embedding.head_weight)


def final_hidden(embedding: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The LM head under the fused loss (model.loss_chunk_tokens > 0): the final hidden states (B, T, C) pass
    through, and the loss makes the logits chunk by chunk from the tied weight the stage holds."""
    return x


class PositionEmbedding(nn.Module):
    """Adds learned positions and applies embedding dropout: (B, T, C) -> (B, T, C)."""

    def __init__(self, config: GPTConfig, seed: int, layer_index: int):
        super().__init__()
        self.wpe = nn.Embedding(config.seq_len, config.n_embd)
        self.drop = dropout_layer(config.dropout, config.packed_dropout)
        gpt2_init_(self, config.n_layer, seed, layer_index)

    def forward(self, tok_emb: torch.Tensor, start: int = 0) -> torch.Tensor:
        """`start`: the position of the first token (decoding with a KV cache continues a sequence)."""
        pos = torch.arange(start, start + tok_emb.shape[1], device=tok_emb.device)  # (T,)
        return self.drop(tok_emb + self.wpe(pos))


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.n_head = config.n_head
        self.c_attn = Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.core = AttentionCore(config)
        self.c_proj = Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.resid_dropout = dropout_layer(config.dropout, config.packed_dropout)

    def _heads(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)  # 3 x (B, T, C)
        return tuple(t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))  # (B, nh, T, hs)

    def _project(self, y: torch.Tensor) -> torch.Tensor:
        B, nh, T, hs = y.shape
        y = y.transpose(1, 2).contiguous().view(B, T, nh * hs)  # (B, T, C)
        return self.resid_dropout(self.c_proj(y))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._project(self.core(*self._heads(x)))  # (B, T, C)

    def forward_cached(self, x: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """x (B, T, C) of the T positions after those in `cache`, whose keys and values it adds -> (B, T, C)."""
        q, k, v = self._heads(x)
        k, v = cache.append(k, v)  # (B, nh, cached + T, hs)
        return self._project(self.core.attend_cached(q, k, v))


class MLP(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.c_fc = Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        # Both variants are nn.GELU, which saves only its input: the memory model's bytes hold for either.
        self.act = nn.GELU(approximate="tanh" if config.activation == "gelu_tanh" else "none")
        self.c_proj = Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = dropout_layer(config.dropout, config.packed_dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(self.act(self.c_fc(x))))  # (B, T, C)


class Block(nn.Module):
    """Pre-LayerNorm transformer block: x + attn(ln_1(x)), then + mlp(ln_2(x))."""

    def __init__(self, config: GPTConfig, seed: int, layer_index: int):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, eps=config.norm_eps, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, eps=config.norm_eps, bias=config.bias)
        self.mlp = MLP(config)
        gpt2_init_(self, config.n_layer, seed, layer_index)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))  # (B, T, C)

    def forward_cached(self, x: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """forward() for the T positions after those in `cache` (incremental decoding)."""
        x = x + self.attn.forward_cached(self.ln_1(x), cache)
        return x + self.mlp(self.ln_2(x))  # (B, T, C)


class FinalNorm(nn.Module):
    def __init__(self, config: GPTConfig, seed: int, layer_index: int):
        super().__init__()
        self.ln_f = nn.LayerNorm(config.n_embd, eps=config.norm_eps, bias=config.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ln_f(x)
