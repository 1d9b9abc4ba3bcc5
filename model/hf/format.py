"""Hugging Face's formats for every family: config.json <-> model.* fields, and our flat layers' state dicts <-> a
Hugging Face state dict. Dispatches to the families in FAMILIES (model/hf/family.py's protocol): config.json's
model_type picks one when reading, model.arch when writing. Pure PyTorch.

Tensor names are those of the HF file without a family's file prefix (GPT-2's `transformer.`): the reader accepts
both, an export writes it.
"""

from collections.abc import Callable
from dataclasses import fields

import torch

from model.config import GPTConfig
from model.gpt import gpt_layers
from model.hf.family import MOE_KEYS, HFFamily
from model.hf.gpt2 import GPT2
from model.hf.llama import LLAMA

FAMILIES = (GPT2, LLAMA)
FAMILY_OF_TYPE = {model_type: family for family in FAMILIES for model_type in family.model_types}
FILE_PREFIXES = tuple(family.file_prefix for family in FAMILIES if family.file_prefix)

# The model.* fields a config.json decides, under either architecture: those it does not give keep their defaults
# (so a llama preset's n_kv_head does not outlive model.init_from of a GPT-2). seq_len and dropout are the run's.
ARCH_FIELDS = (
    "arch",
    "n_layer",
    "n_head",
    "n_kv_head",
    "n_embd",
    "head_dim",
    "intermediate_size",
    "vocab_size",
    "tie_embeddings",
    "norm_eps",
    "rope_theta",
    "rope_scaling",
    "rope_factor",
    "rope_low_freq_factor",
    "rope_high_freq_factor",
    "rope_original_max_positions",
    "qkv_bias",
    "qk_norm",
    "bias",
    "activation",
    "hf_model_type",
)


def config_from_hf(hf_config: dict, seq_len: int, where: str = "model.init_from") -> dict:
    """Our model.* fields from a config.json dict of any supported model_type (none given: gpt2, as old GPT-2 files
    have it); `seq_len` is the run's, which a Llama-family config only bounds. ValueError starting with `where`."""
    if not isinstance(hf_config, dict):
        raise ValueError(f"{where}: config.json holds a {type(hf_config).__name__}, not an object")
    model_type = hf_config.get("model_type", "gpt2")
    if model_type not in FAMILY_OF_TYPE:
        moe = [key for key in MOE_KEYS if hf_config.get(key)]
        reason = (
            f"{moe[0]}={hf_config[moe[0]]} describes a mixture of experts, which is not supported"
            if moe
            else f"model_type={model_type!r} is not supported: allowed values are {', '.join(FAMILY_OF_TYPE)}"
        )
        raise ValueError(f"{where}: config.json {reason}")
    given = FAMILY_OF_TYPE[model_type].config_from_hf(hf_config, seq_len, where)
    defaults = {f.name: f.default for f in fields(GPTConfig) if f.name in ARCH_FIELDS}
    return {**defaults, **given}


def family_of(config: GPTConfig) -> HFFamily:
    """The family that reads and writes models of config.arch."""
    return next(family for family in FAMILIES if family.arch == config.arch)


def hf_config_from_model(config: GPTConfig) -> dict:
    """A config.json dict that transformers' AutoModelForCausalLM loads for `config`, without token ids."""
    return family_of(config).hf_config(config)


def layer_hf_names(config: GPTConfig, flat_index: int) -> dict[str, tuple[str, bool]]:
    """One flat layer's parameter names -> (HF name, stored transposed?); only GPT-2's Conv1D weights are."""
    return family_of(config).layer_names(config, flat_index)


def layer_state_from_hf(config: GPTConfig, flat_index: int, get: Callable[[str], torch.Tensor]) -> dict:
    """One flat layer's state dict, reading only its own HF tensors through `get(hf_name)`."""
    state = {}
    for ours, (theirs, transposed) in layer_hf_names(config, flat_index).items():
        tensor = get(theirs)
        state[ours] = tensor.t().contiguous() if transposed else tensor
    return state


def hf_state_from_layers(config: GPTConfig, layer_states: dict[int, dict[str, torch.Tensor]]) -> dict:
    """Our per-flat-layer state dicts -> the HF model's state dict as its file holds it (GPT-2's `transformer.`
    names, Conv1D weights transposed back). A tied LM head is left out, as HF's own save_pretrained does."""
    prefix = family_of(config).file_prefix
    state = {}
    for flat_index, layer_state in layer_states.items():
        for ours, (theirs, transposed) in layer_hf_names(config, flat_index).items():
            tensor = layer_state[ours]
            state[prefix + theirs] = tensor.t().contiguous() if transposed else tensor
    return state


def hf_shapes(config: GPTConfig) -> dict[str, tuple[int, ...]]:
    """Every HF tensor name the model reads -> its shape in the HF file, from our layers built on the meta device
    (so the two can never disagree)."""
    shapes = {}
    built: dict[type, dict[str, torch.Size]] = {}
    with torch.device("meta"):
        for flat_index, recipe in enumerate(gpt_layers(config, seed=0)):
            # Blocks of one class have one shape: build each class once (80 blocks of llama3-70b take seconds).
            if recipe.module_class not in built:
                built[recipe.module_class] = {n: p.shape for n, p in recipe.build().named_parameters()}
            params = built[recipe.module_class]
            for ours, (theirs, transposed) in layer_hf_names(config, flat_index).items():
                shape = tuple(params[ours])
                shapes[theirs] = shape[::-1] if transposed else shape
    return shapes
