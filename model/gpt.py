"""The GPT as a flat sequence of layers, and that sequence run in one process.

Flat sequence: [token embedding, position embedding, block 0 .. block N-1, final norm, LM head].
The LM head is the token embedding module again (tied), called through `lm_head`.
"""
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from model.config import GPTConfig
from model.layers import Block, FinalNorm, PositionEmbedding, TokenEmbedding, lm_head

TIED_EMBEDDING = "embedding"
FIRST_BLOCK_INDEX = 2  # after the token and position embeddings


@dataclass(frozen=True)
class LayerRecipe:
    """How to build one entry of the flat sequence."""

    module_class: type
    args: tuple
    tie_key: Optional[str] = None
    """Entries with the same key share one module (and its weights)."""
    forward_fn: Optional[Callable] = None
    """Called as forward_fn(module, x) instead of module(x)."""

    def build(self) -> nn.Module:
        return self.module_class(*self.args)


def gpt_layers(config: GPTConfig, seed: int) -> list[LayerRecipe]:
    blocks = [LayerRecipe(Block, (config, seed, FIRST_BLOCK_INDEX + i)) for i in range(config.n_layer)]
    return [
        LayerRecipe(TokenEmbedding, (config, seed, 0), tie_key=TIED_EMBEDDING),
        LayerRecipe(PositionEmbedding, (config, seed, 1)),
        *blocks,
        LayerRecipe(FinalNorm, (config, seed, FIRST_BLOCK_INDEX + config.n_layer)),
        LayerRecipe(TokenEmbedding, (config, seed, 0), tie_key=TIED_EMBEDDING, forward_fn=lm_head),
    ]


def lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy: logits (B, T, V), labels (B, T)."""
    return F.cross_entropy(logits.float().view(-1, logits.size(-1)), labels.view(-1))


class GPT(nn.Module):
    """The whole flat sequence in one process (no pipeline): the reference the pipeline must match."""

    def __init__(self, config: GPTConfig, seed: int):
        super().__init__()
        self.config = config
        self.layers = nn.ModuleList()
        self.forward_funcs: list[Callable[[torch.Tensor], torch.Tensor]] = []
        tied: dict[str, nn.Module] = {}
        for recipe in gpt_layers(config, seed):
            if recipe.tie_key in tied:
                module = tied[recipe.tie_key]
            else:
                module = recipe.build()
                self.layers.append(module)
                if recipe.tie_key:
                    tied[recipe.tie_key] = module
            fn = module if recipe.forward_fn is None else (lambda x, m=module, f=recipe.forward_fn: f(m, x))
            self.forward_funcs.append(fn)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = idx  # (B, T) token ids, then (B, T, C), finally (B, T, vocab) logits
        for fn in self.forward_funcs:
            x = fn(x)
        return x
