"""What a stage's parameters cost beside its activations: the weights, gradients and optimizer state of DeepSpeed
0.19.8's AdamW per precision, and what its optimizer step allocates on top. Estimates read from DeepSpeed's code (the
CPU fp32 step measured); parallel/planning/memory_model.py counts the activations."""

from collections.abc import Sequence

from model import BLOCK_CLASSES, LayerRecipe, LMHead
from model.layers import PositionEmbedding, TokenEmbedding
from model.llama_layers import LlamaEmbedding
from parallel.planning.shapes import FP32, Shape, Target

STATE_BYTES = {
    "fp32": ((4, "fp32 weights"), (4, "fp32 gradients"), (8, "AdamW's two fp32 moments")),
    "bf16": (
        (2, "bf16 weights"),
        (4, "bf16 gradients and their accumulation buffer"),
        (12, "BF16_Optimizer's fp32 master weights and two fp32 moments"),
    ),
    "fp16": ((2, "fp16 weights"), (2, "fp16 gradients"), (16, "fp32 master weights and gradients, two fp32 moments")),
}
"""Bytes per parameter of AdamW under DeepSpeed 0.19.8, by precision: (weights, gradients, optimizer), each with
what it holds. An estimate of its optimizer wrappers, read from their code, not measured."""


def optimizer_shards(precision: str, zero_stage: int, data_parallel: int) -> int:
    """The data-parallel ranks the optimizer state is split over: under ZeRO-1, and under bf16 always
    (BF16_Optimizer shards its fp32 master weights and moments even at ZeRO 0)."""
    return data_parallel if (zero_stage == 1 or precision == "bf16") else 1


def model_state_bytes(params: int, precision: str, zero_stage: int, data_parallel: int) -> dict[str, int]:
    """Parameters, gradients and optimizer state (STATE_BYTES). The optimizer part is sharded over data-parallel
    ranks under ZeRO-1, and under bf16 always: BF16_Optimizer shards its fp32 master weights and moments even at
    ZeRO 0."""
    (weight, _), (grads, _), (optimizer, _) = STATE_BYTES[precision]
    shard = optimizer_shards(precision, zero_stage, data_parallel)
    return {"params": params * weight, "grads": int(params * grads), "optimizer": int(params * optimizer / shard)}


def state_bytes_legend(precision: str, shard: int) -> str:
    """Where param+grad+opt's bytes per parameter come from, as the dry run prints it (`shard`: the data-parallel
    ranks the optimizer part is split over)."""
    parts = [f"{n} {what}" for n, what in STATE_BYTES[precision]]
    if shard > 1:
        parts[-1] += f" / {shard} data-parallel ranks"
    total = sum(n for n, _ in STATE_BYTES[precision][:2]) + STATE_BYTES[precision][2][0] / shard
    why = ""
    if shard > 1:
        why = " (BF16_Optimizer shards them even at ZeRO 0)" if precision == "bf16" else " (ZeRO-1 shards them)"
    return (
        f"param+grad+opt: {total:.3g} bytes per parameter, DeepSpeed 0.19.8's AdamW as estimated from its code: "
        + " + ".join(parts)
        + why
    )


def largest_parameter(recipes: Sequence[LayerRecipe], layers: range, shape: Shape) -> int:
    """Elements of the stage's largest parameter tensor: the (V, C) token embedding (the tied LM head's too) or
    untied LM head, the (s, C) positions, or a block's (f, C) MLP weights (its q projection's (C, C) when wider)."""
    sizes = [0]
    for flat in layers:
        cls = recipes[flat].module_class
        if cls in (TokenEmbedding, LlamaEmbedding, LMHead):  # a tied LM head runs the embedding's module
            sizes.append(shape.vocab * shape.h)
        elif cls is PositionEmbedding:
            sizes.append(shape.s * shape.h)
        elif cls in BLOCK_CLASSES:
            sizes.append(max(shape.mlp_width, shape.h) * shape.h)
    return max(sizes)


def optimizer_step_bytes(largest: int, params: int, target: Target, zero_stage: int, data_parallel: int) -> int:
    """What the optimizer step allocates on top of the states (DeepSpeed 0.19.8's optimizers, read from their code;
    fp32 and bf16 on CPU measured). On CPU, torch's AdamW steps one tensor at a time and makes its denominator from a
    square root and a division, two fp32 tensors of its size at once: the largest parameter's (fp32), or the one flat
    fp32 partition of the stage's parameters that DeepSpeed's BF16 / FP16 optimizers step (sharded as the optimizer
    state is). CUDA's fused Adam makes no such tensor. Under bf16 the step's gradient is an fp32 copy of the
    partition's bf16 gradients, alive through the step: BF16_Optimizer casts its accumulation buffer (DeepSpeed
    accumulates in the model's dtype unless told otherwise), ZeRO-1 casts a flat bf16 copy it makes first, the two
    alive together at the cast."""
    if target.precision == "fp32":
        return 0 if target.device == "cuda" else 2 * FP32 * largest
    partition = -(-params // optimizer_shards(target.precision, zero_stage, data_parallel))
    adam = 0 if target.device == "cuda" else 2 * FP32 * partition
    if target.precision != "bf16":
        return adam
    if zero_stage:
        return max(FP32 * partition + adam, (2 + FP32) * partition)
    return FP32 * partition + adam


def rank_step_bytes(
    largest: Sequence[int], params: Sequence[int], target: Target, zero_stage: int, data_parallel: int
) -> int:
    """What a rank holding several chunks (virtual stages: `largest[c]` elements in chunk c's largest parameter,
    `params[c]` parameters) allocates on top of their states after every backward, the larger of its ReduceGrads and
    its optimizer step: to DeepSpeed its chunks are one module, so one optimizer steps all their parameters (one flat
    partition under bf16) and ReduceGrads flattens all their gradients."""
    biggest, total = max(largest), sum(params)
    return max(
        optimizer_step_bytes(biggest, total, target, zero_stage, data_parallel),
        reduce_grads_bytes(biggest, total, target, zero_stage),
    )


REDUCE_BUCKET_ELEMENTS = 500_000_000
"""DeepSpeed 0.19.8's MEMORY_OPT_ALLREDUCE_SIZE: the elements ReduceGrads flattens at once."""
REDUCED_GRAD_BYTES = {"fp32": 4, "fp16": 2}
"""Bytes per gradient element ReduceGrads flattens, by precision: the model's own gradients. bf16 runs reduce
BF16_Optimizer's gradients instead (engine.buffered_allreduce_fallback through get_grads_for_reduction)."""


ZERO_BUCKET_BYTES = {"fp32": 8, "bf16": 4, "fp16": 4}
"""Bytes per element of ZeRO-1's reduction bucket that its ReduceGrads allocates under pipeline parallelism, its
buffers of the bucket's size together (DeepSpeed 0.19.8's stage_1_and_2.py; measured on CPU from two bucket sizes:
8 bytes in fp32, 4 in bf16; fp16 taken as bf16's, not measured)."""


def zero_bucket_elements(params: int) -> int:
    """ZeRO's reduce_bucket_size for a rank of `params` parameters: DeepSpeed's default, 5e8 elements, allocated
    whole at every ReduceGrads (4 GB per rank in fp32 whatever the stage holds), bounded by the rank's parameters,
    since a bucket never needs to hold more than all its gradients."""
    return max(1, min(params, REDUCE_BUCKET_ELEMENTS))


def reduce_grads_bytes(largest: int, params: int, target: Target, zero_stage: int) -> int:
    """What DeepSpeed's ReduceGrads allocates on top of the states, after every backward, at any data-parallel size
    (one too): without ZeRO, engine.allreduce_no_retain flattens the gradients into one buffer, all-reduces it and
    copies it back, a bucket at a time; a bucket closes once it holds more than REDUCE_BUCKET_ELEMENTS (so at most
    that plus the largest parameter). ZeRO-1 allocates its reduction buckets (ZERO_BUCKET_BYTES per element of
    zero_bucket_elements); bf16 without ZeRO reduces through its optimizer's buffer: not counted."""
    if zero_stage:
        return ZERO_BUCKET_BYTES[target.precision] * zero_bucket_elements(params)
    if target.precision not in REDUCED_GRAD_BYTES:
        return 0
    return REDUCED_GRAD_BYTES[target.precision] * min(params, REDUCE_BUCKET_ELEMENTS + largest)
