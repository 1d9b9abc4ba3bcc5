"""Where each Hugging Face Llama-family tensor lives in our flat layer list, both ways. Pure PyTorch.

LlamaForCausalLM, Qwen2ForCausalLM and MistralForCausalLM name their tensors alike: `model.embed_tokens.weight`,
`model.layers.{i}.<name inside the decoder layer>`, `model.norm.weight` and, untied, `lm_head.weight`. Our layers use
the same names inside each flat entry (model/llama_layers.py), in the same (out, in) layout, so a map renames the
prefix only: no transposes, and rotary embeddings in the same rotate-half convention need no q/k permutation.
"""

import torch

from model.config import GPTConfig
from model.gpt import block_range, gpt_layers

HF_EMBEDDING = "model.embed_tokens.weight"
HF_FINAL_NORM = "model.norm.weight"
HF_LM_HEAD = "lm_head.weight"
HF_LAYER_PREFIX = "model.layers."


def llama_layer_hf_names(config: GPTConfig, flat_index: int) -> dict[str, str]:
    """One flat layer's parameter names -> HF names. A tied LM head (the last entry) is the token embedding again,
    so it reads `model.embed_tokens.weight` too."""
    blocks = block_range(config)
    head = blocks.stop + 1
    if flat_index == 0 or (flat_index == head and config.tie_embeddings):
        return {"embed_tokens.weight": HF_EMBEDDING}
    if flat_index in blocks:
        prefix = f"{HF_LAYER_PREFIX}{flat_index - blocks.start}."
        return {name: prefix + name for name in _block_parameter_names(config)}
    if flat_index == blocks.stop:
        return {"norm.weight": HF_FINAL_NORM}
    if flat_index == head:
        return {"lm_head.weight": HF_LM_HEAD}
    raise IndexError(f"flat layer {flat_index} does not exist in a model of {config.n_layer} blocks")


def flat_index_of(config: GPTConfig, hf_name: str) -> tuple[int, str]:
    """An HF tensor name -> (flat index of the layer that holds it, its name inside that layer). A tied model's
    `lm_head.weight` (some checkpoints save it) is the embedding's. KeyError for a name the model has no place for
    (a bias we do not model, an MoE expert, a layer past n_layer)."""
    blocks = block_range(config)
    if hf_name == HF_EMBEDDING or (hf_name == HF_LM_HEAD and config.tie_embeddings):
        return 0, "embed_tokens.weight"
    if hf_name == HF_FINAL_NORM:
        return blocks.stop, "norm.weight"
    if hf_name == HF_LM_HEAD:
        return blocks.stop + 1, "lm_head.weight"
    if hf_name.startswith(HF_LAYER_PREFIX):
        layer, _, name = hf_name[len(HF_LAYER_PREFIX) :].partition(".")
        if layer.isdigit() and int(layer) < config.n_layer and name in _block_parameter_names(config):
            return blocks.start + int(layer), name
    raise KeyError(f"{hf_name} has no place in a model.arch=llama model of this shape")


def _block_parameter_names(config: GPTConfig) -> list[str]:
    """Parameter names of one decoder layer under `config` (q/k/v biases with qkv_bias), from the block built on
    the meta device, so the map can never disagree with the layer."""
    recipe = gpt_layers(config, seed=0)[block_range(config).start]
    with torch.device("meta"):
        return [name for name, _ in recipe.build().named_parameters()]
