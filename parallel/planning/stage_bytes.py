"""What one stage holds, in bytes: the step between the per-layer models (memory_model, schedule) and the plans
built on them (auto_recompute, layout, run_plan). Both the auto optimiser and the run plan read a stage's fixed bytes
from here, so they are computed in one place; what each block option keeps is parallel/planning/block_prices.py's.
"""

from collections.abc import Sequence
from dataclasses import dataclass, field

from model import LayerRecipe
from parallel.planning.memory_model import (
    LayerActivation,
    causal_mask_bytes,
    pipe_buffer_bytes,
    stage_activations,
    stage_input_bytes,
    stage_output_bytes,
)
from parallel.planning.model_states import (
    largest_parameter,
    model_state_bytes,
    optimizer_step_bytes,
    reduce_grads_bytes,
)
from parallel.planning.partition import StageRange
from parallel.planning.schedule_walk import ActivationPeak, activation_peak, in_flight_micro_batches, pipe_buffers
from parallel.planning.shapes import RunShape, Shape, Target
from parallel.planning.stage_plan import StagePlan
from parallel.planning.weight_grad_bytes import stage_weight_grad_bytes
from parallel.planning.working_set import backward_working_sets, early_remade_bytes, early_working_sets


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
    causal_masks: int = 0
    """The causal masks the stage's blocks keep from step to step (memory_model.causal_mask_bytes)."""
    optimizer_step: int = 0
    """What the optimizer step allocates on top of the states, after every backward (model_states'
    optimizer_step_bytes)."""
    reduce_grads: int = 0
    """What ReduceGrads allocates on top of the states, after every backward and before the optimizer step
    (model_states' reduce_grads_bytes: the flattened gradients)."""
    after_backward_buffers: int = 0
    """What DeepSpeed's pipe buffers still hold once every backward is done (`after_backward_buffers`)."""
    working_sets: dict[str, int] = field(default_factory=dict)
    """Transient bytes of the backward on top of what the stage keeps (parallel/planning/working_set.py)."""
    tensor_peak: ActivationPeak | None = None
    """The walk of the stage's schedule with each backward's working set inside it: the activations and the
    working set live together at the stage's peak moment."""
    tensor_peak_working_set: str = ""
    """The name of the working set at that moment (parallel/planning/working_set.py's names; empty when none)."""

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
        """Everything but the blocks' activations and the backward's working set: what no recompute choice changes."""
        others = sum(layer.bytes for layer in self.layers if not layer.is_block)
        buffers = self.pipe_buffer_bytes + sum(self.transfer_buffers.values()) + self.causal_masks
        return sum(self.states.values()) + buffers + self.in_flight * others

    @property
    def predicted_peak_bytes(self) -> int:
        """The stage's peak: the most live tensor bytes at once over a step, the sum of `peak_tensor_terms`."""
        return sum(self.peak_tensor_terms.values())

    @property
    def peak_tensor_terms(self) -> dict[str, int]:
        """Live tensor bytes at the stage's peak, by name (parallel/measurement/tensor_peak.py measures the same):
        the states, the pipe buffers and DeepSpeed's transfer buffers, the causal masks, the activations live at
        the peak, and the largest of the backward's working sets, which run one at a time."""
        terms = {**self.states, "pipe buffers": self.pipe_buffer_bytes, **self.transfer_buffers}
        if self.causal_masks:
            terms["causal masks"] = self.causal_masks
        peak = self.tensor_peak
        name, after = self.after_backward
        # After every backward no activations are left
        if self.after_backward_buffers + after > self.pipe_buffer_bytes + peak.bytes:
            terms.update({"pipe buffers": self.after_backward_buffers, "activations": 0, f"working set: {name}": after})
            return terms
        terms["activations"] = peak.bytes - peak.working_set
        if self.tensor_peak_working_set:
            terms[f"working set: {self.tensor_peak_working_set}"] = peak.working_set
        return terms

    @property
    def after_backward(self) -> tuple[str, int]:
        """The most the step allocates on top of the states once every backward is done, and its moment's name:
        ReduceGrads' flattened gradients, then the optimizer step's transient."""
        return max(("optimizer step", self.optimizer_step), ("reduce grads", self.reduce_grads), key=lambda m: m[1])

    @property
    def optimizer_floor(self) -> int:
        """`after_backward` beyond `fixed_bytes` (which holds the pipe buffers and the other layers' in-flight
        activations as they are at the peak, not as the step leaves them): working_set.StageWorking's floor."""
        others = sum(layer.bytes for layer in self.layers if not layer.is_block)
        after = self.after_backward[1]
        return after + self.after_backward_buffers - self.pipe_buffer_bytes - self.in_flight * others


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
    largest = largest_parameter(recipes, stage.layers, shape)
    layers = tuple(stage_activations(recipes, stage.layers, plan, shape, run.target, is_last))
    plain_layers = tuple(stage_activations(recipes, stage.layers, StagePlan(), shape, run.target, is_last))
    kept, plain = sum(a.bytes for a in layers), sum(a.bytes for a in plain_layers)
    under_plan = [plan.recomputes_micro_batch(k) for k in range(run.micro_batches)]
    split = schedule == "zb-h1"  # B defers the weight gradients and keeps what W needs
    sets = backward_working_sets(layers, plan, shape, run.target, split)
    plain_sets = backward_working_sets(plain_layers, StagePlan(), shape, run.target, split)
    early = plan.early and not is_last
    # A micro-batch recomputed early holds what `none` keeps when its backward starts (the walk adds the remade bytes
    # as `recomputed`), so its backward's working set is none's; a nested one holds its block inputs, and remakes
    # each block's interior in the backward.
    own_sets = early_working_sets(layers, plain_sets, plan, shape, run.target, split) if early else sets
    working = [max((own_sets if p else plain_sets).items(), key=lambda i: i[1], default=("", 0)) for p in under_plan]

    weights_pending = stage_weight_grad_bytes(recipes, stage.layers, shape, run.target)
    early_remade = early_remade_bytes(plan, layers, plain_layers, shape, run.target)
    # A stage between two others under posted sends (every stage's `early` is recompute.early's) holds each input
    # gradient it sent until the previous stage surely has it; the last stage's are its kept outputs' anyway.
    posted = (schedule != "1f1b" or plan.early) and 0 < stage.stage < num_stages - 1
    posted_grad_bytes = stage_input_bytes(stage.stage, shape, run.target) if posted else 0

    def walk(transient: bool) -> ActivationPeak:
        return activation_peak(
            schedule,
            plan.early,
            [kept if p else plain for p in under_plan],
            weights_pending,
            [early_remade if p else 0 for p in under_plan],
            run.micro_batches,
            num_stages,
            stage.stage,
            plan.deferred_weights,
            [w[1] for w in working] if transient else None,
            posted_grad_bytes,
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
        after_backward_buffers=after_backward_buffers(stage.stage, num_stages, buffers, in_flight, shape, run.target),
        layers=layers,
        recomputed_in_flight=plan.recomputed_in_flight(in_flight),
        plain_layers=plain_layers,
        schedule_peak=schedule_peak,
        transfer_buffers=transfer_buffers(stage.stage, num_stages, buffers, shape, run.target),
        causal_masks=sum(layer.is_block for layer in layers) * causal_mask_bytes(shape, run.target),
        optimizer_step=optimizer_step_bytes(
            largest, params, run.target, run.zero_stage, run.topology.data_parallel_size
        ),
        reduce_grads=reduce_grads_bytes(largest, params, run.target, run.zero_stage),
        working_sets=sets,
        tensor_peak=tensor_peak,
        tensor_peak_working_set="" if tensor_peak.backward_of is None else working[tensor_peak.backward_of][0],
    )


def after_backward_buffers(
    stage_index: int, num_stages: int, buffers: int, in_flight: int, shape: Shape, target: Target
) -> int:
    """What DeepSpeed 0.19.8's pipe buffers hold once every backward of the step is done (ReduceGrads and the
    optimizer step come then; measured with the stage replay): a stage frees each output after its backward and each
    received input once it sent the input's gradient. So the first stage keeps only its token ids (it sends no
    gradient), a middle stage nothing, and the last stage, which never drops its outputs, every buffer's input and
    output, each input's gradient (one more than `transfer_buffers`' kept input grads) and its labels."""
    if stage_index == num_stages - 1:
        outputs = pipe_buffer_bytes(stage_index, True, shape, target, buffers, in_flight)
        if shape.loss_chunk_tokens:  # the fused loss's kept outputs, counted with the activations at the peak
            outputs += in_flight * stage_output_bytes(True, shape, target)
        grads = stage_input_bytes(stage_index, shape, target) if num_stages > 1 else 0
        return outputs + grads + buffers * stage_input_bytes(0, shape, target)
    return buffers * stage_input_bytes(0, shape, target) if stage_index == 0 else 0


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
