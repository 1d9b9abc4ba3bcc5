"""What one stage holds and what each block of it could choose: the step between the per-layer models
(memory_model, flops, schedule) and the plans built on them (auto_recompute, layout, run_plan).

Both the auto optimiser and the run plan read a stage's fixed bytes and its per-block options from here,
so each is computed in one place.
"""

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from model import LayerRecipe
from parallel.planning.memory_model import (
    LayerActivation,
    block_full_items,
    block_items,
    model_state_bytes,
    pipe_buffer_bytes,
    selective_combinations,
    stage_activations,
    stage_input_bytes,
    stage_output_bytes,
    stage_weight_grad_bytes,
    total,
)
from parallel.planning.partition import StageRange
from parallel.planning.schedule_walk import ActivationPeak, activation_peak, in_flight_micro_batches, pipe_buffers
from parallel.planning.shapes import FP32, RunShape, Shape, Target
from parallel.planning.stage_plan import StagePlan


@dataclass(frozen=True)
class BlockOption:
    """One per-block choice short of a full-recompute segment."""

    choice: str
    """`none` or `selective:<modules>`."""
    modules: tuple[str, ...]
    kept_bytes: int
    """Bytes one block keeps per micro-batch."""
    cost: float
    """Recompute cost of one block per micro-batch (FLOPs, FLOP-equivalents or seconds: the caller's unit)."""


def block_options(shape: Shape, target: Target, cost: Callable[[tuple[str, ...]], float]) -> list[BlockOption]:
    """`none`, then every selective combination, with the bytes each keeps and `cost(modules)`."""
    options = [BlockOption("none", (), total(block_items(shape, target)), 0.0)]
    options += [
        BlockOption("selective:" + "+".join(combo), combo, total(block_items(shape, target, combo)), float(cost(combo)))
        for combo in selective_combinations()
    ]
    return options


@dataclass(frozen=True)
class StageMemory:
    """What one stage holds during a step under one plan (bytes unless said otherwise)."""

    stage: int
    params: int
    """Trainable parameters (a tied module counts on each stage that holds it)."""
    states: dict[str, int]
    """Parameter, gradient and optimizer-state bytes: keys params, grads, optimizer."""
    in_flight: int
    """Micro-batches whose activations the stage holds at once under 1F1B."""
    pipe_buffers: int
    pipe_buffer_bytes: int
    layers: tuple[LayerActivation, ...]
    """Per-layer activation bytes per micro-batch (the loss last, on the last stage)."""
    recomputed_in_flight: int
    """Of the micro-batches in flight, those that run under the plan at the peak: all, unless
    `recompute.micro_batches` (StagePlan.micro_batches) leaves the others to keep what `none` keeps."""
    plain_layers: tuple[LayerActivation, ...]
    """`layers` of a micro-batch that runs with no recompute."""
    schedule_peak: ActivationPeak | None = None
    """zb-h1 or early recompute: the activation peak of a walk of the stage's schedule
    (parallel/planning/schedule_walk.py),
    W-pending and early-recomputed micro-batches included; None under plain 1F1B."""
    transfer_buffers: dict[str, int] = field(default_factory=dict)
    """DeepSpeed's buffers alive all step besides the pipe buffers (`transfer_buffers`)."""
    working_sets: dict[str, int] = field(default_factory=dict)
    """Transient bytes of the backward on top of what the stage keeps (`backward_working_sets`)."""
    tensor_peak: ActivationPeak | None = None
    """The walk of the stage's schedule with each backward's working set inside it: the activations and the
    working set live together at the stage's peak moment."""
    tensor_peak_working_set: str = ""
    """The name of the working set at that moment (`backward_working_sets`' keys; empty when none)."""

    @property
    def activation_bytes(self) -> int:
        """Kept for backward per micro-batch that runs under the plan, the stage input included."""
        return sum(layer.bytes for layer in self.layers)

    @property
    def plain_activation_bytes(self) -> int:
        """Kept for backward per micro-batch that runs with no recompute."""
        return sum(layer.bytes for layer in self.plain_layers)

    @property
    def peak_activation_bytes(self) -> int:
        """The micro-batches live at the peak: the recomputed ones and the plain ones (StagePlan's rule)."""
        if self.schedule_peak is not None:
            return self.schedule_peak.bytes
        plain = self.in_flight - self.recomputed_in_flight
        return self.recomputed_in_flight * self.activation_bytes + plain * self.plain_activation_bytes

    @property
    def fixed_bytes(self) -> int:
        """Everything but the blocks' activations: what no recompute choice changes."""
        others = sum(layer.bytes for layer in self.layers if not layer.is_block)
        return sum(self.states.values()) + self.pipe_buffer_bytes + self.in_flight * others

    @property
    def predicted_peak_bytes(self) -> int:
        return sum(self.states.values()) + self.peak_activation_bytes + self.pipe_buffer_bytes

    @property
    def peak_tensor_terms(self) -> dict[str, int]:
        """Live tensor bytes at the stage's peak, by name (parallel/measurement/tensor_peak.py measures the same):
        the states, the pipe buffers and DeepSpeed's transfer buffers, the activations live at the peak, and the
        largest of the backward's working sets, which run one at a time."""
        terms = {**self.states, "pipe buffers": self.pipe_buffer_bytes, **self.transfer_buffers}
        peak = self.tensor_peak
        terms["activations"] = peak.bytes - peak.working_set
        if self.tensor_peak_working_set:
            terms[f"working set: {self.tensor_peak_working_set}"] = peak.working_set
        return terms

    @property
    def predicted_peak_tensor_bytes(self) -> int:
        return sum(self.peak_tensor_terms.values())


def stage_memory(
    recipes: Sequence[LayerRecipe],
    stage: StageRange,
    plan: StagePlan,
    shape: Shape,
    run: RunShape,
    param_counts: Sequence[int],
    schedule: str = "1f1b",
) -> StageMemory:
    """`param_counts`: parallel.planning.partition.layer_param_counts(recipes), counted once per layout. `schedule`: the
    layout's (parallel/planning/schedules.py); with `plan.early` it decides what the peak holds."""
    num_stages = run.topology.pipeline_stages
    is_last = stage.stage == num_stages - 1
    in_flight = in_flight_micro_batches(run.micro_batches, num_stages, stage.stage)
    buffers = pipe_buffers(run.micro_batches, num_stages, stage.stage)
    params = sum(param_counts[i] for i in stage.layers)
    layers = tuple(stage_activations(recipes, stage.layers, plan, shape, run.target, is_last))
    plain_layers = tuple(stage_activations(recipes, stage.layers, StagePlan(), shape, run.target, is_last))
    kept, plain = sum(a.bytes for a in layers), sum(a.bytes for a in plain_layers)
    under_plan = [plan.recomputes_micro_batch(k) for k in range(run.micro_batches)]
    sets = backward_working_sets(layers, plan, shape, run.target)
    # A micro-batch recomputed early has its segments remade before its backward: the walk holds those bytes as
    # `recomputed`, so its backward's working set is what is left.
    early_sets = {k: v for k, v in sets.items() if k != "segment recompute"}
    plain_sets = backward_working_sets(plain_layers, StagePlan(), shape, run.target)
    own_sets = early_sets if plan.early and not is_last else sets
    working = [max((own_sets if p else plain_sets).items(), key=lambda i: i[1], default=("", 0)) for p in under_plan]

    weights_pending = stage_weight_grad_bytes(recipes, stage.layers, shape, run.target)

    def walk(transient: bool) -> ActivationPeak:
        return activation_peak(
            schedule,
            plan.early,
            [kept if p else plain for p in under_plan],
            weights_pending,
            [plain - kept if p else 0 for p in under_plan],
            run.micro_batches,
            num_stages,
            stage.stage,
            plan.deferred_weights,
            [w[1] for w in working] if transient else None,
        )

    schedule_peak = walk(transient=False) if schedule != "1f1b" or plan.early else None
    tensor_peak = walk(transient=True)
    return StageMemory(
        stage=stage.stage,
        params=params,
        states=model_state_bytes(params, run.target.precision, run.zero_stage, run.topology.data_parallel_size),
        in_flight=in_flight,
        pipe_buffers=buffers,
        pipe_buffer_bytes=pipe_buffer_bytes(stage.stage, is_last, shape, run.target, buffers, in_flight),
        layers=layers,
        recomputed_in_flight=plan.recomputed_in_flight(in_flight),
        plain_layers=plain_layers,
        schedule_peak=schedule_peak,
        transfer_buffers=transfer_buffers(stage.stage, num_stages, buffers, shape, run.target),
        working_sets=sets,
        tensor_peak=tensor_peak,
        tensor_peak_working_set="" if tensor_peak.backward_of is None else working[tensor_peak.backward_of][0],
    )


def transfer_buffers(stage_index: int, num_stages: int, buffers: int, shape: Shape, target: Target) -> dict[str, int]:
    """What DeepSpeed 0.19.8's PipelineEngine holds besides pipe_buffer_bytes' inputs and outputs, from its first
    step on:

    - `recv buffer` (every stage but the first): `pipe_recv_buf`, the one tensor each RecvActivation receives
      into before it clones it into a pipe buffer;
    - `grad buffer` (every stage but the last): `grad_layer`, the one tensor each RecvGrad receives the output's
      gradient into;
    - `kept input grads` (the last stage of several): the last stage never drops its outputs, and each output's
      autograd graph keeps its received input (counted as a pipe buffer) with the `.grad` its backward filled:
      at the peak, during a backward, every buffer but the one being processed holds one.
    """
    out = {}
    if stage_index > 0:
        out["recv buffer"] = stage_input_bytes(stage_index, shape, target)
    if stage_index < num_stages - 1:
        out["grad buffer"] = stage_output_bytes(False, shape, target)
    elif num_stages > 1:
        out["kept input grads"] = (buffers - 1) * stage_input_bytes(stage_index, shape, target)
    return out


def backward_working_sets(layers: Sequence[LayerActivation], plan: StagePlan, shape: Shape, target: Target) -> dict:
    """Transient bytes one backward pass allocates on top of what the stage keeps, where each is largest (d: the
    activation and parameter dtype's bytes, N = b s tokens, C = h):

    - `block backward`: a block's backward starts with its second MLP matmul, and that node holds the most: the
      gradient of its (N, 4C) input and the fresh gradients of its (4C, C) weight and C bias before AccumulateGrad
      adds them into `.grad`, d (4 N C + 4 C^2 + C), and when the stage's last block (whose backward comes first,
      with the most still kept) recomputes `mlp_act`, the GELU output that node remakes, 4 N C d more; everything
      before it in the backward is freed as it goes (not modelled: the attention core's own recompute under
      selective `core_attn`, or the MLP's under `mlp`);
    - `segment recompute` (full recompute): backward remakes the largest segment's forward at once, so it holds
      what its blocks keep without recompute, less the segment input it keeps anyway, and a block backward on top;
    - `loss backward` (the last stage): the unfused loss holds the gradients of its fp32 log-probabilities and of
      the fp32 logits together, 2 N V 4 bytes; the fused loss (model/fused_loss.py) holds the hidden states'
      gradient (N C d), the tied weight's in fp32 (V C 4) and a chunk's fp32 logits (k V 4, k =
      min(model.loss_chunk_tokens, N)), plus their copy in d when d is not fp32; with more than one chunk, two
      chunks' worth, since the loop makes the next chunk's logits while the previous chunk's are still bound.
    """
    d, tokens, h = target.dtype_bytes, shape.b * shape.s, shape.h
    blocks = [local for local, layer in enumerate(layers) if layer.is_block]
    sets = {}
    if blocks:
        remakes_gelu = "mlp_act" in plan.selective.get(blocks[-1], ())  # the stage's backward starts at its last
        sets["block backward"] = d * (4 * tokens * h + 4 * h * h + h + (4 * tokens * h if remakes_gelu else 0))
    segment = max((sum(layer.is_block for layer in layers[a:b]) for a, b in plan.segments), default=0)
    if segment:
        remade = segment * total(block_items(shape, target)) - total(block_full_items(shape, target, True))
        sets["segment recompute"] = remade + sets["block backward"]
    if layers and layers[-1].name == "loss":
        if shape.loss_chunk_tokens:
            chunk = min(shape.loss_chunk_tokens, tokens) * shape.vocab
            chunks = 2 if tokens > shape.loss_chunk_tokens else 1  # the previous chunk's, still bound
            per_chunk = chunk * (FP32 + (d if d != FP32 else 0))
            sets["loss backward"] = tokens * h * d + shape.vocab * h * FP32 + chunks * per_chunk
        else:
            sets["loss backward"] = 2 * tokens * shape.vocab * FP32
    return sets
