"""The one protocol each Hugging Face family module implements (model/hf/gpt2.py, model/hf/llama.py): what
model/hf/format.py needs to read that family's config.json and tensors and to write them back, as torchtitan's
state-dict adapters give `from_hf` / `to_hf` per model. Pure Python.

Adding a family: a module here that builds its `HFFamily`, and its entry in format.py's FAMILIES (and, where the
family needs a block of its own, its layers in model/).
"""

from collections.abc import Callable
from dataclasses import dataclass

from model.config import GPTConfig

# config.json keys that mean a mixture of experts (Mixtral, Qwen2-MoE, DeepSeek, ...), in any family.
MOE_KEYS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_intermediate_size")


def _reads_every_tensor(config: GPTConfig, name: str) -> bool:
    return False


@dataclass(frozen=True)
class HFFamily:
    arch: str
    """The model.arch its models build."""
    model_types: tuple[str, ...]
    """The config.json model_types it reads, and writes back (model.hf_model_type)."""
    config_from_hf: Callable[[dict, int, str], dict]
    """(config.json as a dict, the run's seq_len, the option that named the directory) -> the model.* fields it
    decides; ValueError starting with that option for what the model does not compute."""
    hf_config: Callable[[GPTConfig], dict]
    """A model config -> the config.json dict transformers' AutoModelForCausalLM loads, without token ids."""
    layer_names: Callable[[GPTConfig, int], dict[str, tuple[str, bool]]]
    """One flat layer's parameter names -> (HF name, stored transposed?)."""
    file_prefix: str = ""
    """Written before every tensor name in the files HF saves (GPT-2's `transformer.`); readers strip it."""
    unread_tensor: Callable[[GPTConfig, str], bool] = _reads_every_tensor
    """A tensor a file may hold that the model does not read (GPT-2's attention-mask buffers, a tied head's copy):
    any other tensor the model has no place for is refused at start-up."""
