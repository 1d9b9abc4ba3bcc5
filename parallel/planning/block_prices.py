"""What one block option costs, built in one place and read by everyone: per option (`none`, each selective set)
the bytes a block keeps, its backward's working set, the forward FLOPs its recompute redoes and that recompute's
price; per table the full-recompute segment's figures and, where the device was measured, the seconds of each
instruction of a block and of the stage's other parts (`MeasuredSeconds`).

`BlockPrices` is what the auto optimiser (parallel/planning/auto_recompute.py), the step-time model
(parallel/planning/instruction_seconds.py) and the run plan's per-choice table read. Its prices are in one of two
units: seconds (`measured_prices`, from a device profile's curves: parallel/planning/curve_seconds.py) or
FLOP-equivalents (`analytic_prices`: matmul FLOPs plus the elementwise work's bytes at the device's machine balance),
which the step-time model turns into seconds at the device's rate.

Every field of `MeasuredSeconds` is required: a part that was never priced is an error where the record is built,
not a silent fall-back to the analytic model where it is read.
"""

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, fields, replace

from parallel.planning.compression import FORMAT_WORDS, compress_traffic_bytes
from parallel.planning.device_profile_file import ANALYTIC, CostSource
from parallel.planning.flops import block_forward_flops, mlp_output_matmul_flops, selective_recompute_flops
from parallel.planning.memory_model import (
    attention_kernel,
    block_full_items,
    block_kept_items,
    selective_combinations,
    total,
)
from parallel.planning.shapes import Shape, Target, option_key
from parallel.planning.working_set import block_backward_bytes, fresh_gradient_working

SELECTIVE_PARTS = ("core_attn", "mlp", "mlp_act", "layernorm")
"""The block parts selective recompute redoes (parallel/planning/config.py's recompute.modules)."""


_LINKS = ("transfer", "link_bytes_per_s")


@dataclass(frozen=True)
class MeasuredSeconds:
    """One micro-batch's seconds of each part the planner prices."""

    block_recompute: float
    """A block's forward without autograd: what full recompute redoes per block."""
    core_attn: float
    """The forward of the attention core (softmax(QK^T)V with its dropout): selective `core_attn`."""
    mlp: float
    """The forward of the whole MLP: selective `mlp`."""
    mlp_act: float
    """The MLP's activation (GELU, or the SwiGLU product): selective `mlp_act`."""
    layernorm: float
    """Both of a block's norms: selective `layernorm`."""
    block_forward: float
    """A block's forward with autograd recording."""
    block_backward: float
    """A block's backward, weight gradients included."""
    block_weight_grad: float
    """The part of `block_backward` that makes the Linear layers' weight gradients (ZB-H1's W)."""
    block_backward_input: float
    """ZB-H1's B of a block: its backward without the weight gradients, which also keeps each Linear's input and output
    gradient for its W, so it takes longer than `block_backward` - `block_weight_grad` (the replay timed 9% and 18%
    longer at the step-time benchmark's two shapes)."""
    embedding_forward: float
    embedding_backward: float
    head_forward: float
    """Final norm, LM head and loss."""
    head_backward: float
    head_weight_grad: float
    """The part of `head_backward` that is the LM head's weight-gradient matmul (0 under the fused loss)."""
    head_backward_input: float
    """ZB-H1's B of the head (its whole backward under the fused loss, which defers nothing)."""
    optimizer_per_param: float
    """The optimizer step per parameter (with clipping's scaling of the gradients where the run clips)."""
    load: float
    """A LoadMicroBatch of the first or the last stage: the micro-batch's token ids or labels into its buffer."""
    reduce_grads_per_param: float
    """ReduceGrads' own work per parameter, which DeepSpeed 0.19.8 does at any data-parallel size (one included): every
    gradient flattened into one buffer, all-reduced over the replicas, and copied back. The replicas' all-reduce itself
    is priced by the links."""
    transfer: float | None
    """One micro-batch's hidden states between neighbouring stages; None where the links were not measured."""
    link_bytes_per_s: float | None
    """The data-parallel all-reduce's rate; None where the links were not measured."""
    exchange: float = 0.0
    """A rank's post of one boundary's batch of messages under a schedule with virtual stages, beyond what the
    simulator times: its own work there and the waits the simulator does not see (on a CPU whose ranks fill every
    core, a send to a computing peer seems to wait for the backend's progress thread). No replay can time it before the
    process group exists: it is learnt from traced runs (harness/prediction_check.py, ADDED_PARTS), 0 until one ran."""

    def __post_init__(self):
        for field in fields(self):
            value = getattr(self, field.name)
            if value is None and field.name in _LINKS:
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
                raise ValueError(f"MeasuredSeconds.{field.name} must be a measured value >= 0, not {value!r}")

    def selective(self, modules: Iterable[str]) -> float:
        """Seconds to recompute these selective parts of one block."""
        unknown = set(modules) - set(SELECTIVE_PARTS)
        if unknown:
            raise ValueError(f"no measured seconds for selective parts {sorted(unknown)}: one of {SELECTIVE_PARTS}")
        return sum(getattr(self, module) for module in modules)


# FLOPs a device does in the time it moves one byte: elementwise recompute (softmax, dropout, GELU,
# LayerNorm) is bandwidth-bound, so the analytic cost charges its memory traffic at this rate.
# H100-class GPUs: ~1000 TFLOP/s over ~3.3 TB/s; a CPU core: ~100 GFLOP/s over ~10 GB/s.
MACHINE_BALANCE = {"cuda": 300.0, "cpu": 10.0}


@dataclass(frozen=True)
class BlockOption:
    """One per-block choice short of a full-recompute segment, for one micro-batch."""

    choice: str
    """`none` or `selective:<modules>`."""
    modules: tuple[str, ...]
    kept_bytes: int
    """Bytes one block keeps per micro-batch (under train.compile, a compiled block's where it was measured)."""
    cost: float
    """Price of the block's recompute, in its table's unit (BlockPrices.unit)."""
    working_bytes: int = 0
    """The most its backward holds beyond what it keeps (working_set.block_backward_bytes' largest moment)."""
    fresh_working_bytes: int = 0
    """`working_bytes` where the block's output gradient is a fresh tensor, less that gradient, which the stage adds
    (working_set.fresh_gradient_working, StageWorking's block_offset): `BlockPrices.with_fresh_output`."""
    recompute_flops: int = 0
    """Forward FLOPs the recompute redoes (flops.selective_recompute_flops: elementwise work counts 0)."""


def block_options(shape: Shape, target: Target, cost: Callable[[tuple[str, ...]], float]) -> list[BlockOption]:
    """`none`, then every selective combination, with the bytes each keeps, `cost(modules)`, its working set and the
    FLOPs it redoes. Under train.compile (Target.compiled) only the combinations a compiled block was measured with,
    with its measured bytes: the others' bytes are unknown (AOTAutograd's partitioner chooses what a compiled block
    keeps), so no plan may choose them."""
    kernel = attention_kernel(shape, target)
    combos = selective_combinations()
    if target.compiled is not None:
        combos = [combo for combo in combos if option_key(combo) in target.compiled.options]
    gradient = shape.bsh * target.dtype_bytes
    moments = {combo: block_backward_bytes(shape, target, combo) for combo in [(), *combos]}
    return [
        BlockOption(
            "selective:" + "+".join(combo) if combo else "none",
            combo,
            total(block_kept_items(shape, target, combo)),
            float(cost(combo)) if combo else 0.0,
            max(moments[combo].values()),
            fresh_gradient_working(moments[combo], gradient),
            selective_recompute_flops(shape, combo, kernel),
        )
        for combo in [(), *combos]
    ]


@dataclass(frozen=True)
class BlockPrices:
    """What one block costs and keeps under each choice, for one micro-batch."""

    options: tuple[BlockOption, ...]
    segment_input_bytes: int
    """What a full-recompute segment keeps: its input."""
    block_bytes: int
    """What one block keeps with no recompute: also what recomputing it holds while its backward runs."""
    full_block_cost: float
    """Recomputing one block's forward inside a segment."""
    segment_discount: float = 0.0
    """Cost a segment saves once (torch's early stop skips the last matmul when nothing after it is saved)."""
    measured: MeasuredSeconds | None = None
    """Measured tables only: the seconds of a block's parts and the stage's other parts (costs are then in
    seconds)."""
    source: CostSource = ANALYTIC
    """Which costs these are: a device profile (its path and date) or analytic."""
    selective_costs: tuple[tuple[tuple[str, ...], float], ...] = ()
    """(modules sorted by option_key, the recompute's price) of every selective combination, whether or not a plan may
    choose it (under train.compile `options` holds only the measured ones): the step-time model prices any plan it is
    given, the uniform modes plan.json compares with too."""
    nesting: bool = True
    """Auto may nest a full segment's blocks (StagePlan.nested); not under train.compile, which refuses nested
    segments (parallel/runtime/compile_blocks.py's compile_refusal)."""
    stash: tuple[str, int] | None = None
    """The lossy storage auto may use (recompute.compress): its format and the bytes a segment input keeps stored in
    it; None: every plan stores exactly."""
    compress_costs: tuple[tuple[str, float], ...] = ()
    """(format, the price of storing one segment input in it and making it again at the recompute) per format: its
    passes' memory traffic (compression.compress_traffic_bytes) at the table's price of an elementwise byte."""

    def with_fresh_output(self) -> "BlockPrices":
        """The table for a stage whose blocks are followed by other layers (StageWorking.blocks_end_stage false): each
        option's working set (and so a segment's, which starts from `none`'s) where its output gradient is fresh."""
        return replace(self, options=tuple(replace(o, working_bytes=o.fresh_working_bytes) for o in self.options))

    def compress_cost(self, compress: str) -> float:
        """The price of one segment input stored in `compress` (0 for `none`)."""
        return dict(self.compress_costs).get(compress, 0.0)

    def selective_cost(self, modules: Iterable[str]) -> float:
        """The price of recomputing these selective parts of one block."""
        return dict(self.selective_costs)[option_key(modules)]

    @property
    def unit(self) -> str:
        """What `cost`, `full_block_cost` and `segment_discount` count: `seconds` or `flop-equivalents`."""
        return "seconds" if self.measured is not None else "flop-equivalents"


def _elementwise_bytes(shape: Shape, target: Target, modules: Sequence[str]) -> int:
    """Memory traffic (read + write) of the non-matmul work each module recomputes."""
    d, bsh = target.dtype_bytes, shape.bsh
    traffic = 0
    if "core_attn" in modules and attention_kernel(shape, target) in ("math", "sdpa-math"):
        traffic += (2 + (3 if shape.dropout else 0)) * shape.scores * d  # scale-mask-softmax, dropout
    if "mlp_act" in modules or "mlp" in modules:
        # GELU reads and writes f channels; the SwiGLU product reads two and writes one
        traffic += (3 if shape.arch == "llama" else 2) * shape.b * shape.s * shape.mlp_width * d
    if "mlp" in modules and shape.dropout:
        traffic += 3 * bsh * d
    if "layernorm" in modules:
        traffic += 4 * bsh * d  # two norms
    return traffic


def analytic_prices(shape: Shape, target: Target) -> BlockPrices:
    """Prices in FLOP-equivalents: the matmul FLOPs a recompute redoes plus its elementwise bytes at the device's
    machine balance."""
    kernel = attention_kernel(shape, target)
    balance = MACHINE_BALANCE[target.device]

    def cost(modules: Sequence[str]) -> float:
        return selective_recompute_flops(shape, modules, kernel) + balance * _elementwise_bytes(shape, target, modules)

    return _table(
        shape,
        target,
        cost,
        full_block_cost=block_forward_flops(shape)
        + balance
        * (
            _elementwise_bytes(shape, target, ("core_attn", "mlp", "layernorm"))
            + (3 * shape.bsh * target.dtype_bytes if shape.dropout else 0)
        ),
        segment_discount=0 if shape.dropout else mlp_output_matmul_flops(shape),
    )


def measured_prices(shape: Shape, target: Target, seconds: MeasuredSeconds, source: CostSource) -> BlockPrices:
    """Costs in seconds of one block: a full recompute's forward and each selective part's; the step-time model
    reads the rest of `seconds`. An elementwise byte costs what the measured norms' recompute did per byte."""
    norms = ("layernorm",)
    return _table(
        shape,
        target,
        seconds.selective,
        full_block_cost=seconds.block_recompute,
        measured=seconds,
        source=source,
        byte_cost=seconds.selective(norms) / _elementwise_bytes(shape, target, norms),
    )


def _table(
    shape: Shape,
    target: Target,
    cost,
    full_block_cost: float,
    segment_discount: float = 0.0,
    measured: MeasuredSeconds | None = None,
    source: CostSource = ANALYTIC,
    byte_cost: float | None = None,
) -> BlockPrices:
    """`byte_cost`: the price of an elementwise byte (default: the device's machine balance, FLOP-equivalents)."""
    options = block_options(shape, target, cost)
    per_byte = MACHINE_BALANCE[target.device] if byte_cost is None else byte_cost
    return BlockPrices(
        tuple(options),
        total(block_full_items(shape, target, True)),
        options[0].kept_bytes,
        float(full_block_cost),
        float(segment_discount),
        measured,
        source,
        tuple((option_key(combo), float(cost(combo))) for combo in selective_combinations()),
        nesting=target.compiled is None,
        compress_costs=tuple((f, per_byte * compress_traffic_bytes(shape, target, f)) for f in FORMAT_WORDS),
    )


RESIDUAL_PARTS = {
    "forward": ("block_forward", "embedding_forward", "head_forward"),
    "backward": ("block_backward", "embedding_backward", "head_backward", "block_recompute", *SELECTIVE_PARTS),
    "backward_input": ("block_backward_input", "head_backward_input"),
    "weight_grad": ("block_weight_grad", "head_weight_grad"),
    "optimizer": ("optimizer_per_param",),
    "reduce_grads": ("reduce_grads_per_param",),
}
"""The parts each kind of instruction's residual scales (harness/prediction_check.py learns them from a traced run:
ForwardPass, BackwardPass, ZB-H1's BackwardInput and BackwardWeight, OptimizerStep, and ReduceGrads where a run has
one replica)."""


ADDED_PARTS = {"exchange_s": "exchange"}
"""Residuals that are seconds, not factors: each sets a part no replay measures (harness/prediction_check.py learns
them from traced runs)."""


def with_residuals(seconds: MeasuredSeconds, residuals: dict[str, float]) -> MeasuredSeconds:
    """`seconds` with each kind's parts scaled by what earlier runs measured against their prediction (measured /
    predicted), and ADDED_PARTS' parts set to the seconds learnt for them; a weight gradient never exceeds the
    backward it is part of."""
    unknown = set(residuals) - set(RESIDUAL_PARTS) - set(ADDED_PARTS)
    if unknown:
        raise ValueError(
            f"no parts for residuals {sorted(unknown)}: one of {', '.join([*RESIDUAL_PARTS, *ADDED_PARTS])}"
        )
    scaled = {
        part: getattr(seconds, part) * factor
        for kind, factor in residuals.items()
        if kind in RESIDUAL_PARTS
        for part in RESIDUAL_PARTS[kind]
    }
    scaled |= {ADDED_PARTS[kind]: value for kind, value in residuals.items() if kind in ADDED_PARTS}
    values = {field.name: getattr(seconds, field.name) for field in fields(seconds)} | scaled
    values["block_weight_grad"] = min(values["block_weight_grad"], values["block_backward"])
    values["head_weight_grad"] = min(values["head_weight_grad"], values["head_backward"])
    return MeasuredSeconds(**values)
