"""The GPT of the peer benchmark as a pipeline user writes it (nanoGPT's modules), apart from stagecheck's model/.

bench/pipeline_peers.py's peers (plain DeepSpeed and torch.distributed.pipelining) build their layers from here:
plain `nn.Linear`, `nn.LayerNorm`, `nn.GELU`, nanoGPT's attention (its "manual" path, explicit QK^T, masked softmax,
dropout and x V, for stagecheck's `model.attention=math`; `F.scaled_dot_product_attention` for `sdpa`), the full
logits and `F.cross_entropy` as the loss. Only the initial weights come from stagecheck: each layer copies the state
of stagecheck's layer at the same position (model/layers.py seeds each from (seed, layer index)), so every
configuration of the benchmark starts from the same weights; the parameter names are nanoGPT's, which are also
stagecheck's, so the copy is a strict `load_state_dict`.
"""

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from model import GPTConfig
from model.gpt import FIRST_BLOCK_INDEX, gpt_layers


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.n_head, self.dropout, self.sdpa = cfg.n_head, cfg.dropout, cfg.attention == "sdpa"
        self.c_attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=cfg.bias)
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.attn_dropout = nn.Dropout(cfg.dropout)
        self.resid_dropout = nn.Dropout(cfg.dropout)
        mask = torch.tril(torch.ones(cfg.seq_len, cfg.seq_len)).view(1, 1, cfg.seq_len, cfg.seq_len)
        self.register_buffer("causal_mask", mask, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))  # (B, nh, T, hs)
        if self.sdpa:
            p = self.dropout if self.training else 0.0
            y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
        else:
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))  # (B, nh, T, T)
            att = att.masked_fill(self.causal_mask[:, :, :T, :T] == 0, float("-inf"))
            y = self.attn_dropout(F.softmax(att, dim=-1)) @ v  # (B, nh, T, hs)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.c_fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd, bias=cfg.bias)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig, seed: int, index: int):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.mlp = MLP(cfg)
        self.load_state_dict(stagecheck_state(cfg, seed, FIRST_BLOCK_INDEX + index))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))  # (B, T, C)


class TokenEmbedding(nn.Module):
    """Token ids (B, T) -> (B, T, C); also the LM head where the pipeline ties it (`head`)."""

    def __init__(self, cfg: GPTConfig, seed: int):
        super().__init__()
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.load_state_dict(stagecheck_state(cfg, seed, 0))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.wte(idx)

    def head(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.wte.weight)  # (B, T, vocab)


class PositionEmbedding(nn.Module):
    def __init__(self, cfg: GPTConfig, seed: int):
        super().__init__()
        self.wpe = nn.Embedding(cfg.seq_len, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)
        self.load_state_dict(stagecheck_state(cfg, seed, 1))

    def forward(self, tok: torch.Tensor) -> torch.Tensor:
        return self.drop(tok + self.wpe(torch.arange(tok.size(1), device=tok.device)))


class FinalNorm(nn.Module):
    def __init__(self, cfg: GPTConfig, seed: int):
        super().__init__()
        self.ln_f = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.load_state_dict(stagecheck_state(cfg, seed, FIRST_BLOCK_INDEX + cfg.n_layer))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ln_f(x)


class UntiedHead(nn.Module):
    """The final norm and an LM head of its own, starting from the token embedding's weight: a pipeline whose
    first and last stages do not share the tied weight (torchtitan's models tie none)."""

    def __init__(self, cfg: GPTConfig, seed: int):
        super().__init__()
        self.norm = FinalNorm(cfg, seed)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.lm_head.load_state_dict({"weight": stagecheck_state(cfg, seed, 0)["wte.weight"]})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(x))  # (B, T, vocab)


def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.view(-1, logits.size(-1)), labels.view(-1))  # (B, T, vocab), (B, T)


def stagecheck_state(cfg: GPTConfig, seed: int, flat_index: int) -> dict[str, torch.Tensor]:
    """The initial state of stagecheck's layer `flat_index` (token embedding, position embedding, blocks, final
    norm) for seed `seed`."""
    return gpt_layers(cfg, seed)[flat_index].build().state_dict()
