"""What a plan is for, as values: the device and precision (`Target`, with what a compiled block keeps under
train.compile: `CompiledBlocks`), the process grid (`Topology`), the batch and optimizer sharding around it
(`RunShape`), and one micro-batch through the model (`Shape`).

The first stop of planning: memory_model, flops and schedule read these; nothing here reads them back.
"""

from dataclasses import dataclass

import torch

from model import GPTConfig

MIB = 1024**2
GIB = 1024**3
DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
PLAN_DEVICES = ("cpu", "cuda")
FP32 = 4


def gib_text(n: float) -> str:
    """Bytes `n` in GiB as the dry run prints them: three decimals below 10 GiB, one above."""
    return f"{n / GIB:.3f}" if n < 10 * GIB else f"{n / GIB:.1f}"


@dataclass(frozen=True)
class Target:
    """The device and precision a run uses (what really runs: no `auto` here)."""

    device: str
    precision: str
    compiled: "CompiledBlocks | None" = None
    """train.compile: what one compiled block keeps and its backward's working set, measured per option at the run's
    shape (parallel/measurement/compiled_bytes.py), which the memory model counts instead of eager autograd's items;
    None: the blocks run eagerly."""

    def __post_init__(self) -> None:
        if self.device not in PLAN_DEVICES:
            raise ValueError(f"train.device={self.device!r} cannot be planned: allowed values are cpu, cuda")
        if self.precision not in DTYPE_BYTES:
            raise ValueError(
                f"train.precision={self.precision!r} cannot be planned: allowed values are {', '.join(DTYPE_BYTES)}"
            )

    @property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES[self.precision]

    @property
    def torch_dtype(self) -> torch.dtype:
        return TORCH_DTYPES[self.precision]

    @property
    def mask_bytes(self) -> int:
        """Dropout mask: CUDA's fused dropout keeps a bool mask; CPU's multiplies by a noise tensor of
        the input dtype and keeps that."""
        return 1 if self.device == "cuda" else self.dtype_bytes

    @property
    def ln_stat_bytes(self) -> int:
        """LayerNorm mean and rstd: fp32 on CUDA, the input dtype on CPU (measured)."""
        return FP32 if self.device == "cuda" else self.dtype_bytes


@dataclass(frozen=True)
class Topology:
    """Ranks as pipeline stages x data-parallel replicas."""

    pipeline_stages: int
    data_parallel_size: int = 1

    @property
    def world_size(self) -> int:
        return self.pipeline_stages * self.data_parallel_size

    def as_dict(self) -> dict[str, int]:
        """For summary.json and W&B's run config."""
        return {
            "world_size": self.world_size,
            "pipeline_stages": self.pipeline_stages,
            "data_parallel_size": self.data_parallel_size,
        }


@dataclass(frozen=True)
class RunShape:
    """Everything outside the model and recompute configs that a plan depends on."""

    topology: Topology
    target: Target
    micro_batches: int
    """Per step and data-parallel rank."""
    micro_batch_size: int
    zero_stage: int = 0
    grad_clip: float = 1.0
    """train.grad_clip (0: no clipping). Clipping all-reduces the gradient norm over every stage inside the optimizer
    step: no stage steps before the slowest has reached its own step (step_sim.simulate's `clip_barrier`)."""

    def tokens_per_step(self, seq_len: int) -> int:
        return self.micro_batches * self.micro_batch_size * seq_len * self.topology.data_parallel_size


@dataclass(frozen=True)
class Shape:
    """One micro-batch through the model: b sequences of s tokens, width h, a heads, vocabulary V."""

    b: int
    s: int
    h: int
    a: int
    vocab: int
    dropout: bool
    attention: str
    loss_chunk_tokens: int = 0
    """model.loss_chunk_tokens: 0 is the unfused LM head and loss (whole logits)."""
    packed_dropout: bool = False
    """model.packed_dropout: dropout masks kept 8 per byte."""
    arch: str = "gpt2"
    """model.arch: which block (memory_model's items, flops' matmuls)."""
    g: int = 0
    """Key/value heads (model.n_kv_head); 0: a."""
    f: int = 0
    """MLP width (model.intermediate_size); 0: 4h."""
    tied: bool = True
    """model.tie_embeddings: the LM head is the token embedding (one tied all-reduce between the end stages)."""
    hd: int = 0
    """Channels per head (model.head_dim); 0: h / a."""
    qk_norm: bool = False
    """model.qk_norm: an RMSNorm on each head's q and k (Qwen3)."""

    @classmethod
    def of(cls, model: GPTConfig, micro_batch_size: int) -> "Shape":
        return cls(
            micro_batch_size,
            model.seq_len,
            model.n_embd,
            model.n_head,
            model.vocab_size,
            model.dropout > 0,
            model.attention,
            model.loss_chunk_tokens,
            model.packed_dropout,
            model.arch,
            model.kv_heads,
            model.mlp_width,
            model.tie_embeddings,
            model.head_dim or 0,
            model.qk_norm,
        )

    @property
    def bsh(self) -> int:
        return self.b * self.s * self.h

    @property
    def kv_width(self) -> int:
        """Channels of k (and of v): g hs."""
        return (self.g or self.a) * self.head_size

    @property
    def q_width(self) -> int:
        """Channels of q and of the attention output: a hs, h unless model.head_dim says otherwise."""
        return self.a * self.head_size

    @property
    def mlp_width(self) -> int:
        return self.f or 4 * self.h

    @property
    def head_size(self) -> int:
        return self.hd or self.h // self.a

    @property
    def scores(self) -> int:
        """Attention-score elements b * a * s * s."""
        return self.b * self.a * self.s * self.s


@dataclass(frozen=True)
class CompiledBlocks:
    """What one compiled block (train.compile) keeps for backward and what its backward holds beyond that, per
    selective option, measured by compiling a block at one micro-batch shape and precision: AOTAutograd's partitioner
    chooses what a compiled graph saves (it recomputes cheap ops on its own), so no count of eager autograd's saved
    tensors gives them. Bytes are per micro-batch; an option or a shape that was not measured is an error where it is
    read, never eager autograd's figure."""

    shape: Shape
    """The micro-batch shape the blocks were measured at."""
    precision: str
    kept: tuple[tuple[tuple[str, ...], int], ...]
    """(the option's modules, sorted by option_key, () for none; the bytes one block keeps), per option."""
    working: tuple[tuple[tuple[str, ...], int], ...]
    """(modules; the most the block's backward holds beyond what it keeps and its output gradient), per option."""
    shared: int = 0
    """Saved by every compiled block from one storage the process held before any block ran (Llama's rotary angles
    table, which a compiled graph keeps where eager keeps each block's cos and sin): counted once per stage, not in
    `kept`."""

    @property
    def options(self) -> tuple[tuple[str, ...], ...]:
        return tuple(modules for modules, _ in self.kept)

    def kept_bytes(self, shape: Shape, precision: str, modules: tuple[str, ...]) -> int:
        return self._measured(self.kept, shape, precision, modules)

    def working_bytes(self, shape: Shape, precision: str, modules: tuple[str, ...]) -> int:
        return self._measured(self.working, shape, precision, modules)

    def _measured(self, table, shape: Shape, precision: str, modules: tuple[str, ...]) -> int:
        if (shape, precision) != (self.shape, self.precision):
            raise ValueError(
                f"compiled blocks were measured at {self.shape} in {self.precision}, not at {shape} in {precision}: "
                "a compiled block's bytes are known only where they were measured"
            )
        key = option_key(modules)
        for option, value in table:
            if option == key:
                return value
        raise ValueError(
            f"no compiled block was measured with recompute.modules={list(key)} (measured: {self.options})"
        )


def option_key(modules) -> tuple[str, ...]:
    """A selective option's modules in one order (recompute.modules may list them in any)."""
    return tuple(sorted(modules))
