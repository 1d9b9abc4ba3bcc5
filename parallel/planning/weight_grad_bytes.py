"""What a micro-batch holds from its B to its W under a split backward (zb-h1, ZB-V, V-Half: model/weight_grad.py's
store), and what a W allocates while it runs: pure arithmetic beside parallel/planning/memory_model.py's kept
items."""

from collections.abc import Sequence

from model import BLOCK_CLASSES, LayerRecipe
from parallel.planning.memory_model import Item, is_head, total
from parallel.planning.shapes import Shape, Target


def weight_grad_items(shape: Shape, target: Target) -> list[Item]:
    """What one block holds from its B to its W under zb-h1 (model/weight_grad.py's store): each Linear's
    input and output gradient. The same under every plan: a recomputed input is the recompute's tensor, held
    past the backward that made it, and everything else of the micro-batch is freed with its graph. Llama's q, k
    and v projections share one input storage, as do its gate and up projections."""
    d, bsh = target.dtype_bytes, shape.bsh
    if shape.arch == "llama":
        bs = shape.b * shape.s
        bsq, kv, ffn = bs * shape.q_width * d, bs * shape.kv_width * d, bs * shape.mlp_width * d
        return [
            ("q, k, v projections' input and output gradients", bsh * d + bsq + 2 * kv),
            ("o_proj input and output gradient", bsq + bsh * d),
            ("gate and up projections' input and output gradients", bsh * d + 2 * ffn),
            ("down projection input and output gradient", ffn + bsh * d),
        ]
    return [
        ("QKV projection input and output gradient", bsh * d + 3 * bsh * d),
        ("attention output projection input and output gradient", 2 * bsh * d),
        ("first MLP matmul input and output gradient", bsh * d + 4 * bsh * d),
        ("second MLP matmul input and output gradient", 4 * bsh * d + bsh * d),
    ]


def lm_head_weight_grad_items(shape: Shape, target: Target) -> list[Item]:
    """The unfused LM head's share from B to W (tied or not): its input and the logits' gradient."""
    d = target.dtype_bytes
    return [("LM head input and logits gradient", shape.bsh * d + shape.b * shape.s * shape.vocab * d)]


def stage_weight_grad_bytes(recipes: Sequence[LayerRecipe], layers: range, shape: Shape, target: Target) -> int:
    """Bytes one micro-batch holds on the stage between its B and its W (zb-h1)."""
    held = 0
    for flat in layers:
        if recipes[flat].module_class in BLOCK_CLASSES:
            held += total(weight_grad_items(shape, target))
        elif is_head(recipes[flat]) and not shape.loss_chunk_tokens:
            # The fused loss makes the head's weight gradient chunk by chunk inside B: nothing to defer.
            held += total(lm_head_weight_grad_items(shape, target))
    return held


def weight_grad_transient_bytes(recipes: Sequence[LayerRecipe], layers: range, shape: Shape, target: Target) -> int:
    """What a W allocates on top while it runs: one deferred Linear's weight gradient at a time, the largest of the
    stage's (model/weight_grad.py's DeferredWeightGrad.apply forms it, then accumulates it into `.grad`)."""
    largest = 0
    for flat in layers:
        if recipes[flat].module_class in BLOCK_CLASSES:
            width = max(shape.mlp_width, shape.q_width) if shape.arch == "llama" else 4 * shape.h
            largest = max(largest, shape.h * width)
        elif is_head(recipes[flat]) and not shape.loss_chunk_tokens:
            largest = max(largest, shape.vocab * shape.h)
    return largest * target.dtype_bytes
