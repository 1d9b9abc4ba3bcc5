"""The working set of a stage's backward pass: what it allocates on top of what the stage keeps, at the moments it
is largest (pure arithmetic, like parallel/planning/memory_model.py, derived from the code of model/ and
parallel/runtime/recompute.py; docs/measurement.md compares it with the allocator's peak).

Autograd frees what a node saved right after the node runs, so a backward pass walks the forward in reverse and
frees what each op kept as it passes it. Its largest moments are inside one block: the second MLP matmul's backward
(where a block's backward starts) and the attention core's backward (after the MLP's and the output projection's
tensors are gone, where s x s gradients are made). What a recompute remakes is what `none` would have kept, remade
when the backward reaches the region, so from that moment the block holds what `none` holds; before it, it holds
that much less. Every figure below is therefore `none`'s, plus the savings of the regions the backward has reached.

d: the dtype's bytes, N = b s tokens, C = h, S = b a s^2 scores, c: the bytes the attention core computes in (d for
`math`, fp32 for SDPA's math backend).

Llama blocks (model.arch=llama) get the same moments with their widths (k and v h g/a, the MLP f wide, three MLP
matrices, RMSNorm's fp32 rstd): the analogue of each GPT-2 figure, derived; the MLP moment, the SwiGLU backward's, is
held to the allocator's peak by tests/test_nested_recompute.py (their kept bytes by memory_model.llama_block_items).
"""

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass

from parallel.planning.memory_model import (
    FP32,
    LayerActivation,
    attention_core_items,
    attention_kernel,
    block_kept_items,
    dropout_mask_bytes,
    total,
)
from parallel.planning.shapes import Shape, Target
from parallel.planning.stage_plan import StagePlan
from parallel.planning.weight_grad_bytes import lm_head_weight_grad_items, weight_grad_items

MLP = "block backward"
"""The second MLP matmul's backward: where each block's backward starts."""
ATTENTION = "attention backward"
"""The attention core's backward."""
COMPILED = "compiled block backward"
"""A compiled block's backward (train.compile), one graph: its measured largest moment (Target.compiled)."""
SEGMENT = "segment recompute"
"""Either moment in a block of a full-recompute segment, which the backward remakes at once."""
LOSS = "loss backward"
EMBEDDING = "embedding backward"
EMBEDDING_NAMES = ("TokenEmbedding", "LlamaEmbedding")


@dataclass(frozen=True)
class StageWorking:
    """`backward_working_sets` of a stage under 1F1B, split into what its blocks' choices change and what they do not,
    for parallel/planning/auto_recompute.py: with each micro-batch's blocks keeping `kept` bytes and the stage's last
    block (where the blocks' working set is largest) holding `moment` bytes beyond what it keeps
    (`block_backward_bytes`), the micro-batches live at the peak and the working set on top hold `bytes(...)`."""

    block_offset: int
    """Added to the last block's moment: its output gradient when layers follow it on the stage, less what those
    layers (final norm, head, loss) kept and have freed by then."""
    fixed: int = 0
    """The working set no block choice changes: the loss's backward on the last stage."""
    embedding: int | None = None
    """The first stage's EMBEDDING working set plus the blocks' bytes of the micro-batch (which it has freed)."""
    optimizer: int = 0
    """The optimizer step's moment, after every backward (StageMemory.optimizer_floor): a floor under the peak."""
    blocks_end_stage: bool = True
    """No layer follows the stage's blocks: the last block's output gradient is DeepSpeed's buffer, every earlier
    block's a fresh tensor."""

    def bytes(self, kept: int, count: int, moment: float) -> int:
        """`count` micro-batches whose blocks keep `kept` bytes each, with one's backward working set on top."""
        work = max(0, moment + self.block_offset, self.fixed)
        if self.embedding is not None:
            work = max(work, self.embedding - kept)
        return int(max(count * kept + work, self.optimizer))

    def kept_limit(self, room: float, count: int, moment: float) -> float:
        """The most a micro-batch's blocks may keep for `bytes(kept, count, moment)` to stay within `room`."""
        if room < self.optimizer:
            return -math.inf
        limit = (room - max(0, moment + self.block_offset, self.fixed)) / count
        if self.embedding is not None:
            if count > 1:
                limit = min(limit, (room - self.embedding) / (count - 1))
            elif room < self.embedding:
                return -math.inf
        return limit


def attention_core_bytes(shape: Shape, target: Target) -> int:
    """The most the attention core's backward holds beyond what the block keeps before it, under `none`, the
    block's own output gradient counted; the MLP's and output projection's tensors are already freed.

    - `math` / SDPA's math backend (`sdpa-math`), whose scores are kept: the second batched matmul's backward makes
      the gradient of the (dropped-out) probabilities, S c, and of v, N C c (and, in SDPA's math backend under a
      16-bit dtype, the output gradient upcast, N C 4). With dropout, its backward makes the probabilities'
      gradient (S c) as the dropped probabilities and v's copy are freed, rebuilding the mask as S d first when it
      was kept packed. Then `math`'s ScaledCausalSoftmax backward holds the probabilities' gradient with an fp32
      gradient of the scores (S 4), and in a 16-bit dtype both inputs upcast to fp32 (2 S 4); with dropout, the
      dropped probabilities and the mask are gone by then.
    - fused kernels: the gradients of q, k and v (3 N C d); no s x s tensor.
    """
    d, bsh, scores = target.dtype_bytes, shape.bsh, shape.scores
    kernel = attention_kernel(shape, target)
    if kernel not in ("math", "sdpa-math"):
        return 3 * bsh * d
    c = d if kernel == "math" else FP32
    moments = [scores * c + bsh * c + (bsh * FP32 if kernel == "sdpa-math" and d != FP32 else 0)]
    if shape.dropout and shape.packed_dropout:
        moments.append(scores * c + scores * d)
    if kernel == "math":
        softmax = scores * FP32 + (2 * scores * FP32 if d != FP32 else 0)
        if shape.dropout:
            moments.append(softmax - dropout_mask_bytes(scores, shape, target))
        else:
            moments.append(scores * c + softmax)
    return max(moments)


def _remade_copies(shape: Shape, target: Target) -> int:
    """What a `core_attn` block holds in its backward beyond `none`'s: the QKV output its checkpoint keeps while the
    recompute makes q, k, v copies from it, where `none` keeps the copies only (memory_model.attention_core_items):
    with the explicit ops unless b = 1 (the reshapes are views then), with SDPA's math backend unless fp32 at b = 1
    (its v is a view then)."""
    kernel = attention_kernel(shape, target)
    if shape.arch == "llama":  # the checkpoint holds rotated q and k and v; the explicit ops copy all three
        bs = shape.b * shape.s
        return (bs * shape.q_width + 2 * bs * shape.kv_width) * target.dtype_bytes if kernel == "math" else 0
    views = shape.b == 1 and (kernel == "math" or (kernel == "sdpa-math" and target.dtype_bytes == FP32))
    copies = kernel in ("math", "sdpa-math") and not views
    return 3 * shape.bsh * target.dtype_bytes if copies else 0


@functools.lru_cache(maxsize=1024)
def block_backward_bytes(
    shape: Shape, target: Target, modules: tuple[str, ...] = (), split_weights: bool = False
) -> dict[str, int]:
    """{MLP: ..., ATTENTION: ...}: the most one block's backward holds beyond what the block keeps (with no
    recompute, or with selective recompute of `modules`), with its output gradient, at each moment.

    - MLP: the gradient of the (N, 4C) input and the fresh gradients of the (4C, C) weight and C bias, d (4 N C + 4
      C^2 + C) (Llama: the down projection's, or the SwiGLU backward's 3 N f d, whichever is larger); under
      `split_weights` (zb-h1's B, which defers the weight gradients to W) GELU's backward, 8 N C d,
      on top of the second matmul's input and output gradient (kept for W), less the freed dropout mask; plus what
      the MLP's recompute remade: the GELU output (`mlp_act`), or everything the MLP keeps under `none` (`mlp`, with
      ln_2 under `layernorm`);
    - ATTENTION: `attention_core_bytes` on top of the residual stream's and the attention output's gradients
      (2 N C d), less what the block kept after the attention core and has freed, plus every saving of `modules`
      but the ln_1 output's (remade only at the QKV matmul's backward), plus q, k, v copies made while the QKV output
      is held (`_remade_copies`). Under `split_weights` the Linear layers after the core keep their inputs and
      output gradients for W (weight_grad_bytes.weight_grad_items): those are not freed.
    """
    if target.compiled is not None:  # zb-h1's split backward never runs compiled (compile_blocks.compile_refusal)
        return {COMPILED: target.compiled.working_bytes(shape, target.precision, modules)}
    d, bsh = target.dtype_bytes, shape.bsh
    kept_none = total(block_kept_items(shape, target))
    core = total(attention_core_items(shape, target)[:-1])  # without the output, which the projection keeps
    before_core = bsh * d + 2 * shape.b * shape.s * target.ln_stat_bytes + bsh * d + core
    if shape.arch == "llama":  # one fp32 rstd per token, and the rotary cos and sin
        before_core += shape.b * shape.s * (FP32 - 2 * target.ln_stat_bytes) + 2 * shape.s * shape.head_size * d
    freed = kept_none - before_core
    if split_weights:
        freed -= total(weight_grad_items(shape, target)[1:])
    ln_1_output = bsh * d if "layernorm" in modules else 0
    mlp_region = [m for m in modules if m in ("mlp", "mlp_act")]
    if "mlp" in modules and "layernorm" in modules:  # one checkpoint over ln_2 and the MLP
        mlp_region.append("layernorm")
    mlp_ln_1_output = bsh * d if "layernorm" in mlp_region else 0
    mlp_saving = kept_none - total(block_kept_items(shape, target, tuple(mlp_region))) - mlp_ln_1_output
    saving = kept_none - total(block_kept_items(shape, target, modules)) - ln_1_output
    h, ffn = shape.h, shape.b * shape.s * shape.mlp_width * d
    mlp = ffn + shape.mlp_width * h * d + h * d
    if shape.arch == "llama":
        # The down projection's input and weight gradients (no bias), then, the product freed with the down
        # projection's backward and its weight gradient accumulated, the SwiGLU backward (model/llama_layers.py's
        # _SwiGLUProduct): the product's gradient, gate's, silu(gate) remade and up's gradient, 3 f-wide tensors at
        # its last multiply. The larger of the two: the SwiGLU's wherever 2 b s > h, where the allocator's peak was
        # measured inside it (it was missing, and nested Llama stages were planned 15% low). Under split_weights
        # the SwiGLU backward's product, gate and up gradients on top of what W holds (the product and the output
        # gradient).
        mlp = bsh * d + 4 * ffn if split_weights else max(ffn + shape.mlp_width * h * d, 3 * ffn)
    elif split_weights:
        # No weight gradient, but W holds the second matmul's input and output gradient, so GELU's backward (its
        # output's and input's gradients) comes on top of them; the MLP dropout's mask is freed by then.
        mask = dropout_mask_bytes(bsh, shape, target) if shape.dropout else 0
        mlp = 9 * bsh * d - mask + h * d
    return {
        MLP: mlp + mlp_saving,
        ATTENTION: 2 * bsh * d
        - freed
        + attention_core_bytes(shape, target)
        + saving
        + (_remade_copies(shape, target) if "core_attn" in modules else 0),
    }


def with_output_gradient(moments: dict[str, int], gradient: int) -> dict[str, int]:
    """A block's moments (`block_backward_bytes`) with its output gradient beside them, a fresh tensor of `gradient`
    bytes, but the attention core's: autograd accumulates the MLP branch's gradient into it in place, so by the
    attention core it is the residual stream's gradient, already in ATTENTION. DeepSpeed's grad buffer, the output
    gradient of a stage's last layer, is not accumulated into: the residual stream's gradient is a tensor of its own
    there (`gradient` 0: the moments as they are)."""
    return {name: value + (0 if name == ATTENTION else gradient) for name, value in moments.items()}


def fresh_gradient_working(moments: dict[str, int], gradient: int) -> int:
    """A block's largest moment where its output gradient is a fresh tensor of `gradient` bytes
    (`with_output_gradient`), less that gradient, which StageWorking's block_offset adds back."""
    return max(with_output_gradient(moments, gradient).values()) - gradient


def backward_working_sets(
    layers: Sequence[LayerActivation],
    plan: StagePlan,
    shape: Shape,
    target: Target,
    split_weights: bool = False,
    remade_early: bool = False,
    output_held: bool = True,
) -> dict[str, int]:
    """The most one micro-batch's backward through the stage holds beyond what the micro-batch keeps, by moment
    (the names above; each the largest over the stage's blocks). The backward runs the layers last first: when it
    reaches a block, the layers after it have freed what they kept (under `split_weights` less the Linear inputs
    and output gradients that zb-h1's W's need, the unfused LM head's included), a full-recompute segment has
    remade its earlier blocks too, and the block's output gradient is a fresh tensor unless it is the stage's
    output (DeepSpeed's grad buffer); by the attention core a fresh one is the residual stream's gradient, which the
    block's own ATTENTION figure holds already (`with_output_gradient`).

    - LOSS (the last stage, before anything is freed): the unfused loss holds the gradients of its fp32
      log-probabilities and of the fp32 logits together, 2 N V 4 bytes; the fused loss (model/fused_loss.py) holds
      the hidden states' gradient (N C d), the tied weight's in fp32 (V C 4) and a chunk's fp32 logits (k V 4, k =
      min(model.loss_chunk_tokens, N)), plus their copy in d when d is not fp32; with more than one chunk, two
      chunks' worth, since the loop makes the next chunk's logits while the previous chunk's are still bound;
    - EMBEDDING (the first stage, after everything but the token ids is freed): the token embedding's dense (V, C)
      weight gradient.

    `remade_early`: a nested segment's block inputs were remade by an early recompute, which the schedule's walk
    counts (`nested_early_bytes`), so the backward adds only each block's interior. `output_held`: the engine holds
    the last stage's output through its backward (`_freed_bytes`).
    """
    d, bsh = target.dtype_bytes, shape.bsh
    sets: dict[str, int] = {}

    def keep(name: str, value: int) -> None:
        sets[name] = max(sets.get(name, value), value)

    none = block_backward_bytes(shape, target, (), split_weights)
    kept_none = total(block_kept_items(shape, target))
    held_for_w = total(weight_grad_items(shape, target)) if split_weights else 0
    segment_of = {i: (a, b) for a, b in plan.segments for i in range(a, b)}
    freed = 0
    for local in range(len(layers) - 1, -1, -1):
        layer = layers[local]
        if layer.is_block:
            incoming = bsh * d if local < len(layers) - 1 else 0
            if local in segment_of:
                start = segment_of[local][0]
                # A compressed input is a copy: the recompute makes the input anew beside it (decompressed).
                reused = layers[start].bytes if plan.compress == "none" else 0
                if plan.nested:
                    remade = nested_remade_bytes(local - start, kept_none, bsh * d, reused, remade_early)
                else:
                    remade = (local - start + 1) * kept_none - reused
                keep(SEGMENT, max(with_output_gradient(none, incoming).values()) + remade - freed)
            else:
                own = block_backward_bytes(shape, target, plan.selective.get(local, ()), split_weights)
                for name, value in with_output_gradient(own, incoming).items():
                    keep(name, value - freed)
            freed += layer.bytes - held_for_w
        elif split_weights and layer.name == "LMHead" and not shape.loss_chunk_tokens:
            freed += layer.bytes - total(lm_head_weight_grad_items(shape, target))  # the unfused head defers too
        else:
            freed += _freed_bytes(layer, shape, target, output_held)
    if layers and layers[-1].name == "loss":
        sets[LOSS] = _loss_bytes(shape, target)
    if layers and layers[0].name in EMBEDDING_NAMES:
        sets[EMBEDDING] = _embedding_bytes(shape, target) - (freed - layers[0].bytes)
    return sets


def nested_remade_bytes(offset: int, kept_none: int, block_input: int, reused: int, remade_early: bool = False) -> int:
    """What a nested segment's backward holds, beyond what the segment keeps, at its block `offset` (0: the segment's
    first): the segment's recompute remade every block's input (the first's is the kept segment input itself,
    `reused` bytes of it, unless that was stored compressed: then 0, and it is remade too), the blocks after this one
    have freed theirs with their backward, and this block's interior is remade as under `none`, its input included.
    Its largest moment is at the segment's last block, which the backward reaches first. With `remade_early` the early
    recompute made the inputs already (`nested_early_bytes`): only this block's interior is new."""
    if remade_early:
        return kept_none - block_input
    return kept_none - reused + offset * block_input


def nested_early_bytes(plan: StagePlan, layers: Sequence[LayerActivation], block_input: int) -> int:
    """What an early recompute of a nested stage holds from its RecomputeEarly to the backward: every segment's block
    inputs, less what the segment kept (its input, or its compressed copy, which the early recompute releases)."""
    is_block = [layer.is_block for layer in layers]
    return sum(sum(is_block[a:b]) * block_input - layers[a].bytes for a, b in plan.segments)


def _freed_bytes(layer: LayerActivation, shape: Shape, target: Target, output_held: bool = True) -> int:
    """What a layer other than a block frees once the backward has passed it: all it keeps, but for the fused loss's
    input, which is the last stage's output, where the engine holds that (`output_held`): DeepSpeed's never drops it
    (memory_model.pipe_buffer_bytes), while a virtual-stage schedule's last chunk keeps no output of its own
    (parallel/runtime/chunk_work.py), so its loss's backward frees its input with the rest."""
    if output_held and layer.name == "loss" and shape.loss_chunk_tokens:
        return layer.bytes - shape.bsh * target.dtype_bytes
    return layer.bytes


def _loss_bytes(shape: Shape, target: Target) -> int:
    d, tokens = target.dtype_bytes, shape.b * shape.s
    if shape.loss_chunk_tokens:
        chunk = min(shape.loss_chunk_tokens, tokens) * shape.vocab
        chunks = 2 if tokens > shape.loss_chunk_tokens else 1  # the previous chunk's, still bound
        per_chunk = chunk * (FP32 + (d if d != FP32 else 0))
        return tokens * shape.h * d + shape.vocab * shape.h * FP32 + chunks * per_chunk
    return 2 * tokens * shape.vocab * FP32


def _embedding_bytes(shape: Shape, target: Target) -> int:
    """The token embedding's dense (V, C) weight gradient, with its output gradient."""
    return shape.vocab * shape.h * target.dtype_bytes + shape.bsh * target.dtype_bytes


def stage_working(layers: Sequence[LayerActivation], shape: Shape, target: Target, optimizer: int = 0) -> StageWorking:
    """The StageWorking of a stage whose layers (under any plan: only the other layers are read) are `layers`, and
    whose optimizer step is `optimizer` beyond its fixed bytes."""
    blocks = [local for local, layer in enumerate(layers) if layer.is_block]
    others = [layer.bytes for layer in layers if not layer.is_block]
    offset = 0
    if blocks and blocks[-1] < len(layers) - 1:
        offset = shape.bsh * target.dtype_bytes - sum(
            _freed_bytes(layer, shape, target) for layer in layers[blocks[-1] + 1 :]
        )
    last = bool(layers) and layers[-1].name == "loss"
    first = bool(layers) and layers[0].name in EMBEDDING_NAMES
    return StageWorking(
        offset,
        _loss_bytes(shape, target) if last else 0,
        _embedding_bytes(shape, target) - (sum(others) - layers[0].bytes) if first else None,
        optimizer,
        not (blocks and blocks[-1] < len(layers) - 1),
    )


def early_remade_bytes(
    plan: StagePlan,
    layers: Sequence[LayerActivation],
    plain_layers: Sequence[LayerActivation],
    shape: Shape,
    target: Target,
) -> int:
    """What a micro-batch recomputed early (a RecomputeEarly ahead of its backward) holds from that recompute to its
    backward beyond what its plan keeps (`layers`): a nested plan's block inputs (`nested_early_bytes`), else what
    `none` keeps (`plain_layers`) beyond the plan, with the copies an early recompute makes
    (`early_recompute_copies`)."""
    if plan.nested:
        return nested_early_bytes(plan, layers, shape.bsh * target.dtype_bytes)
    remade = sum(a.bytes for a in plain_layers) - sum(a.bytes for a in layers)
    return remade + early_recompute_copies(plan, shape, target)


def early_working_sets(
    layers: Sequence[LayerActivation],
    plain_sets: dict[str, int],
    plan: StagePlan,
    shape: Shape,
    target: Target,
    split_weights: bool,
    output_held: bool = True,
) -> dict[str, int]:
    """The backward's working sets of a micro-batch recomputed early: `none`'s (`plain_sets`), its activations being
    remade already; a nested plan's backward remakes each block's interior (`backward_working_sets`' remade_early)."""
    if plan.nested:
        return backward_working_sets(layers, plan, shape, target, split_weights, True, output_held)
    return plain_sets


def early_recompute_copies(plan: StagePlan, shape: Shape, target: Target) -> int:
    """What an early recompute (recompute.early) holds beyond what `none` keeps, from its RecomputeEarly to the
    backward: the q, k, v copies each `core_attn` block remakes while its checkpoint holds the QKV output."""
    blocks = sum("core_attn" in modules for modules in plan.selective.values())
    return blocks * _remade_copies(shape, target)
