"""Hugging Face GPT-2 <-> our `arch=gpt2` GPT: the config fields and the tensor names, both ways. Pure PyTorch
(model/hf/format.py applies them).

HF's GPT2LMHeadModel holds the same weights as our flat layer list, under other names and with its
Conv1D weights stored (in, out) where our nn.Linear stores (out, in). HF names here are written without
the `transformer.` prefix that GPT2LMHeadModel's own state dict adds (the reader accepts both).
"""

from model.config import GPTConfig
from model.gpt import FIRST_BLOCK_INDEX
from model.hf.family import HFFamily

HF_PREFIX = "transformer."
LAYER_NORM_EPS = 1e-5  # our nn.LayerNorm's default, GPT-2's layer_norm_epsilon

# HF activation_function -> model.activation; the first name of each is the one an export writes.
HF_ACTIVATIONS = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu"}
HF_ACTIVATION_OF = {"gelu_tanh": "gelu_new", "gelu": "gelu"}

# Our parameter names inside a Block -> HF's inside `h.{i}`; True where the weight is a Conv1D (transposed).
_BLOCK_NAMES = {
    "ln_1.weight": ("ln_1.weight", False),
    "ln_1.bias": ("ln_1.bias", False),
    "attn.c_attn.weight": ("attn.c_attn.weight", True),
    "attn.c_attn.bias": ("attn.c_attn.bias", False),
    "attn.c_proj.weight": ("attn.c_proj.weight", True),
    "attn.c_proj.bias": ("attn.c_proj.bias", False),
    "ln_2.weight": ("ln_2.weight", False),
    "ln_2.bias": ("ln_2.bias", False),
    "mlp.c_fc.weight": ("mlp.c_fc.weight", True),
    "mlp.c_fc.bias": ("mlp.c_fc.bias", False),
    "mlp.c_proj.weight": ("mlp.c_proj.weight", True),
    "mlp.c_proj.bias": ("mlp.c_proj.bias", False),
}


def gpt_config_from_hf(hf_config: dict, where: str = "model.init_from") -> dict:
    """Our model.* shape fields from a HF GPT-2 config.json dict; ValueError starting with `where` (the option
    that named the directory) for a variant our model does not compute."""

    def refuse(reason: str) -> ValueError:
        return ValueError(f"{where}: {reason}; only GPT-2 (GPT2LMHeadModel) configs map onto this model")

    if not isinstance(hf_config, dict):
        raise refuse(f"config.json holds a {type(hf_config).__name__}, not an object")
    if hf_config.get("model_type", "gpt2") != "gpt2":
        raise refuse(f"config.json model_type={hf_config['model_type']!r}, not 'gpt2'")
    fields = {"n_layer": "n_layer", "n_head": "n_head", "n_embd": "n_embd", "seq_len": "n_positions"}
    fields["vocab_size"] = "vocab_size"
    shape = {}
    for ours, theirs in fields.items():
        value = hf_config.get(theirs)
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise refuse(f"config.json {theirs}={value!r} must be a positive integer")
        shape[ours] = value
    n_inner = hf_config.get("n_inner")
    if n_inner is not None and n_inner != 4 * shape["n_embd"]:
        raise refuse(f"config.json n_inner={n_inner} is not 4 * n_embd = {4 * shape['n_embd']}")
    if hf_config.get("tie_word_embeddings", True) is not True:
        raise refuse("config.json tie_word_embeddings is false; the LM head must be tied to the token embedding")
    eps = hf_config.get("layer_norm_epsilon", LAYER_NORM_EPS)
    if eps != LAYER_NORM_EPS:
        raise refuse(f"config.json layer_norm_epsilon={eps!r}, not {LAYER_NORM_EPS}")
    for flag, wanted in (
        ("scale_attn_weights", True),
        ("scale_attn_by_inverse_layer_idx", False),
        ("reorder_and_upcast_attn", False),
    ):
        if hf_config.get(flag, wanted) is not wanted:
            raise refuse(f"config.json {flag}={hf_config[flag]!r}, only {str(wanted).lower()} is supported")
    activation = hf_config.get("activation_function", "gelu_new")
    if activation not in HF_ACTIVATIONS:
        raise refuse(f"config.json activation_function={activation!r} is not one of {', '.join(HF_ACTIVATIONS)}")
    return {**shape, "arch": "gpt2", "norm_eps": LAYER_NORM_EPS, "activation": HF_ACTIVATIONS[activation], "bias": True}


def hf_config_from_gpt(config: GPTConfig) -> dict:
    """A config.json dict that transformers' GPT2LMHeadModel.from_pretrained loads for `config`."""
    if not config.bias:
        raise ValueError("model.bias=false cannot be exported: Hugging Face GPT-2 always has biases")
    return {
        "model_type": "gpt2",
        "architectures": ["GPT2LMHeadModel"],
        "n_layer": config.n_layer,
        "n_head": config.n_head,
        "n_embd": config.n_embd,
        "n_positions": config.seq_len,
        "vocab_size": config.vocab_size,
        "n_inner": None,
        "activation_function": HF_ACTIVATION_OF[config.activation],
        "layer_norm_epsilon": config.norm_eps,
        "resid_pdrop": config.dropout,
        "embd_pdrop": config.dropout,
        "attn_pdrop": config.dropout,
        "initializer_range": 0.02,
        "scale_attn_weights": True,
        "tie_word_embeddings": True,
    }


def gpt_layer_hf_names(config: GPTConfig, flat_index: int) -> dict[str, tuple[str, bool]]:
    """One flat layer's parameter names -> (HF name, transposed?). The tied LM head (the last entry) is the
    token embedding again, so it reads `wte.weight` too."""
    last_block = FIRST_BLOCK_INDEX + config.n_layer
    if flat_index in (0, last_block + 1):
        return {"wte.weight": ("wte.weight", False)}
    if flat_index == 1:
        return {"wpe.weight": ("wpe.weight", False)}
    if FIRST_BLOCK_INDEX <= flat_index < last_block:
        block = f"h.{flat_index - FIRST_BLOCK_INDEX}."
        return {ours: (block + theirs, transposed) for ours, (theirs, transposed) in _BLOCK_NAMES.items()}
    if flat_index == last_block:
        return {"ln_f.weight": ("ln_f.weight", False), "ln_f.bias": ("ln_f.bias", False)}
    raise IndexError(f"flat layer {flat_index} does not exist in a model of {config.n_layer} blocks")


GPT2 = HFFamily(
    arch="gpt2",
    model_types=("gpt2",),
    config_from_hf=lambda hf_config, seq_len, where: gpt_config_from_hf(hf_config, where),  # n_positions is seq_len
    hf_config=hf_config_from_gpt,
    layer_names=gpt_layer_hf_names,
    file_prefix=HF_PREFIX,
    unread_tensor=lambda config, name: True,  # older files carry attention-mask buffers
)
