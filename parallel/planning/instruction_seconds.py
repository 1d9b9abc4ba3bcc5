"""Seconds of each pipeline instruction on each stage (step_sim.StageCosts), for the step-time simulator
(parallel/planning/step_sim.py).

Two sources, one shape. `measured`: a device profile's curves priced into a block's parts
(parallel/planning/curve_seconds.py), the embeddings, the head with its loss, the optimizer and the links.
`analytic` (no profile for the device): FLOPs at a realistic share of the device's peak plus the elementwise
work's bytes at its memory bandwidth, transfers at a link bandwidth.

The recompute a plan adds is read from the auto planner's BlockPrices (FLOP-equivalents for the analytic
table, seconds for a measured one), so the planner and the simulator price a choice the same way.
"""

from collections.abc import Sequence
from dataclasses import dataclass, replace

from model import BLOCK_CLASSES, LayerRecipe
from parallel.planning.block_prices import MACHINE_BALANCE, SELECTIVE_PARTS, BlockPrices, MeasuredSeconds
from parallel.planning.flops import (
    attention_core_forward_flops,
    block_forward_flops,
    head_forward_flops,
    lookup_peak_tflops,
)
from parallel.planning.partition import StageRange
from parallel.planning.shapes import FP32, RunShape, Shape
from parallel.planning.stage_plan import StagePlan
from parallel.planning.step_sim import StageCosts

# Nominal rates of a target without a measured profile. A CPU rank here: one core's fp32 matmuls; a CUDA
# rank whose GPU is unknown is planned as an H100. Stage-to-stage links: one 400 Gb/s NIC between GPU
# nodes; gloo over loopback between CPU processes.
CPU_FLOPS_PER_S = 5e10
PEAK_EFFICIENCY = 0.6
"""The share of a GPU's (or train.peak_tflops') peak the analytic model charges matmuls and bandwidth at: large
16-bit GEMMs reach 60-75% of the dense peak under cuBLAS, and published large runs 38-52% MFU over the whole step
(bubbles and communication, which the simulator adds itself). The CPU's nominal core is a measured-like rate
already."""
DEFAULT_GPU = "H100"
LINK_BYTES_PER_S = {"cuda": 50e9, "cpu": 2e9}
ADAM_BYTES_PER_PARAM = 7 * FP32
"""AdamW reads the fp32 weight, gradient and two moments and writes back the weight and moments."""
REDUCE_BYTES_PER_PARAM = 4 * FP32
"""ReduceGrads' own work: each gradient read and written into the flat buffer, and read and written back."""
TOKEN_BYTES = 8
"""A token id or label (int64)."""


@dataclass(frozen=True)
class DeviceRates:
    """What the analytic model charges work at."""

    name: str
    flops_per_s: float
    """Matmul throughput at the run's precision (a realistic share of the peak: PEAK_EFFICIENCY)."""
    bytes_per_s: float
    """Memory bandwidth, for elementwise work (the planner's machine balance: peak FLOP/s per byte/s)."""
    link_bytes_per_s: float
    """Point-to-point bandwidth between neighbouring stages and across data-parallel replicas."""


def analytic_rates(
    device: str, precision: str, peak_tflops: float | None = None, gpu: str | None = None
) -> DeviceRates:
    """`peak_tflops` (train.peak_tflops) wins; else the GPU's entry in parallel/planning/flops.py's table (`gpu`, or
    an H100 when unknown); a CPU gets a nominal core. A peak is charged at PEAK_EFFICIENCY of itself."""
    if device == "cpu":
        name, flops = "cpu", (peak_tflops * 1e12 * PEAK_EFFICIENCY if peak_tflops else CPU_FLOPS_PER_S)
    else:
        name = gpu if gpu and lookup_peak_tflops(gpu, precision) else DEFAULT_GPU
        flops = (peak_tflops or lookup_peak_tflops(name, precision)) * 1e12 * PEAK_EFFICIENCY
    return DeviceRates(name, flops, flops / MACHINE_BALANCE[device], LINK_BYTES_PER_S[device])


@dataclass(frozen=True)
class TimeModel:
    """Seconds per micro-batch of the model's parts on one device, and the price of the BlockPrices's unit."""

    source: str
    """`measured` (a device profile) or `analytic`."""
    rates: DeviceRates
    table: BlockPrices
    seconds_per_cost: float
    """Seconds per unit of the table's recompute costs (1 for a measured table)."""
    block_forward: float
    block_backward: float
    embedding_forward: float
    embedding_backward: float
    head_forward: float
    """Final norm, LM head and loss."""
    head_backward: float
    block_weight_grad: float
    """The part of `block_backward` that is the Linear layers' weight gradients (ZB-H1's W)."""
    head_weight_grad: float
    """The part of `head_backward` that is the tied LM head's weight gradient."""
    block_backward_input: float
    """ZB-H1's B of a block (its backward without the weight gradients, as the split runs it)."""
    head_backward_input: float
    transfer: float
    """One micro-batch's hidden states between neighbouring stages (activation or gradient)."""
    tied_weight_bytes: int
    param_bytes: int
    """Bytes of one parameter (its gradient travels in the same dtype)."""
    optimizer_per_param: float
    """Seconds of the optimizer step per parameter."""
    load: float
    """A LoadMicroBatch (first and last stage)."""
    reduce_grads_per_param: float
    """ReduceGrads' own work per parameter (the replicas' all-reduce is the links')."""
    exchange: float = 0.0
    """A rank's post of one boundary's batch of messages (virtual-stage schedules; MeasuredSeconds.exchange)."""

    def recompute_cost(self, plan: StagePlan, blocks_in: dict[tuple[int, int], int]) -> float:
        """The table's cost of a plan: each selective block's option, each segment's blocks, and each segment input
        stored compressed (its compression in the forward, charged with the recompute that decompresses it).
        `blocks_in`: blocks inside each of the plan's segments."""
        cost = sum(self.table.selective_cost(modules) for modules in plan.selective.values())
        cost += len(plan.segments) * self.table.compress_cost(plan.compress)
        full, discount = self.table.full_block_cost, self.table.segment_discount
        for segment in plan.segments:
            blocks = blocks_in[segment]
            # nested: the segment's recompute stops before its last block, then every block is remade on its own
            cost += (2 * blocks - 1) * full - blocks * discount if plan.nested else blocks * full - discount
        return cost

    def stage(
        self, stage: int, stages: int, blocks: int, recompute_cost: float, params: int, run: RunShape
    ) -> StageCosts:
        """One stage holding `blocks` blocks (plus the embeddings on the first, the head on the last)."""
        first, last = stage == 0, stage == stages - 1
        forward = blocks * self.block_forward + first * self.embedding_forward + last * self.head_forward
        backward = blocks * self.block_backward + first * self.embedding_backward + last * self.head_backward
        weight_grad = blocks * self.block_weight_grad + last * self.head_weight_grad
        # The embeddings' gradients are B's (a lookup has no matmul to defer).
        backward_input = blocks * self.block_backward_input + first * self.embedding_backward
        backward_input += last * self.head_backward_input
        link = self.rates.link_bytes_per_s
        dp = run.topology.data_parallel_size
        return StageCosts(
            forward=forward,
            backward=backward,
            recompute=recompute_cost * self.seconds_per_cost,
            # every link carries one micro-batch's hidden states: an end stage's receive is priced as its neighbour's
            # send (the simulator's rendezvous lasts the shorter side's cost), the send it never runs is never read
            send_activation=self.transfer,
            send_grad=self.transfer,
            # Two ranks all-reduce the tied embedding's gradient: each sends and receives it once.
            reduce_tied=2 * self.tied_weight_bytes / link if stages > 1 and (first or last) else 0.0,
            # A ring all-reduce moves 2 (dp - 1) / dp of the gradients through each rank, after DeepSpeed has
            # flattened them (at one replica too).
            reduce_grads=params * (self.reduce_grads_per_param + 2 * (dp - 1) / dp * self.param_bytes / link),
            optimizer=params * self.optimizer_per_param,
            load=self.load if first or last else 0.0,
            weight_grad=weight_grad,
            backward_input=backward_input,
            exchange=self.exchange,
        )


def analytic_seconds(shape: Shape, run: RunShape, table: BlockPrices, rates: DeviceRates) -> MeasuredSeconds:
    """What the analytic model charges each part: FLOPs at the matmul rate, elementwise work's bytes at the
    bandwidth; no link was measured."""
    d, bsh, tokens = run.target.dtype_bytes, shape.bsh, shape.b * shape.s
    flops, bandwidth = rates.flops_per_s, rates.bytes_per_s
    # The analytic table's full-block cost is the forward's matmuls plus its elementwise bytes (FLOP-
    # equivalents); backward does twice the matmuls and about the same elementwise work again.
    block = table.full_block_cost / flops
    # Embedding: gather, position add, dropout; its backward scatters the gradient back (bandwidth-bound).
    embedding = 4 * bsh * d / bandwidth
    # Head: final LayerNorm, the (h x V) matmul, then softmax and cross-entropy over fp32 logits.
    head_elementwise = (4 * bsh * d + 3 * tokens * shape.vocab * FP32) / bandwidth
    head = head_forward_flops(shape) / flops
    # the fused loss (model.loss_chunk_tokens) makes the logits once more in backward
    head_backward = (2 + bool(shape.loss_chunk_tokens)) * head + head_elementwise
    backward = block + block_forward_flops(shape) / flops
    # W, the weight-gradient matmuls: one forward's worth of each Linear's FLOPs (the attention core has no weight)
    weight_grad = (block_forward_flops(shape) - attention_core_forward_flops(shape)) / flops
    return MeasuredSeconds(
        **{part: table.selective_cost((part,)) / flops for part in SELECTIVE_PARTS},
        block_recompute=block,
        block_forward=block,
        block_backward=backward,
        block_weight_grad=weight_grad,
        block_backward_input=backward - weight_grad,  # a count of FLOPs and bytes: splitting moves them, adds none
        embedding_forward=embedding,
        embedding_backward=embedding,
        head_forward=head + head_elementwise,
        head_backward=head_backward,
        head_weight_grad=head,
        head_backward_input=head_backward - head,
        optimizer_per_param=ADAM_BYTES_PER_PARAM / bandwidth,
        load=tokens * TOKEN_BYTES / bandwidth,
        reduce_grads_per_param=REDUCE_BYTES_PER_PARAM / bandwidth,
        transfer=None,
        link_bytes_per_s=None,
    )


def time_model(shape: Shape, run: RunShape, table: BlockPrices, rates: DeviceRates) -> TimeModel:
    """Measured where the table carries measured seconds, analytic elsewhere."""
    measured = table.measured is not None
    seconds = table.measured if measured else analytic_seconds(shape, run, table, rates)
    # A measured table's links (two processes measured them) replace the nominal ones.
    if seconds.link_bytes_per_s is not None:
        rates = replace(rates, link_bytes_per_s=seconds.link_bytes_per_s)
    # the fused loss's backward makes the head's weight gradient chunk by chunk: none to defer
    head_w = 0.0 if shape.loss_chunk_tokens else seconds.head_weight_grad
    transfer = seconds.transfer
    if transfer is None:
        transfer = shape.bsh * run.target.dtype_bytes / rates.link_bytes_per_s
    return TimeModel(
        source="measured" if measured else "analytic",
        rates=rates,
        table=table,
        seconds_per_cost=1.0 if measured else 1.0 / rates.flops_per_s,
        block_forward=seconds.block_forward,
        block_backward=seconds.block_backward,
        embedding_forward=seconds.embedding_forward,
        embedding_backward=seconds.embedding_backward,
        head_forward=seconds.head_forward,
        head_backward=seconds.head_backward,
        block_weight_grad=seconds.block_weight_grad,
        head_weight_grad=head_w,
        block_backward_input=seconds.block_backward_input,
        # the fused loss's head defers nothing: its B is its whole backward
        head_backward_input=seconds.head_backward_input if head_w else seconds.head_backward,
        transfer=transfer,
        tied_weight_bytes=shape.vocab * shape.h * run.target.dtype_bytes if shape.tied else 0,  # untied: no reduce
        param_bytes=run.target.dtype_bytes,
        optimizer_per_param=seconds.optimizer_per_param,
        load=seconds.load,
        reduce_grads_per_param=seconds.reduce_grads_per_param,
        exchange=seconds.exchange,
    )


def stage_range_costs(
    model: TimeModel,
    recipes: Sequence[LayerRecipe],
    stage: StageRange,
    plan: StagePlan,
    run: RunShape,
    param_counts: Sequence[int],
) -> StageCosts:
    """One stage's costs: the layers `stage` spans (a real stage, or the balanced search's hypothetical one)
    under `plan`. `param_counts`: model.layer_param_counts(recipes)."""
    is_block = [recipes[i].module_class in BLOCK_CLASSES for i in stage.layers]
    blocks_in = {(a, b): sum(is_block[a:b]) for a, b in plan.segments}
    return model.stage(
        stage.stage,
        run.topology.pipeline_stages,
        sum(is_block),
        model.recompute_cost(plan, blocks_in),
        sum(param_counts[i] for i in stage.layers),
        run,
    )


def per_micro_batch_costs(costs: StageCosts, plan: StagePlan, micro_batches: int) -> StageCosts:
    """A stage's costs with its recompute spread over the step's backward passes: only the micro-batches the
    plan recomputes for pay it (StagePlan.micro_batches), and the simulator charges every backward alike, so
    each pays the mean (the step's busy time is exact; where in the step the recompute falls is not)."""
    if plan.micro_batches is None:
        return costs
    return replace(costs, recompute=costs.recompute * plan.recomputed_count(micro_batches) / micro_batches)
