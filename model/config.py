"""GPTConfig: the shape of a GPT-2-family decoder. Pure Python; validates itself."""

from dataclasses import dataclass

ATTENTION_KERNELS = ("sdpa", "math")
ACTIVATIONS = ("gelu", "gelu_tanh")


@dataclass
class GPTConfig:
    n_layer: int = 4
    """Transformer blocks."""
    n_head: int = 4
    """Attention heads per block; must divide n_embd."""
    n_embd: int = 128
    """Hidden size h (channels of the residual stream)."""
    seq_len: int = 128
    """Tokens per sequence s (also the number of learned positions)."""
    vocab_size: int = 256
    """Vocabulary size; the LM head is tied to the token embedding."""
    dropout: float = 0.0
    """Dropout probability on embeddings, attention probabilities, and residual branches."""
    bias: bool = True
    """Biases in Linear layers and LayerNorms, as in GPT-2."""
    attention: str = "sdpa"
    """Attention kernel: `sdpa` (torch scaled_dot_product_attention, fused where available) or
    `math` (explicit QK^T, fused scaled causal softmax that saves a 16-bit output, dropout, x V)."""
    activation: str = "gelu"
    """MLP activation: `gelu` (exact, erf) or `gelu_tanh` (the tanh approximation GPT-2 itself uses, Hugging
    Face's `gelu_new`): real GPT-2 weights need `gelu_tanh`."""
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
    """A local Hugging Face GPT-2 directory (config.json plus model.safetensors or pytorch_model.bin) to start
    training from; its config.json sets n_layer, n_head, n_embd, seq_len, vocab_size, activation and bias.
    Ignored when the run resumes from a checkpoint. null: GPT-2 initialisation from the seed."""

    def __post_init__(self) -> None:
        for name in ("n_layer", "n_head", "n_embd", "seq_len", "vocab_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"model.{name}={value!r} is invalid: it must be a positive integer")
        if self.n_embd % self.n_head != 0:
            raise ValueError(
                f"model.n_embd={self.n_embd} is not divisible by model.n_head={self.n_head}: "
                f"choose n_head among the divisors of n_embd"
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
        if self.activation not in ACTIVATIONS:
            raise ValueError(
                f"model.activation={self.activation!r} is unknown: allowed values are {', '.join(ACTIVATIONS)}"
            )

    @property
    def head_size(self) -> int:
        return self.n_embd // self.n_head
