"""GPT-2- and Llama-family decoders in pure PyTorch: no DeepSpeed, Hydra or W&B here."""

from model.config import ACTIVATIONS, ARCHITECTURES, ATTENTION_KERNELS, GPTConfig
from model.gpt import (
    BLOCK_CLASSES,
    FIRST_BLOCK_INDEX,
    GPT,
    TIED_EMBEDDING,
    LayerFn,
    LayerRecipe,
    block_range,
    build_layers,
    gpt_layers,
    head_module,
    head_returns_logits,
    layer_param_counts,
    lm_loss,
    model_param_count,
    module_entries,
)
from model.layers import Block
from model.llama_layers import LlamaBlock, LMHead

__all__ = [
    "ACTIVATIONS",
    "ARCHITECTURES",
    "ATTENTION_KERNELS",
    "GPTConfig",
    "BLOCK_CLASSES",
    "FIRST_BLOCK_INDEX",
    "GPT",
    "TIED_EMBEDDING",
    "LayerFn",
    "LayerRecipe",
    "block_range",
    "build_layers",
    "gpt_layers",
    "head_module",
    "head_returns_logits",
    "layer_param_counts",
    "lm_loss",
    "model_param_count",
    "module_entries",
    "Block",
    "LlamaBlock",
    "LMHead",
]
