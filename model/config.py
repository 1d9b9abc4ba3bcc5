"""GPTConfig: the shape of a decoder of the GPT-2 or the Llama family. Pure Python; validates itself."""

from dataclasses import dataclass

ARCHITECTURES = ("gpt2", "llama")
ATTENTION_KERNELS = ("sdpa", "math")
ACTIVATIONS = ("gelu", "gelu_tanh")
ACTIVATIONS_OF = {"gpt2": ACTIVATIONS, "llama": ("silu",)}
ROPE_SCALINGS = ("none", "llama3")
HF_MODEL_TYPES = {"gpt2": (), "llama": ("llama", "qwen2", "qwen3", "mistral")}  # model.hf_model_type's values per arch


@dataclass
class GPTConfig:
    arch: str = "gpt2"
    """Block architecture: `gpt2` (LayerNorm, learned positions, GELU MLP, tied head) or `llama` (RMSNorm, rotary
    positions, SwiGLU MLP, grouped-query attention, tied or untied head: Llama, Qwen2, Qwen3, Mistral and SmolLM2)."""
    n_layer: int = 4
    """Transformer blocks."""
    n_head: int = 4
    """Attention (query) heads per block; must divide n_embd."""
    n_kv_head: int | None = None
    """Key/value heads (grouped-query attention, llama only): each serves n_head / n_kv_head query heads; must
    divide n_head. null: n_head (multi-head attention)."""
    n_embd: int = 128
    """Hidden size h (channels of the residual stream)."""
    head_dim: int | None = None
    """Channels per attention head (llama only); q is n_head * head_dim wide, k and v n_kv_head * head_dim, and the
    output projection maps n_head * head_dim back to n_embd. null: n_embd / n_head. Qwen3-0.6B: 128, with n_embd
    1024 and 16 heads."""
    seq_len: int = 128
    """Tokens per sequence s (also the number of learned positions under gpt2)."""
    intermediate_size: int | None = None
    """MLP width f. gpt2: null (4 n_embd, the only width it has). llama: required, the width of each of the
    gate and up projections (Llama-3-8B: 14336)."""
    vocab_size: int = 256
    """Vocabulary size."""
    tie_embeddings: bool = True
    """The LM head is the token embedding (tied). false (llama only): an LM head of its own, on the last stage
    alone."""
    norm_eps: float = 1e-5
    """Epsilon of the LayerNorms (gpt2) or RMSNorms (llama)."""
    rope_theta: float = 10000.0
    """Rotary position embedding base (llama)."""
    rope_scaling: str = "none"
    """Rotary frequency scaling (llama): `none` or `llama3` (Llama 3.1's: the rope_* factors below)."""
    rope_factor: float = 8.0
    """llama3 scaling: how much the low frequencies are slowed down."""
    rope_low_freq_factor: float = 1.0
    """llama3 scaling: wavelengths above rope_original_max_positions / this are slowed by rope_factor."""
    rope_high_freq_factor: float = 4.0
    """llama3 scaling: wavelengths below rope_original_max_positions / this are kept; between the two bounds
    the frequency is interpolated."""
    rope_original_max_positions: int = 8192
    """llama3 scaling: the context length the model was first trained at."""
    qkv_bias: bool = False
    """Biases on the query, key and value projections only (llama: Qwen2 has them)."""
    qk_norm: bool = False
    """An RMSNorm over each head's head_dim channels of the queries and of the keys, after their projections and
    before the rotary embedding, eps model.norm_eps (llama: Qwen3 has them, as `q_norm` and `k_norm`)."""
    hf_model_type: str | None = None
    """The Hugging Face model_type export_hf.py writes for model.arch=llama: `llama`, `qwen2` (with qkv_bias, which
    Qwen2 always has), `qwen3` (with qk_norm, which Qwen3 always has, and no qkv_bias) or `mistral`; model.init_from
    sets it from config.json. null: qwen2 with qkv_bias, qwen3 with qk_norm, else llama (gpt2 under
    model.arch=gpt2)."""
    dropout: float = 0.0
    """Dropout probability on embeddings, attention probabilities, and residual branches."""
    bias: bool = True
    """Biases in Linear layers and LayerNorms, as in GPT-2 (llama refuses it: see qkv_bias)."""
    attention: str = "sdpa"
    """Attention kernel: `sdpa` (torch scaled_dot_product_attention, fused where available) or
    `math` (explicit QK^T, fused scaled causal softmax that saves a 16-bit output, dropout, x V)."""
    activation: str = "gelu"
    """MLP activation. gpt2: `gelu` (exact, erf) or `gelu_tanh` (the tanh approximation GPT-2 itself uses, Hugging
    Face's `gelu_new`): real GPT-2 weights need `gelu_tanh`. llama: `silu` (the SwiGLU MLP
    down(silu(gate(x)) * up(x)))."""
    loss_chunk_tokens: int = 128
    """Tokens per chunk of the fused LM head and loss (model/fused_loss.py): the last stage makes the logits and
    their cross-entropy this many tokens at a time, recomputing each chunk's logits in backward, and keeps none of
    the (B, T, vocab) logits. 0: the unfused head (whole logits, an fp32 copy, fp32 log-probabilities kept)."""
    packed_dropout: bool = False
    """Keep dropout masks bit-packed, 8 per byte (model/packed_dropout.py), instead of one mask element per value
    (a byte on CUDA, the input dtype on CPU); on CPU the very masks torch's dropout draws (on CUDA other draws of
    the same stream: docs/memory_floor.md). Embedding, residual and, with attention=math, attention-probability
    dropout (SDPA draws its own mask inside the kernel). A no-op with dropout 0."""
    init_from: str | None = None
    """A local Hugging Face directory to start training from: config.json (model_type gpt2, llama, qwen2, qwen3 or
    mistral) plus model.safetensors or pytorch_model.bin, or a shard index of either. Its config.json sets the
    architecture and shape (gpt2: also seq_len = n_positions; llama: seq_len stays the run's, at most
    max_position_embeddings), its tokenizer.json the run's tokenizer unless data.tokenizer_file or data.tokenizer is
    given (docs/llama.md). Its max_position_embeddings, token ids, generation_config.json and tokenizer files (chat
    template) are recorded in the run and its checkpoints, and export_hf.py writes them back. A dry run needs
    config.json alone. Ignored when the run resumes from a checkpoint. null: initialisation from the seed."""

    def __post_init__(self) -> None:
        for name in ("n_layer", "n_head", "n_embd", "seq_len", "vocab_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"model.{name}={value!r} is invalid: it must be a positive integer")
        if self.arch not in ARCHITECTURES:
            raise ValueError(f"model.arch={self.arch!r} is unknown: allowed values are {', '.join(ARCHITECTURES)}")
        if self.head_dim is None and self.n_embd % self.n_head != 0:
            raise ValueError(
                f"model.n_embd={self.n_embd} is not divisible by model.n_head={self.n_head}: "
                f"choose n_head among the divisors of n_embd (llama: or give model.head_dim)"
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"model.dropout={self.dropout} is invalid: it must be in [0, 1)")
        if not isinstance(self.loss_chunk_tokens, int) or self.loss_chunk_tokens < 0:
            raise ValueError(
                f"model.loss_chunk_tokens={self.loss_chunk_tokens!r} is invalid: allowed values are 0 (the unfused "
                "LM head and loss) or a positive number of tokens per chunk of the fused loss"
            )
        if self.attention not in ATTENTION_KERNELS:
            raise ValueError(
                f"model.attention={self.attention!r} is unknown: allowed values are {', '.join(ATTENTION_KERNELS)}"
            )
        allowed = ACTIVATIONS_OF[self.arch]
        if self.activation not in allowed:
            known = any(self.activation in names for names in ACTIVATIONS_OF.values())
            problem = f"is invalid with model.arch={self.arch}" if known else "is unknown"
            raise ValueError(f"model.activation={self.activation!r} {problem}: allowed values are {', '.join(allowed)}")
        if self.norm_eps <= 0:
            raise ValueError(f"model.norm_eps={self.norm_eps} is invalid: it must be > 0")
        if self.arch == "gpt2":
            self._check_gpt2()
        else:
            self._check_llama()
        self._check_hf_model_type()

    def _check_hf_model_type(self) -> None:
        allowed = HF_MODEL_TYPES[self.arch]
        if self.hf_model_type is not None and self.hf_model_type not in allowed:
            raise ValueError(
                f"model.hf_model_type={self.hf_model_type!r} is invalid with model.arch={self.arch}: allowed values "
                f"are {', '.join(allowed) or 'null'}"
            )
        if self.hf_model_type is not None and (self.hf_model_type == "qwen2") != self.qkv_bias:
            raise ValueError(
                f"model.hf_model_type={self.hf_model_type} with model.qkv_bias={self.qkv_bias}: Qwen2 has biases on "
                "q, k and v, Llama, Qwen3 and Mistral none; set both to match, or model.hf_model_type=null"
            )
        if self.hf_model_type is not None and (self.hf_model_type == "qwen3") != self.qk_norm:
            raise ValueError(
                f"model.hf_model_type={self.hf_model_type} with model.qk_norm={self.qk_norm}: Qwen3 normalises q and "
                "k per head, Llama, Qwen2 and Mistral do not; set both to match, or model.hf_model_type=null"
            )

    def _check_gpt2(self) -> None:
        """The llama-only options keep their defaults: GPT-2's block has none of them."""
        if self.n_kv_head not in (None, self.n_head):
            raise ValueError(
                f"model.n_kv_head={self.n_kv_head} is invalid with model.arch=gpt2 (no grouped-query attention): "
                "use null, or model.arch=llama"
            )
        if self.intermediate_size not in (None, 4 * self.n_embd):
            raise ValueError(
                f"model.intermediate_size={self.intermediate_size} is invalid with model.arch=gpt2, whose MLP is "
                f"4 n_embd = {4 * self.n_embd} wide: use null, or model.arch=llama"
            )
        if self.head_dim is not None:
            raise ValueError(
                f"model.head_dim={self.head_dim} is invalid with model.arch=gpt2 (heads split n_embd): use null, or "
                "model.arch=llama"
            )
        for name in ("qkv_bias", "qk_norm", "tie_embeddings"):
            if getattr(self, name) != (name == "tie_embeddings"):
                raise ValueError(
                    f"model.{name}={getattr(self, name)} is invalid with model.arch=gpt2: "
                    "it is a model.arch=llama option"
                )

    def _check_llama(self) -> None:
        if self.n_kv_head is not None and (
            not isinstance(self.n_kv_head, int) or self.n_kv_head <= 0 or self.n_head % self.n_kv_head
        ):
            raise ValueError(
                f"model.n_head={self.n_head} is not divisible by model.n_kv_head={self.n_kv_head}: choose n_kv_head "
                "among the divisors of n_head (null: n_head)"
            )
        if not isinstance(self.intermediate_size, int) or self.intermediate_size <= 0:
            raise ValueError(
                f"model.intermediate_size={self.intermediate_size!r} is invalid with model.arch=llama: give the "
                "SwiGLU MLP width f as a positive integer (Llama-3-8B: 14336)"
            )
        if self.bias:
            raise ValueError(
                "model.bias=true is invalid with model.arch=llama (no biases outside q, k and v): set "
                "model.bias=false, and model.qkv_bias=true for biases on the q, k and v projections"
            )
        if self.dropout or self.packed_dropout:
            raise ValueError(
                f"model.dropout={self.dropout} / model.packed_dropout={self.packed_dropout} are invalid with "
                "model.arch=llama, whose blocks have no dropout: set model.dropout=0 and model.packed_dropout=false"
            )
        if self.head_dim is not None and (not isinstance(self.head_dim, int) or self.head_dim <= 0):
            raise ValueError(f"model.head_dim={self.head_dim!r} is invalid: give a positive integer, or null")
        if self.head_size % 2:
            what = "model.head_dim" if self.head_dim is not None else "model.n_embd / model.n_head"
            raise ValueError(f"{what} = {self.head_size} is odd: rotary embeddings rotate pairs of channels")
        if self.rope_theta <= 0:
            raise ValueError(f"model.rope_theta={self.rope_theta} is invalid: it must be > 0")
        if self.rope_scaling not in ROPE_SCALINGS:
            raise ValueError(
                f"model.rope_scaling={self.rope_scaling!r} is unknown: allowed values are {', '.join(ROPE_SCALINGS)}"
            )
        if self.rope_scaling == "llama3" and not (
            self.rope_factor > 0
            and 0 < self.rope_low_freq_factor < self.rope_high_freq_factor
            and self.rope_original_max_positions > 0
        ):
            raise ValueError(
                f"model.rope_factor={self.rope_factor}, model.rope_low_freq_factor={self.rope_low_freq_factor}, "
                f"model.rope_high_freq_factor={self.rope_high_freq_factor}, model.rope_original_max_positions="
                f"{self.rope_original_max_positions} are invalid for rope_scaling=llama3: all must be > 0 and "
                "rope_low_freq_factor < rope_high_freq_factor"
            )

    @property
    def head_size(self) -> int:
        """Channels per head hs: head_dim, or n_embd / n_head when null."""
        return self.head_dim or self.n_embd // self.n_head

    @property
    def q_width(self) -> int:
        """Channels of the queries (and of the attention output): nh * hs, n_embd unless head_dim says otherwise."""
        return self.n_head * self.head_size

    @property
    def kv_heads(self) -> int:
        """Key/value heads g: n_kv_head, or n_head when null."""
        return self.n_kv_head or self.n_head

    @property
    def kv_width(self) -> int:
        """Channels of the keys (and of the values): g * hs."""
        return self.kv_heads * self.head_size

    @property
    def mlp_width(self) -> int:
        """MLP width f: intermediate_size, or 4 n_embd under gpt2."""
        return self.intermediate_size or 4 * self.n_embd
