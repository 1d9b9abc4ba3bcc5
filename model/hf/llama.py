"""Hugging Face Llama, Qwen2, Qwen3 and Mistral <-> our `arch=llama` model: the config.json fields, both ways. Pure
Python.

The four model types compute the same block (RMSNorm, rotary positions in the rotate-half convention, SwiGLU,
grouped-query attention), and differ in what config.json switches on: Qwen2 adds biases on q, k and v, Qwen3 an
RMSNorm on each head's q and k (and often a head_dim other than hidden_size / heads), Mistral may add a sliding
attention window. What our block does not compute is refused by name. Tensor names need no map beyond
the layer prefix: model/hf/llama_names.py. `LLAMA` is the family (model/hf/family.py).
"""

from model.hf.family import MOE_KEYS, HFFamily
from model.hf.llama_names import HF_LM_HEAD, llama_layer_hf_names

MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral")
ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "mistral": "MistralForCausalLM",
}
ROPE_TYPES = {"default": "none", "llama3": "llama3"}  # HF rope_type -> model.rope_scaling
# Defaults transformers' config classes apply to a key config.json leaves out (every file save_pretrained writes
# has them all; hand-written ones may not).
HF_DEFAULTS = {"rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": False, "hidden_act": "silu"}
MISTRAL_SLIDING_WINDOW = 4096  # MistralConfig's default when config.json has no sliding_window key
# HF's llama3 rope_parameters key -> our model.* field.
LLAMA3_KEYS = {
    "factor": "rope_factor",
    "low_freq_factor": "rope_low_freq_factor",
    "high_freq_factor": "rope_high_freq_factor",
    "original_max_position_embeddings": "rope_original_max_positions",
}


def llama_config_from_hf(hf_config: dict, seq_len: int, where: str = "model.init_from") -> dict:
    """Our model.* fields from a HF Llama, Qwen2, Qwen3 or Mistral config.json dict (seq_len, a training choice, is the
    run's: checked against the sliding window and max_position_embeddings). ValueError starting with `where` (the
    option that named the directory) for a variant our model does not compute."""
    model_type = hf_config.get("model_type")

    def refuse(reason: str) -> ValueError:
        return ValueError(f"{where}: config.json {reason}")

    moe = [key for key in MOE_KEYS if hf_config.get(key)]
    if moe:
        raise refuse(f"{moe[0]}={hf_config[moe[0]]} describes a mixture of experts, which is not supported")
    if model_type not in MODEL_TYPES:
        raise refuse(f"model_type={model_type!r} is not supported: allowed values are gpt2, {', '.join(MODEL_TYPES)}")
    if hf_config.get("quantization_config") is not None:
        raise refuse("quantization_config: quantized weights are not supported; give the unquantized model")

    def get(key: str):
        return hf_config.get(key, HF_DEFAULTS.get(key))

    def positive(key: str) -> int:
        value = hf_config.get(key)
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise refuse(f"{key}={value!r} must be a positive integer")
        return value

    fields = {
        "arch": "llama",
        "n_layer": positive("num_hidden_layers"),
        "n_head": positive("num_attention_heads"),
        "n_embd": positive("hidden_size"),
        "intermediate_size": positive("intermediate_size"),
        "vocab_size": positive("vocab_size"),
        "norm_eps": float(get("rms_norm_eps")),
        "tie_embeddings": bool(get("tie_word_embeddings")),
        "activation": "silu",
        "qkv_bias": model_type == "qwen2",  # Qwen2's attention always has them, the others' never
        "qk_norm": model_type == "qwen3",  # Qwen3's attention always has them, the others' never
        "bias": False,
        "dropout": 0.0,  # the HF block has no dropout on its residual stream (attention_dropout is checked below)
        "hf_model_type": model_type,
    }
    kv_heads = hf_config.get("num_key_value_heads") or fields["n_head"]
    fields["n_kv_head"] = kv_heads if kv_heads != fields["n_head"] else None
    head_dim = hf_config.get("head_dim")
    if head_dim is not None:
        head_dim = positive("head_dim")
    # Written only where the heads do not split the hidden size, so the presets of the others stay as they were.
    fields["head_dim"] = head_dim if head_dim is not None and head_dim * fields["n_head"] != fields["n_embd"] else None
    if get("hidden_act") != "silu":
        raise refuse(f"hidden_act={hf_config['hidden_act']!r} is not supported: only silu (SwiGLU) is")
    for key in ("attention_bias", "mlp_bias"):
        if hf_config.get(key):
            raise refuse(f"{key}=true is not supported: biases are modelled on q, k and v only (Qwen2's)")
    if hf_config.get("attention_dropout"):
        raise refuse(f"attention_dropout={hf_config['attention_dropout']} is not supported: only 0")
    fields.update(_rope_fields(hf_config, refuse))
    _check_window(hf_config, model_type, seq_len, refuse)
    max_positions = hf_config.get("max_position_embeddings")
    if isinstance(max_positions, int) and seq_len > max_positions:
        raise ValueError(
            f"model.seq_len={seq_len} exceeds {where}'s max_position_embeddings={max_positions}: "
            f"train on at most {max_positions} tokens per sequence"
        )
    return fields


def _rope_fields(hf_config: dict, refuse) -> dict:
    """model.rope_* from transformers 5's `rope_parameters` or the older top-level rope_theta + rope_scaling."""
    rope = hf_config.get("rope_parameters") or hf_config.get("rope_scaling") or {}
    if not isinstance(rope, dict):
        raise refuse(f"rope_parameters={rope!r} must be an object")
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise refuse(f"rope type {rope_type!r} is not supported: allowed values are {', '.join(ROPE_TYPES)}")
    theta = rope.get("rope_theta", hf_config.get("rope_theta", HF_DEFAULTS["rope_theta"]))
    fields = {"rope_theta": float(theta), "rope_scaling": ROPE_TYPES[rope_type]}
    if rope_type == "llama3":
        missing = [key for key in LLAMA3_KEYS if key not in rope]
        if missing:
            raise refuse(f"llama3 rope scaling lacks {', '.join(missing)}")
        fields.update({ours: rope[theirs] for theirs, ours in LLAMA3_KEYS.items()})
        fields["rope_factor"] = float(fields["rope_factor"])
    return fields


def _check_window(hf_config: dict, model_type: str, seq_len: int, refuse) -> None:
    """A sliding attention window changes nothing when it spans the whole sequence; a shorter one is refused."""
    if model_type == "mistral":
        window = hf_config.get("sliding_window", MISTRAL_SLIDING_WINDOW)
    elif model_type in ("qwen2", "qwen3") and hf_config.get("use_sliding_window"):
        window = hf_config.get("sliding_window")
    else:
        return
    if window is not None and window < seq_len:
        raise refuse(
            f"sliding_window={window} is shorter than model.seq_len={seq_len}: sliding-window attention is not "
            f"supported; train on at most {window} tokens per sequence"
        )


def hf_model_type(config) -> str:
    """The model_type an export writes: model.hf_model_type, else qwen2 for q, k, v biases (Llama's
    attention_bias would add one on o too), qwen3 for the per-head q, k norms, else llama."""
    if config.hf_model_type:
        return config.hf_model_type
    return "qwen2" if config.qkv_bias else "qwen3" if config.qk_norm else "llama"


def max_positions(config) -> int:
    """config.json's max_position_embeddings for a model trained from scratch (see hf_config_from_llama)."""
    if config.rope_scaling == "llama3":
        return max(config.seq_len, round(config.rope_original_max_positions * config.rope_factor))
    return config.seq_len


def hf_config_from_llama(config) -> dict:
    """A config.json dict that transformers' AutoModelForCausalLM loads for an `arch=llama` GPTConfig, as the model
    type hf_model_type() names. max_position_embeddings is what the model alone says: model.seq_len, or under llama3
    scaling the context the scaling stretches rope_original_max_positions to (x rope_factor) when that is longer,
    which transformers wants above rope_original_max_positions (an export of a run from model.init_from writes the
    source's value instead: harness/hf/export.py)."""
    if config.qkv_bias and config.qk_norm:
        raise ValueError(
            "model.qkv_bias=true with model.qk_norm=true cannot be exported: no Hugging Face model type has both"
        )
    model_type = hf_model_type(config)
    rope = {"rope_type": "default" if config.rope_scaling == "none" else "llama3", "rope_theta": config.rope_theta}
    if config.rope_scaling == "llama3":
        rope.update({theirs: getattr(config, ours) for theirs, ours in LLAMA3_KEYS.items()})
    hf = {
        "model_type": model_type,
        "architectures": [ARCHITECTURES[model_type]],
        "num_hidden_layers": config.n_layer,
        "num_attention_heads": config.n_head,
        "num_key_value_heads": config.kv_heads,
        "head_dim": config.head_size,
        "hidden_size": config.n_embd,
        "intermediate_size": config.intermediate_size,
        "vocab_size": config.vocab_size,
        "max_position_embeddings": max_positions(config),
        "rms_norm_eps": config.norm_eps,
        "hidden_act": "silu",
        "rope_parameters": rope,
        "tie_word_embeddings": config.tie_embeddings,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
    }
    if model_type == "llama":
        hf.update({"attention_bias": False, "mlp_bias": False})
    elif model_type in ("qwen2", "qwen3"):
        hf.update({"use_sliding_window": False, "sliding_window": None})
        if model_type == "qwen3":
            hf["attention_bias"] = False
    else:
        hf["sliding_window"] = None  # MistralConfig's default would be a window of 4096
    return hf


LLAMA = HFFamily(
    arch="llama",
    model_types=MODEL_TYPES,
    config_from_hf=llama_config_from_hf,
    hf_config=hf_config_from_llama,
    # Same (out, in) layout as ours: nothing is transposed.
    layer_names=lambda config, i: {ours: (theirs, False) for ours, theirs in llama_layer_hf_names(config, i).items()},
    # A tied model's lm_head.weight (some checkpoints save it) and older files' rotary buffers: anything else (a
    # bias, a layer, an expert config.json does not declare) the model would silently lack.
    unread_tensor=lambda config, name: (name == HF_LM_HEAD and config.tie_embeddings) or name.endswith(".inv_freq"),
)
