"""A block priced from a device profile: each architecture is a list of ops (matmuls with their FLOPs, elementwise
and normalisation passes with their elements, the attention core, the loss), each op priced on its measured
curve (parallel/planning/device_profile_file.py). Another architecture is one more op list.

The result is the seconds a measured BlockPrices (auto_recompute.measured_prices) and the step-time model
(parallel/planning/instruction_seconds.py) read: the forward of a block and of each part selective recompute redoes, a
block's forward and backward with autograd, its weight-gradient share (ZB-H1's W), the embeddings, the head with
its loss, the optimizer per parameter, and the links between ranks.
"""

import statistics
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace

import numpy as np

from parallel.planning.block_prices import SELECTIVE_PARTS, BlockPrices, MeasuredSeconds, measured_prices
from parallel.planning.device_profile_file import DeviceProfile
from parallel.planning.shapes import Shape, Target


@dataclass(frozen=True)
class Op:
    curve: str
    """The profile curve that prices it (device_profile_file.CURVES)."""
    size: float
    """The curve's x: FLOPs of a matmul, elements of an elementwise pass, ..."""
    weight_grad: bool = False
    """A backward matmul that makes a Linear's weight gradient: ZB-H1 can defer it (W)."""

    def seconds(self, profile: DeviceProfile) -> float:
        return profile.seconds(self.curve, self.size)


@dataclass(frozen=True)
class AttentionOp:
    """The attention core (model.attention's kernel), priced between the head sizes the profile measured."""

    kernel: str
    dropout: bool
    scores: float
    """Score elements: b x heads x s x s."""
    head_size: int
    backward: bool = False
    grouped: bool = False
    """Fewer key/value heads than query heads (grouped-query attention)."""
    weight_grad = False  # the core has no weights: nothing for ZB-H1 to defer

    def seconds(self, profile: DeviceProfile) -> float:
        return profile.attention_seconds(
            self.kernel, self.dropout, self.scores, self.head_size, self.backward, self.grouped
        )


@dataclass(frozen=True)
class BlockOps:
    """One block's forward, split by what selective recompute can redo, and its backward."""

    parts: dict[str, tuple[Op | AttentionOp, ...]]
    """Forward ops of each recomputable module (`core_attn`, `mlp`, `mlp_act`, `layernorm`) and of the rest."""
    backward: tuple[Op | AttentionOp, ...]

    @property
    def forward(self) -> tuple[Op | AttentionOp, ...]:
        return tuple(op for name, ops in self.parts.items() if name != "mlp_act" for op in ops)


def _linear(tokens: int, fan_in: int, fan_out: int) -> tuple[Op, tuple[Op, Op]]:
    """A Linear's forward matmul and its backward: the input's gradient and the weight's (same FLOPs each)."""
    flops = 2 * tokens * fan_in * fan_out
    return Op("matmul", flops), (Op("matmul", flops), Op("matmul", flops, weight_grad=True))


def _dropout(elements: int, dropout: bool) -> tuple[tuple[Op, ...], tuple[Op, ...]]:
    return ((Op("dropout", elements),), (Op("dropout_backward", elements),)) if dropout else ((), ())


def gpt_block_ops(shape: Shape) -> BlockOps:
    """model/layers.py's Block: pre-LayerNorm attention and GELU MLP, dropout on the residual branches (and on the
    attention probabilities, inside the attention core's curve)."""
    tokens, h = shape.b * shape.s, shape.h
    qkv, qkv_back = _linear(tokens, h, 3 * h)
    proj, proj_back = _linear(tokens, h, h)
    fc, fc_back = _linear(tokens, h, 4 * h)
    out, out_back = _linear(tokens, 4 * h, h)
    drop, drop_back = _dropout(tokens * h, shape.dropout)
    core = AttentionOp(shape.attention, shape.dropout, shape.scores, h // shape.a)
    mlp = (fc, Op("gelu", tokens * 4 * h), out, *drop)
    return BlockOps(
        parts={
            "layernorm": (Op("layernorm", tokens * h),) * 2,
            "core_attn": (core,),
            "mlp": mlp,
            "mlp_act": (mlp[1],),
            "rest": (qkv, proj, *drop, Op("add", tokens * h), Op("add", tokens * h)),
        },
        backward=(
            *(Op("layernorm_backward", tokens * h),) * 2,
            *qkv_back,
            replace(core, backward=True),
            *proj_back,
            *fc_back,
            Op("gelu_backward", tokens * 4 * h),
            *out_back,
            *drop_back * 2,
            # the residual stream's gradient is the sum of each branch's and the skip's
            Op("add", tokens * h),
            Op("add", tokens * h),
        ),
    )


def llama_block_ops(shape: Shape) -> BlockOps:
    """model/llama_layers.py's LlamaBlock: pre-RMSNorm grouped-query attention with rotary q and k, and the SwiGLU
    MLP; no dropout. q, k and v are three Linear layers (k and v kv_width wide), as gate and up are two: the
    gradients of their shared input are summed (one add per extra layer). q is a hs wide (model.head_dim); Qwen3's
    q and k norms are RMSNorms over hs channels, priced on the rmsnorm curve by their elements, and join the
    `layernorm` part: selective recompute of `layernorm` makes their rstd again in backward."""
    tokens, h, qw, kv, f = shape.b * shape.s, shape.h, shape.q_width, shape.kv_width, shape.mlp_width
    q, q_back = _linear(tokens, h, qw)
    k, k_back = _linear(tokens, h, kv)
    v, v_back = _linear(tokens, h, kv)
    o, o_back = _linear(tokens, qw, h)
    gate, gate_back = _linear(tokens, h, f)
    up, up_back = _linear(tokens, h, f)
    down, down_back = _linear(tokens, f, h)
    core = AttentionOp(shape.attention, False, shape.scores, shape.head_size, grouped=kv < qw)
    rotary = (Op("rotary", tokens * qw), Op("rotary", tokens * kv))  # q and k
    qk_norms = (Op("rmsnorm", tokens * qw), Op("rmsnorm", tokens * kv)) if shape.qk_norm else ()
    mlp = (gate, up, Op("swiglu", tokens * f), down)
    return BlockOps(
        parts={
            "layernorm": (Op("rmsnorm", tokens * h),) * 2 + qk_norms,
            "core_attn": (core,),
            "mlp": mlp,
            "mlp_act": (mlp[2],),
            "rest": (q, k, v, *rotary, o, Op("add", tokens * h), Op("add", tokens * h)),
        },
        backward=(
            *(Op("rmsnorm_backward", tokens * h),) * 2,
            *(Op("rmsnorm_backward", op.size) for op in qk_norms),
            *q_back,
            *k_back,
            *v_back,
            *(Op("rotary_backward", op.size) for op in rotary),
            replace(core, backward=True),
            *o_back,
            *gate_back,
            *up_back,
            Op("swiglu_backward", tokens * f),
            *down_back,
            # the residual stream's two sums, k's and v's input gradients into q's, up's into gate's
            *(Op("add", tokens * h),) * 5,
        ),
    )


@dataclass(frozen=True)
class Architecture:
    """What a profile prices of one model.arch: its block's op list, the embedding and head around the blocks,
    and the weights a block's optimizer steps."""

    block: Callable[[Shape], BlockOps]
    norm: str
    """The curve of the normalisation before the LM head."""
    learned_positions: bool
    """A position table added to the token embeddings (and dropout after them): gpt2's, not llama's (rotary)."""
    block_params: Callable[[Shape], int]
    """A block's weight matrices' parameters (biases and gains are few)."""


ARCHITECTURES = {
    "gpt2": Architecture(gpt_block_ops, "layernorm", True, lambda shape: 12 * shape.h * shape.h),
    "llama": Architecture(
        llama_block_ops,
        "rmsnorm",
        False,
        lambda shape: 2 * shape.h * (shape.q_width + shape.kv_width) + 3 * shape.h * shape.mlp_width,
    ),
}
"""The block architectures a profile prices, by their op lists: every model.arch (tests/test_device_profile.py)."""


def _seconds(profile: DeviceProfile, ops: Iterable[Op | AttentionOp]) -> float:
    return sum(op.seconds(profile) for op in ops)


def link_seconds(profile: DeviceProfile, shape: Shape, target: Target) -> tuple[float | None, float | None]:
    """One micro-batch's hidden states sent between neighbours, and the data-parallel all-reduce's rate (bytes/s),
    from the profile's links; (None, None) where it measured none."""
    if not profile.has_links:
        return None, None
    d = target.dtype_bytes
    # a 2-rank all-reduce moves its bytes once each way: the ring's rate at a block's gradients
    grad_bytes = ARCHITECTURES[shape.arch].block_params(shape) * d
    return profile.seconds("p2p", shape.bsh * d), grad_bytes / profile.seconds("allreduce", grad_bytes)


def profile_seconds(profile: DeviceProfile, shape: Shape, target: Target) -> MeasuredSeconds:
    """One micro-batch's seconds of each part the planner prices (see the module docstring), for shape.arch's
    blocks (one of ARCHITECTURES)."""
    arch = ARCHITECTURES[shape.arch]
    block = arch.block(shape)
    missing = set(SELECTIVE_PARTS) - set(block.parts)
    if missing:
        raise ValueError(f"the {shape.arch} op list prices no selective part {sorted(missing)}")
    tokens, h = shape.b * shape.s, shape.h
    drop, drop_back = _dropout(tokens * h, shape.dropout)
    # token gather, and gpt2's position add and dropout; backward: the dropout, the tokens' scatter, the positions'
    # sum
    positions = (Op("add", tokens * h),) if arch.learned_positions else ()
    loss = "loss_chunked" if shape.loss_chunk_tokens else "loss_unfused"
    head = tokens * h * shape.vocab
    block_params = arch.block_params(shape)
    transfer, link_rate = link_seconds(profile, shape, target)
    forward = _seconds(profile, block.forward)
    backward = _seconds(profile, block.backward)
    weight_grad = _seconds(profile, (op for op in block.backward if op.weight_grad))
    head_backward = _seconds(profile, (Op(arch.norm + "_backward", tokens * h), Op(loss + "_backward", head)))
    # The unfused head's backward holds one weight-gradient matmul, tied (gpt2) or the untied head's own (llama:
    # model/llama_layers.py's LMHead, the same matmul); the fused one makes it chunk by chunk (none to defer:
    # instruction_seconds.time_model).
    head_weight_grad = 0.0 if shape.loss_chunk_tokens else profile.seconds("matmul", 2 * head)
    return MeasuredSeconds(
        **{part: _seconds(profile, block.parts[part]) for part in SELECTIVE_PARTS},
        block_recompute=forward,
        block_forward=forward,
        block_backward=backward,
        block_weight_grad=weight_grad,
        block_backward_input=backward - weight_grad,  # the curves time no split's extra
        embedding_forward=_seconds(profile, (Op("embedding", tokens * h), *positions, *drop)),
        embedding_backward=_seconds(profile, (*drop_back, Op("embedding_backward", tokens * h), *positions)),
        head_forward=_seconds(profile, (Op(arch.norm, tokens * h), Op(loss, head))),
        head_backward=head_backward,
        head_weight_grad=head_weight_grad,
        head_backward_input=max(0.0, head_backward - head_weight_grad),
        optimizer_per_param=profile.seconds("adamw", block_params) / block_params,
        load=0.0,  # no curve times it: a copy of b x s token ids (measured, a thousandth of the tiny shape's step)
        # flattening the gradients and copying them back: two passes, each priced as a residual add's
        reduce_grads_per_param=2 * profile.seconds("add", block_params) / block_params,
        transfer=transfer,
        link_bytes_per_s=link_rate,
    )


def profile_prices(profile: DeviceProfile, shape: Shape, target: Target) -> BlockPrices:
    """The auto planner's and the step-time model's costs, in seconds, from a device profile."""
    return measured_prices(shape, target, profile_seconds(profile, shape, target), profile.source)


CORRECTED = tuple(name for name in MeasuredSeconds.__dataclass_fields__ if name not in ("transfer", "link_bytes_per_s"))
"""The parts a correction scales: every timed one (the links are the profile's own, measured or not)."""


@dataclass(frozen=True)
class Correction:
    """What the real stage taught about one part's curve seconds: measured = `scale` x curves + `per_op` x its ops."""

    scale: float
    per_op: float = 0.0
    """Seconds each of the part's ops costs beyond its curve (dispatch, autograd's bookkeeping, a launch)."""


class _UnitPrices:
    """A profile that prices every op at one second, with no links: `profile_seconds` under it counts each part's ops
    (per parameter, the optimizer's and the gradient reduce's passes over its parameters)."""

    has_links = False

    def seconds(self, curve: str, size: float) -> float:
        return 1.0

    def attention_seconds(self, *args, **kwargs) -> float:
        return 1.0


def op_counts(shape: Shape, target: Target) -> MeasuredSeconds:
    """Each part's ops, as profile_seconds lists them (the curves' unit of correction)."""
    return profile_seconds(_UnitPrices(), shape, target)


MIN_FITTED = 3
"""Shapes a part needs measured before its per-op seconds are fitted (two would fit any pair exactly)."""


def curve_corrections(
    measured: Sequence[tuple[MeasuredSeconds, MeasuredSeconds, MeasuredSeconds]],
) -> dict[str, Correction]:
    """What the real stage taught about the curves, per part, from (measured, curves, op counts) of the shapes this
    device measured (parts priced > 0 by both): measured = scale x curves + per_op x ops, fitted by least relative
    squares where at least MIN_FITTED shapes measured it and the fit beats the median ratio on them with both terms
    positive; else the median ratio alone. The curves time each kernel alone and warm; the ratio carries what
    scales with the work (clones, accumulation), the per-op term what does not (a small shape's dispatch and
    autograd's bookkeeping, math attention's and dropout's many small ops), to shapes this device cannot build."""
    points: dict[str, list[tuple[float, float, float]]] = {}
    for seconds, curves, ops in measured:
        for name in CORRECTED:
            got, priced = getattr(seconds, name), getattr(curves, name)
            if got > 0 and priced > 0:
                points.setdefault(name, []).append((priced, getattr(ops, name), got))
    return {name: _fitted(values) for name, values in points.items()}


def _fitted(points: Sequence[tuple[float, float, float]]) -> Correction:
    median = Correction(statistics.median(got / priced for priced, _, got in points))
    if len(points) < MIN_FITTED:
        return median
    relative = np.array([[priced / got, ops / got] for priced, ops, got in points])
    (scale, per_op), *_ = np.linalg.lstsq(relative, np.ones(len(points)), rcond=None)
    fit = Correction(float(scale), float(per_op))
    if scale <= 0 or per_op < 0 or _error(fit, points) >= _error(median, points):
        return median
    return fit


def _error(correction: Correction, points: Sequence[tuple[float, float, float]]) -> float:
    return statistics.mean(abs(correction.scale * p + correction.per_op * n - got) / got for p, n, got in points)


def corrected(seconds: MeasuredSeconds, ops: MeasuredSeconds, corrections: dict[str, Correction]) -> MeasuredSeconds:
    """`seconds` (the curves') with each part corrected (a part without a correction is left as priced); `ops`: its
    op counts (op_counts)."""
    return replace(
        seconds,
        **{name: c.scale * getattr(seconds, name) + c.per_op * getattr(ops, name) for name, c in corrections.items()},
    )
