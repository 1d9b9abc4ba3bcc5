"""Analytic activation memory: the bytes autograd keeps for backward, per layer and per stage.

Pure arithmetic derived from this code (model/layers.py, model/attention.py, parallel/runtime/recompute.py)
and the kernels it calls; docs/activation_model.md derives every item and compares it with
Korthikanti et al. 2022. `parallel/measurement/activation_meter.py` measures the same quantity, and tests hold
the two equal.

What is counted, per micro-batch and stage: every distinct storage kept for backward by the stage's
forward (and, on the last stage, by the loss), parameters excluded. That includes the stage input
(the clone DeepSpeed's forward makes of its pipe buffer, saved by the first layer or held by a
checkpoint), but not DeepSpeed's pipe buffers themselves (see `pipe_buffer_bytes`).
"""

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import combinations

from model import BLOCK_CLASSES, LayerRecipe, LMHead
from model.layers import FinalNorm, PositionEmbedding, TokenEmbedding
from model.llama_layers import LlamaEmbedding, LlamaFinalNorm
from parallel.planning.compression import stored_input_bytes
from parallel.planning.config import RECOMPUTE_MODULES
from parallel.planning.shapes import FP32, Shape, Target
from parallel.planning.stage_plan import StagePlan

INDEX_BYTES = 8  # int64 token ids, positions and labels

Item = tuple[str, int]  # (what is kept, bytes)


def attention_kernel(shape: Shape, target: Target) -> str:
    """Which attention code really runs: `math` (model/attention.py's explicit ops), `sdpa-math`
    (PyTorch's math backend: CPU with dropout on), `sdpa-flash` (CPU flash kernel, dropout off) or
    `sdpa-fused` (CUDA flash / memory-efficient kernels)."""
    if shape.attention == "math":
        return "math"
    if target.device == "cuda":
        return "sdpa-fused"
    return "sdpa-math" if shape.dropout else "sdpa-flash"


def dropout_mask_bytes(elements: int, shape: Shape, target: Target) -> int:
    """The mask one dropout keeps: a bit per element under model.packed_dropout, else target.mask_bytes each."""
    return -(-elements // 8) if shape.packed_dropout else elements * target.mask_bytes


def attention_core_items(shape: Shape, target: Target) -> list[Item]:
    """What the attention core keeps, including the (B, T, C) output the output projection reads."""
    # q and the attention output are a hs wide: h, unless model.head_dim sets hs (Qwen3-0.6B: 2h)
    d, bsq, scores = target.dtype_bytes, shape.b * shape.s * shape.q_width, shape.scores
    kernel = attention_kernel(shape, target)
    if kernel in ("math", "sdpa-math"):
        # matmul reshapes the strided q, k, v views into contiguous copies and keeps those (with b = 1 the explicit
        # ops' reshapes are views: they keep the QKV output itself, as many bytes). The SDPA math backend upcasts
        # 16-bit inputs and computes everything in fp32.
        c = d if kernel == "math" else FP32
        # SDPA's math backend draws its own fp32 mask; explicit ops run the model's dropout
        mask = dropout_mask_bytes(scores, shape, target) if kernel == "math" else scores * FP32
        items = [("q, k, v copies kept by the two batched matmuls", 3 * bsq * c)]
        if kernel == "sdpa-math" and d == FP32 and shape.b == 1:
            # its v is a view there: the second matmul keeps the whole QKV output
            items = [("q and k copies", 2 * bsq * c), ("QKV output (v viewed by the second matmul)", 3 * bsq * d)]
        items.append(("softmax output", scores * c))
        if shape.dropout:
            items += [("attention dropout mask", mask), ("attention dropout output", scores * c)]
        # (no dropout: the second matmul keeps the softmax output itself, counted once)
        items.append(("attention output, contiguous (output projection input)", bsq * d))
        return items
    # Fused kernels keep q, k, v (gpt2: views of the QKV projection output; llama: the rotated q and k, v a view of
    # its projection's output, k and v g/a as wide: SDPA reads grouped heads itself), their output (which, laid out
    # (B, T, nh, hs), is also the output projection's input: one storage) and the fp32 log-sum-exp. CUDA's
    # memory-efficient kernel (fp32, or where flash does not apply) pads its log-sum-exp rows to a multiple of 32;
    # flash keeps s of them: counting the padded rows never plans too little.
    rows = -(-shape.s // 32) * 32 if target.device == "cuda" else shape.s
    return [
        ("q, k, v", (bsq + 2 * shape.b * shape.s * shape.kv_width) * d),
        ("attention output (output projection input, same storage)", bsq * d),
        ("log-sum-exp", shape.b * shape.a * rows * FP32),
    ]


def block_items(shape: Shape, target: Target, modules: Sequence[str] = ()) -> list[Item]:
    """What one block keeps with no recompute (`modules` empty) or with selective recompute of
    `modules`. The block input (kept by ln_1, or by a checkpoint) is the first item."""
    d, r, bsh = target.dtype_bytes, target.ln_stat_bytes, shape.bsh
    mask = dropout_mask_bytes(bsh, shape, target)
    bs = shape.b * shape.s
    mods = set(modules)
    items: list[Item] = [("block input (ln_1 input)", bsh * d), ("ln_1 mean and rstd", 2 * bs * r)]
    if "layernorm" not in mods:
        items.append(("ln_1 output (QKV projection input)", bsh * d))
    if "core_attn" in mods:
        # The checkpoint holds q, k, v by reference: the QKV output's storage.
        items += [
            ("q, k, v (checkpoint input: the QKV output)", 3 * bsh * d),
            ("attention output, contiguous (output projection input)", bsh * d),
        ]
    else:
        items += attention_core_items(shape, target)
    if shape.dropout:
        items.append(("attention residual dropout mask", mask))
    if "mlp" in mods and "layernorm" in mods:
        items.append(("ln_2 input (checkpoint input of ln_2 + MLP)", bsh * d))
        return items
    items += [("ln_2 input", bsh * d), ("ln_2 mean and rstd", 2 * bs * r)]
    if "layernorm" not in mods:
        items.append(("ln_2 output (first MLP matmul input)", bsh * d))
    if "mlp" in mods:
        return items  # the MLP checkpoint holds ln_2's output, counted above
    items.append(("first MLP matmul output (GELU input)", 4 * bsh * d))
    if "mlp_act" not in mods:
        items.append(("GELU output (second MLP matmul input)", 4 * bsh * d))
    if shape.dropout:
        items.append(("MLP dropout mask", mask))
    return items


def llama_block_items(shape: Shape, target: Target, modules: Sequence[str] = ()) -> list[Item]:
    """What one Llama block keeps (model/llama_layers.py; no dropout there) with no recompute or with selective
    recompute of `modules`: `layernorm` discards the RMSNorm outputs, and the q and k norms' rstd (made again from
    their kept input), `mlp_act` the SwiGLU product. RMSNorm keeps its input and an fp32 rstd per token
    (model/rms_norm.py), per token and head for Qwen3's q and k norms; the rotary embedding keeps its cos and sin,
    (s, hs) each, and not its input; the attention core is attention_core_items' (the explicit ops repeat k and v to
    nh heads first, which their batched matmuls keep as copies of the full width); the SwiGLU product keeps gate and
    up, the down projection the product."""
    d, bsh, bs = target.dtype_bytes, shape.bsh, shape.b * shape.s
    bsq, kv, ffn = bs * shape.q_width * d, bs * shape.kv_width * d, bs * shape.mlp_width * d
    mods = set(modules)
    items: list[Item] = [("block input (input_layernorm input)", bsh * d), ("input_layernorm rstd (fp32)", bs * FP32)]
    if "layernorm" not in mods:
        items.append(("input_layernorm output (q, k, v projections' input)", bsh * d))
    if shape.qk_norm:
        items.append(("q_norm and k_norm inputs (q and k projection outputs)", bsq + kv))
        if "layernorm" not in mods:
            items.append(
                ("q_norm and k_norm rstd (fp32, per token and head)", bs * (shape.a + (shape.g or shape.a)) * FP32)
            )
    items.append(("rotary cos and sin", 2 * shape.s * shape.head_size * d))
    if "core_attn" in mods:
        items += [
            ("rotated q and k, and v (checkpoint inputs)", bsq + 2 * kv),
            ("attention output (o_proj input)", bsq),
        ]
    else:
        items += attention_core_items(shape, target)
    if "mlp" in mods and "layernorm" in mods:
        items.append(("post_attention_layernorm input (checkpoint input of the norm + MLP)", bsh * d))
        return items
    items += [("post_attention_layernorm input", bsh * d), ("post_attention_layernorm rstd (fp32)", bs * FP32)]
    if "layernorm" not in mods:
        items.append(("post_attention_layernorm output (gate and up projections' input)", bsh * d))
    if "mlp" in mods:
        return items  # the MLP checkpoint holds the norm's output, counted above
    items += [("gate projection output", ffn), ("up projection output", ffn)]
    if "mlp_act" not in mods:
        items.append(("SwiGLU product (down projection input)", ffn))
    return items


@functools.lru_cache(maxsize=4096)
def block_kept_items(shape: Shape, target: Target, modules: tuple[str, ...] = ()) -> tuple[Item, ...]:
    """block_items or llama_block_items, by the shape's architecture; a compiled block's measured bytes under
    train.compile (Target.compiled), where the partitioner, not eager autograd, chose what the block saves. Cached:
    auto's planners price thousands of plans of the same few block options."""
    if target.compiled is not None:
        kept = target.compiled.kept_bytes(shape, target.precision, modules)
        return (("compiled block's saved tensors (measured)", kept),)
    return tuple((llama_block_items if shape.arch == "llama" else block_items)(shape, target, modules))


def block_full_items(shape: Shape, target: Target, segment_start: bool, compress: str = "none") -> list[Item]:
    """Full recompute: a segment keeps only its input, by reference (or a compressed copy of it: `compress`,
    parallel/planning/compression.py); blocks inside keep nothing."""
    if not segment_start:
        return []
    if compress != "none":
        return [(f"segment input stored as {compress}", stored_input_bytes(shape, target, compress))]
    return [("segment input (checkpoint input)", shape.bsh * target.dtype_bytes)]


def token_embedding_items(shape: Shape, target: Target) -> list[Item]:
    return [("token ids (stage input)", shape.b * shape.s * INDEX_BYTES)]


def position_embedding_items(shape: Shape, target: Target) -> list[Item]:
    items = [("position ids", shape.s * INDEX_BYTES)]
    if shape.dropout:
        items.append(("embedding dropout mask", dropout_mask_bytes(shape.bsh, shape, target)))
    return items


def final_norm_items(shape: Shape, target: Target) -> list[Item]:
    if shape.arch == "llama":
        return [("norm input", shape.bsh * target.dtype_bytes), ("norm rstd (fp32)", shape.b * shape.s * FP32)]
    return [
        ("ln_f input", shape.bsh * target.dtype_bytes),
        ("ln_f mean and rstd", 2 * shape.b * shape.s * target.ln_stat_bytes),
    ]


def lm_head_items(shape: Shape, target: Target) -> list[Item]:
    """The head's matmul keeps its input; under the fused loss the head passes the hidden states through."""
    return [] if shape.loss_chunk_tokens else [("ln_f output (LM head input)", shape.bsh * target.dtype_bytes)]


def loss_items(shape: Shape, target: Target) -> list[Item]:
    """lm_loss: cross-entropy on fp32 logits keeps its log-probabilities, the labels and a scalar. The fused loss
    (model/fused_loss.py) keeps the final hidden states, the labels and an fp32 log-sum-exp per token."""
    tokens = shape.b * shape.s
    if shape.loss_chunk_tokens:
        return [
            ("ln_f output (fused loss input)", shape.bsh * target.dtype_bytes),
            ("labels", tokens * INDEX_BYTES),
            ("log-sum-exp per token (fp32)", tokens * FP32),
        ]
    return [
        ("log-softmax output (fp32)", tokens * shape.vocab * FP32),
        ("labels", tokens * INDEX_BYTES),
        ("cross-entropy total weight", FP32),
    ]


def selective_combinations() -> list[tuple[str, ...]]:
    """Every valid `recompute.modules` list (mlp and mlp_act exclude each other), in a fixed order."""
    combos = []
    for n in range(1, len(RECOMPUTE_MODULES) + 1):
        for combo in combinations(RECOMPUTE_MODULES, n):
            if not ("mlp" in combo and "mlp_act" in combo):
                combos.append(combo)
    return combos


def total(items: Sequence[Item]) -> int:
    return sum(b for _, b in items)


@dataclass(frozen=True)
class LayerActivation:
    flat_index: int
    name: str
    choice: str
    """`none`, `full`, `nested` or `selective:<modules>` for blocks; `-` for other layers."""
    items: tuple[Item, ...]

    @functools.cached_property
    def bytes(self) -> int:
        return total(self.items)

    @property
    def is_block(self) -> bool:
        return self.choice != "-"


def stage_activations(
    recipes: Sequence[LayerRecipe], layers: range, plan: StagePlan, shape: Shape, target: Target, is_last: bool
) -> list[LayerActivation]:
    """Per-layer kept bytes of one stage under its plan, in order; the loss is a last pseudo-layer on
    the last stage. Each layer counts its own input when it keeps it, so nothing is counted twice."""
    segment_starts = {start for start, _ in plan.segments}
    shared = target.compiled.shared if target.compiled is not None else 0
    out = []
    for local, flat in enumerate(layers):
        recipe = recipes[flat]
        cls = recipe.module_class
        choice = "-"
        if cls in BLOCK_CLASSES:
            choice = plan.choice_of(local)
            if choice in ("full", "nested"):
                items = block_full_items(shape, target, local in segment_starts, plan.compress)
            else:
                items = list(block_kept_items(shape, target, plan.selective.get(local, ())))
                if shared:  # one storage, whichever block of the stage saved it first
                    items.append(("one storage every compiled block saves (measured: the rotary angles table)", shared))
                    shared = 0
        elif is_head(recipe):
            items = lm_head_items(shape, target)
        elif cls in (TokenEmbedding, LlamaEmbedding):
            items = token_embedding_items(shape, target)
        elif cls is PositionEmbedding:
            items = position_embedding_items(shape, target)
        elif cls in (FinalNorm, LlamaFinalNorm):
            items = final_norm_items(shape, target)
        else:
            raise TypeError(f"no activation model for layer {flat} ({cls.__name__})")
        out.append(LayerActivation(flat, recipe.name, choice, tuple(items)))
    if is_last:
        out.append(LayerActivation(-1, "loss", "-", tuple(loss_items(shape, target))))
    return out


def is_head(recipe: LayerRecipe) -> bool:
    """The LM head: the tied embedding run as a function, or the untied LMHead module."""
    return recipe.forward_fn is not None or recipe.module_class is LMHead


def causal_mask_bytes(shape: Shape, target: Target) -> int:
    """The (s, s) additive causal mask model/attention.py's explicit ops build once per block and keep for every
    later step (outside autograd); SDPA builds none."""
    return shape.s * shape.s * target.dtype_bytes if attention_kernel(shape, target) == "math" else 0


CPU_RNG_STATE_BYTES = 5056
"""torch.get_rng_state(): the CPU generator's state, a uint8 tensor (tests/test_virtual_schedules.py checks it)."""


def checkpoint_rng_bytes(plan: StagePlan, target: Target) -> int:
    """What a micro-batch's checkpoints keep besides their inputs: torch's non-reentrant checkpoint saves the CPU
    generator's state at each checkpoint's forward (preserve_rng_state), one per full segment (and per block of a
    nested one) and per `core_attn` or `mlp` checkpoint of a selective block (parallel/runtime/recompute.py;
    `mlp_act` and `layernorm` discard outputs without a checkpoint). Host memory: counted on the CPU target only (on
    CUDA the device's tensors are measured). The peak of a virtual-stage schedule's rank is measured as every live
    tensor (parallel/measurement/tensor_peak.py), so its walk counts these; the activation meter of one stage per rank
    sees only saved tensors."""
    if target.device != "cpu":
        return 0
    selective = sum(("core_attn" in modules) + ("mlp" in modules) for modules in plan.selective.values())
    nested = sum(stop - start for start, stop in plan.segments) if plan.nested else 0  # a checkpoint per block inside
    return (len(plan.segments) + nested + selective) * CPU_RNG_STATE_BYTES


def stage_input_bytes(stage_index: int, shape: Shape, target: Target) -> int:
    """The forward's copy of the stage input: token ids on stage 0, hidden states elsewhere."""
    return shape.b * shape.s * INDEX_BYTES if stage_index == 0 else shape.bsh * target.dtype_bytes


def stage_output_bytes(is_last: bool, shape: Shape, target: Target) -> int:
    """What the stage's forward returns: hidden states, or logits on the last stage (unless the loss is fused)."""
    width = shape.vocab if is_last and not shape.loss_chunk_tokens else shape.h
    return shape.b * shape.s * width * target.dtype_bytes


def pipe_buffer_bytes(
    stage_index: int, is_last: bool, shape: Shape, target: Target, num_buffers: int, in_flight: int
) -> int:
    """DeepSpeed's own copies, outside autograd: one received input per pipe buffer, and the stage
    output of every micro-batch in flight (the last stage never frees its output buffers). Under the fused loss
    the last stage's output of a micro-batch in flight is the storage the loss keeps, counted with its activations."""
    outputs = in_flight
    if is_last:
        outputs = num_buffers - (in_flight if shape.loss_chunk_tokens else 0)
    return num_buffers * stage_input_bytes(stage_index, shape, target) + outputs * stage_output_bytes(
        is_last, shape, target
    )
