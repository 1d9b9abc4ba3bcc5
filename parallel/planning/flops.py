"""FLOPs of a training step: model FLOPs (the useful work) and hardware FLOPs (including recompute),
and the peak throughput of known GPUs for MFU / HFU. Pure arithmetic.

Counted as torch.utils.flop_counter does: matrix products only (2 FLOPs per multiply-add; layer norms,
GELU, softmax and dropout are not counted), attention scores over the full s x s square (the causal mask
saves nothing in this count), backward = 2 x forward.

Recompute FLOPs follow torch's non-reentrant checkpoint, which stops recomputing as soon as the last
tensor backward needs has been packed again ("early stop", torch's default). A native op packs its inputs
*before* it runs, so when a region's last saving op is a matmul, that matmul is never redone: the
(probs x V) matmul of the attention core, and the MLP output matmul of a region that ends without
dropout. Dropout saves after that matmul has run (CPU: the noise it multiplies by; CUDA: its mask).

Model FLOPs per token = 6 (N + h V) + 12 L h s, where N is the parameter count (the model's own, on the meta
device) without the token and position embeddings (a lookup does no matmul) and without an untied LM head, and h V
is the LM head: a tied head's weight *is* the token embedding, so N leaves it out, but it runs a (h x V) matmul per
token, which we count (as Megatron-LM's formula does). Drop `head_flops_per_token` to get the 6N + 12 L h s of
Kaplan / PaLM. Grouped-query attention and the SwiGLU MLP change only N (k and v projections h g/a wide, three
(h x f) matrices): the formula holds for both architectures.
"""

from collections.abc import Sequence
from dataclasses import dataclass

from model import BLOCK_CLASSES, GPTConfig, LayerRecipe, LMHead
from model.layers import PositionEmbedding, TokenEmbedding
from model.llama_layers import LlamaEmbedding
from parallel.planning.shapes import Shape
from parallel.planning.stage_plan import StagePlan


def block_forward_flops(shape: Shape) -> int:
    """One block, one micro-batch: q and output projections (2 h q, q = a hs: h unless model.head_dim says
    otherwise), k and v (2 h kv, kv = g hs), the MLP's matmuls per token (gpt2: 2 h f with f = 4h, so 12 h^2 in all;
    llama's SwiGLU: 3 h f), plus QK^T and (softmax) x V over the full square. Qwen3's q and k norms do no matmul."""
    tokens = shape.b * shape.s
    projections = 2 * shape.h * shape.q_width + 2 * shape.h * shape.kv_width
    return 2 * tokens * projections + mlp_forward_flops(shape) + attention_core_forward_flops(shape)


def attention_core_forward_flops(shape: Shape) -> int:
    return 2 * 2 * shape.b * shape.s * shape.s * shape.q_width


def mlp_forward_flops(shape: Shape) -> int:
    matrices = 3 if shape.arch == "llama" else 2  # gate, up, down / c_fc, c_proj
    return 2 * shape.b * shape.s * matrices * shape.mlp_width * shape.h


def head_forward_flops(shape: Shape) -> int:
    return 2 * shape.b * shape.s * shape.h * shape.vocab


def mlp_output_matmul_flops(shape: Shape) -> int:
    """The MLP's second matmul: what torch's early stop skips at the end of a region without dropout."""
    return 2 * shape.b * shape.s * shape.mlp_width * shape.h


def selective_recompute_flops(shape: Shape, modules: Sequence[str], kernel: str) -> int:
    """Forward FLOPs redone in backward for one block under selective recompute of `modules`.

    core_attn: with explicit ops (`math`, and SDPA's math backend) the checkpoint stops before the final
    (probs x V) matmul, so only QK^T is redone; a fused kernel (`sdpa-flash`, `sdpa-fused`) is one op and
    is redone whole. mlp: both matmuls, or only the first when dropout is off (early stop). mlp_act (GELU)
    and layernorm are elementwise: 0 in this count (not 0 time). Llama's MLP ends in the down projection, a matmul
    (no dropout): early stop skips it too."""
    flops = 0
    if "core_attn" in modules:
        core = attention_core_forward_flops(shape)
        flops += core // 2 if kernel in ("math", "sdpa-math") else core
    if "mlp" in modules:
        flops += mlp_forward_flops(shape) - (0 if shape.dropout else mlp_output_matmul_flops(shape))
    return flops


def segment_recompute_flops(shape: Shape, blocks: int) -> int:
    """Full recompute of a segment of `blocks` blocks: their forward, less the last block's MLP output
    matmul when dropout is off (early stop; see the module docstring)."""
    return blocks * block_forward_flops(shape) - (0 if shape.dropout else mlp_output_matmul_flops(shape))


def nested_segment_recompute_flops(shape: Shape, blocks: int) -> int:
    """Nested recompute of a segment of `blocks` blocks: the segment's recompute runs every block but the last (torch's
    early stop ends it once the last block's input, the last tensor it keeps, is made), then each block's own
    recompute runs before its backward (`segment_recompute_flops` of one block). Counted with FlopCounterMode."""
    return (blocks - 1) * block_forward_flops(shape) + blocks * segment_recompute_flops(shape, 1)


def non_embedding_params(recipes: Sequence[LayerRecipe], param_counts: Sequence[int]) -> int:
    """N: the blocks and the final norm (biases and gains included), without the token and position embeddings and
    without an untied LM head (model_flops_per_token counts every LM head as h V). `param_counts`:
    model.layer_param_counts(recipes), the
    one count of parameters (on the meta device) that the memory model and the partition read too."""
    embeddings = (TokenEmbedding, PositionEmbedding, LlamaEmbedding, LMHead)
    return sum(count for recipe, count in zip(recipes, param_counts) if recipe.module_class not in embeddings)


def model_flops_per_token(model: GPTConfig, non_embedding: int) -> int:
    """6 (N + h V) + 12 L q s, N = `non_embedding` (non_embedding_params), q = the query width (h unless
    model.head_dim says otherwise: the attention core's matmuls are q wide)."""
    h = model.n_embd
    return 6 * (non_embedding + h * model.vocab_size) + 12 * model.n_layer * model.q_width * model.seq_len


def head_flops_per_token(model: GPTConfig) -> int:
    return 6 * model.n_embd * model.vocab_size


@dataclass(frozen=True)
class StageFlops:
    """FLOPs of one stage for one micro-batch, counted as FlopCounterMode does."""

    forward: int
    """Forward matmul FLOPs."""
    recompute: int
    """Forward FLOPs redone in backward under the stage's plan."""

    @property
    def model(self) -> int:
        """Forward + backward (2 x forward)."""
        return 3 * self.forward

    @property
    def hardware(self) -> int:
        return self.model + self.recompute


def stage_flops(
    recipes: Sequence[LayerRecipe], layers: range, plan: StagePlan, shape: Shape, kernel: str
) -> StageFlops:
    """`kernel`: the attention code that runs (parallel.planning.memory_model.attention_kernel)."""
    forward = recompute = 0
    for local, flat in enumerate(layers):
        recipe = recipes[flat]
        if recipe.module_class in BLOCK_CLASSES:
            forward += block_forward_flops(shape)
            if local in plan.selective:
                recompute += selective_recompute_flops(shape, plan.selective[local], kernel)
        elif recipe.forward_fn is not None or recipe.module_class is LMHead:
            forward += head_forward_flops(shape)
            # The fused loss makes each chunk's logits again in backward (model/fused_loss.py).
            recompute += head_forward_flops(shape) if shape.loss_chunk_tokens else 0
    segment_flops = nested_segment_recompute_flops if plan.nested else segment_recompute_flops
    for start, stop in plan.segments:
        blocks = sum(recipes[layers[i]].module_class in BLOCK_CLASSES for i in range(start, stop))
        recompute += segment_flops(shape, blocks)
    return StageFlops(forward, recompute)


# Dense peak TFLOP/s (no sparsity) of the matrix units, by precision, from the vendors' data sheets.
# fp32 is plain FP32 (PyTorch does not use TF32 for matmuls unless asked). Matched in order against
# torch.cuda.get_device_name(): the more specific names first.
PEAK_TFLOPS: tuple[tuple[str, dict[str, float]], ...] = (
    ("GB200", {"bf16": 2500.0, "fp16": 2500.0, "fp32": 80.0}),
    ("B200", {"bf16": 2250.0, "fp16": 2250.0, "fp32": 80.0}),
    ("GH200", {"bf16": 989.0, "fp16": 989.0, "fp32": 67.0}),
    ("H200", {"bf16": 989.0, "fp16": 989.0, "fp32": 67.0}),
    ("H100 PCIe", {"bf16": 756.0, "fp16": 756.0, "fp32": 51.0}),
    ("H100 NVL", {"bf16": 835.0, "fp16": 835.0, "fp32": 60.0}),
    ("H100", {"bf16": 989.0, "fp16": 989.0, "fp32": 67.0}),
    ("H800", {"bf16": 989.0, "fp16": 989.0, "fp32": 67.0}),
    ("A100", {"bf16": 312.0, "fp16": 312.0, "fp32": 19.5}),
    ("A800", {"bf16": 312.0, "fp16": 312.0, "fp32": 19.5}),
    ("L40S", {"bf16": 362.0, "fp16": 362.0, "fp32": 91.6}),
    ("L4", {"bf16": 121.0, "fp16": 121.0, "fp32": 30.3}),
    ("A10G", {"bf16": 70.0, "fp16": 70.0, "fp32": 31.2}),
    ("A10", {"bf16": 125.0, "fp16": 125.0, "fp32": 31.2}),
    ("RTX 4090", {"bf16": 165.2, "fp16": 165.2, "fp32": 82.6}),
    ("V100", {"fp16": 125.0, "fp32": 15.7}),
)


def lookup_peak_tflops(device_name: str | None, precision: str) -> float | None:
    """Peak TFLOP/s of a known GPU at `precision`, or None (CPU, an unknown GPU, or no such unit)."""
    if not device_name:
        return None
    for key, peaks in PEAK_TFLOPS:
        if key.lower() in device_name.lower():
            return peaks.get(precision)
    return None
