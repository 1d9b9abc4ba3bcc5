"""A GPT-2-family decoder in pure PyTorch: no DeepSpeed, Hydra or W&B here."""

from model.config import ACTIVATIONS, ATTENTION_KERNELS, GPTConfig
from model.gpt import (
    FIRST_BLOCK_INDEX,
    GPT,
    TIED_EMBEDDING,
    LayerFn,
    LayerRecipe,
    build_layers,
    gpt_layers,
    layer_param_counts,
    lm_loss,
    model_param_count,
    module_entries,
)
from model.layers import Block

__all__ = [
    "ACTIVATIONS",
    "ATTENTION_KERNELS",
    "GPTConfig",
    "FIRST_BLOCK_INDEX",
    "GPT",
    "TIED_EMBEDDING",
    "LayerFn",
    "LayerRecipe",
    "build_layers",
    "gpt_layers",
    "layer_param_counts",
    "lm_loss",
    "model_param_count",
    "module_entries",
    "Block",
]
