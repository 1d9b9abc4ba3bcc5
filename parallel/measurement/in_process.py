"""A pipeline stage's work and its neighbours in this process, for the interpreter of a stage's programme
(parallel/runtime/stage_interpreter.py): the stage replay runs one stage against `FakeNeighbours`, the local pipeline
every stage against `LinkedNeighbours`.

`LocalStageWork` keeps what DeepSpeed 0.19.8's PipelineEngine keeps in its buffers:

- LoadMicroBatch: the token ids (first stage) and labels (last stage) into the buffer;
- RecvActivation: into one receive buffer, cloned into the pipe buffer, which requires grad;
- ForwardPass: the stage runs on a clone of its pipe buffer and its output is kept in the buffer; the last stage
  computes the loss (and keeps only the last one);
- RecvGrad: into the gradient buffer (a fresh one under posted sends, as the engine's);
- BackwardPass (B): the loss's backward on the last stage, which never drops its outputs; the output's backward with
  the received gradient elsewhere, after which the output is dropped;
- SendGrad: the input's gradient is sent and the pipe buffer's input dropped;
- ReduceGrads: the gradients flattened into one buffer and copied back, which DeepSpeed does at one data-parallel
  replica too (its all-reduce over a group of one between);
- OptimizerStep: the optimizer given, if any (the local pipeline leaves the step to its caller), after clipping as
  DeepSpeed clips (`clip_as_deepspeed`) where `grad_clip` is given.
"""

from collections import defaultdict, deque
from collections.abc import Sequence
from contextlib import nullcontext

import torch
import torch.nn as nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from model import head_module
from model.fused_loss import HeadLoss
from model.weight_grad import WeightGradStore
from parallel.measurement.activation_meter import ActivationMeter
from parallel.runtime.chunk_work import MicroBatchSource
from parallel.runtime.planned_layers import PlannedLayers
from parallel.runtime.recompute import run_stage
from parallel.runtime.stage_interpreter import Recv, Send, Work


class LocalStage(PlannedLayers):
    """A stage's planned layers (parallel/runtime/planned_layers.py: its arguments), with the activation meter the
    replay reads."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.meter = ActivationMeter(self.parameters)


class LocalStageWork:
    """One stage's computation and buffers (the module docstring). `hidden`: a micro-batch's hidden states, (b, s, h),
    in `dtype`."""

    def __init__(
        self,
        stage: LocalStage,
        index: int,
        stages: int,
        loss_fn: HeadLoss,
        hidden: tuple[int, int, int],
        dtype: torch.dtype,
        buffers: int,
        data: MicroBatchSource,
        optimizer: torch.optim.Optimizer | None = None,
        grad_clip: float = 0.0,
    ):
        self.stage, self.plan, self.index = stage, stage.plan, index
        self.first, self.last = index == 0, index == stages - 1
        self.loss_fn, self.data, self.optimizer, self.grad_clip = loss_fn, data, optimizer, grad_clip
        device = next(stage.parameters()).device  # the local pipeline's stages may have been moved to a GPU
        self.recv_buffer = None if self.first else torch.zeros(hidden, dtype=dtype, device=device)
        self.grad_buffer = None if self.last else torch.zeros(hidden, dtype=dtype, device=device)
        self.inputs: list[torch.Tensor | None] = [None] * buffers
        self.outputs: list[torch.Tensor | None] = [None] * buffers
        self.labels: list[torch.Tensor | None] = [None] * buffers
        self.loss: torch.Tensor | None = None
        self.losses: list[torch.Tensor] = []
        """The last stage's loss of each micro-batch this step."""
        self.measure = False
        """Record each micro-batch's forward (and the loss) with the stage's activation meter."""
        self.loads = self.forwards = 0

    def start_step(self) -> None:
        self.loads = self.forwards = 0
        self.losses = []

    def load_micro_batch(self, buffer_id: int) -> None:
        tokens, labels = self.data(self.loads)
        self.loads += 1
        if self.first:
            self.inputs[buffer_id] = tokens
        if self.last:
            self.labels[buffer_id] = labels

    def forward(self, buffer_id: int) -> None:
        x = self.inputs[buffer_id].clone()
        recompute = self.plan.recomputes_micro_batch(self.forwards)
        self.forwards += 1
        with self.stage.meter.record(stage_input=x) if self.measure else nullcontext():
            output = run_stage(self.stage.funcs, self.plan, x, recompute, first_layer=self.stage.stage.start)
        self.outputs[buffer_id] = output
        if self.last:
            head_weight = head_module(self.stage.funcs[-1]).head_weight  # tied (the embedding's) or untied
            with self.stage.meter.record(new=False) if self.measure else nullcontext():
                self.loss = self.loss_fn(output, self.labels[buffer_id], head_weight)
            self.losses.append(self.loss.detach())

    def backward(self, buffer_id: int) -> None:
        if self.last:
            self.loss.backward()
            return
        self.outputs[buffer_id].backward(self.grad_buffer)
        self.outputs[buffer_id] = None

    def send_activation(self, buffer_id: int, send: Send) -> None:
        send(self.outputs[buffer_id], self.index + 1)

    def recv_activation(self, buffer_id: int, recv: Recv) -> None:
        recv(self.recv_buffer, self.index - 1)
        self.inputs[buffer_id] = self.recv_buffer.clone().detach().requires_grad_()

    def send_grad(self, buffer_id: int, send: Send) -> None:
        send(self.inputs[buffer_id].grad, self.index - 1)
        self.inputs[buffer_id] = None

    def recv_grad(self, buffer_id: int, recv: Recv) -> None:
        recv(self.grad_buffer, self.index + 1)

    def fresh_grad_buffer(self, buffer_id: int) -> torch.Tensor:
        self.grad_buffer = torch.empty_like(self.outputs[buffer_id])
        return self.grad_buffer

    def apply_weight_grads(self, store: WeightGradStore) -> None:
        store.apply_oldest()

    def reduce_tied_grads(self) -> None:
        pass  # each stage keeps its own copy of a tied weight, with its own gradient

    def reduce_grads(self) -> None:
        # DeepSpeed 0.19.8's engine.allreduce_bucket: one flat buffer of every gradient, all-reduced (over one replica
        # here: nothing moves) and copied back
        grads = [p.grad for p in self.stage.parameters() if p.grad is not None]
        if grads:
            flat = _flatten_dense_tensors(grads)
            for grad, reduced in zip(grads, _unflatten_dense_tensors(flat, grads)):
                grad.copy_(reduced)

    def optimizer_step(self) -> None:
        if self.optimizer is not None:
            if self.grad_clip > 0:
                clip_as_deepspeed(list(self.stage.parameters()), self.grad_clip)
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=False)  # DeepSpeed keeps its gradient buffers between steps


def clip_as_deepspeed(params: Sequence[nn.Parameter], max_norm: float) -> None:
    """DeepSpeed 0.19.8's clip_grad_norm_ (runtime/utils.py) on one stage of one replica as stagecheck's engine runs it
    (every stage adds up its own gradients' norms: parallel/runtime/engine.py's `counted_on_every_stage`), its
    all-reduces over the stages and the replicas left out: the norms one parameter at a time, then every gradient
    scaled by the clipping coefficient."""
    grads = [p.grad for p in params if p.grad is not None and not getattr(p, "ds_pipe_replicated", False)]
    norms = [grad.detach().float().norm(2) for grad in grads]
    total = torch.stack(norms).pow(2).sum() if norms else torch.zeros(())
    coefficient = torch.clamp(max_norm / (total.sqrt() + 1e-6), max=1.0)
    for grad in (p.grad for p in params if p.grad is not None):
        grad.mul_(coefficient)


class FakeNeighbours:
    """A stage's neighbours in this process: every send is received at once, every receive gets random values of the
    buffer's shape."""

    def send(self, tensor: torch.Tensor, stage: int) -> None:
        pass

    def recv(self, tensor: torch.Tensor, stage: int) -> None:
        tensor.normal_()

    def post(self, sends: Sequence[tuple[torch.Tensor, int]], recvs: Sequence[tuple[torch.Tensor, int]]) -> list[Work]:
        for tensor, stage in recvs:
            self.recv(tensor, stage)
        return []


class _PostedRecv:
    """A posted receive, filled when waited for (the message has arrived by then: `LinkedNeighbours.ready`)."""

    def __init__(self, neighbours: "LinkedNeighbours", tensor: torch.Tensor, stage: int):
        self.neighbours, self.tensor, self.stage = neighbours, tensor, stage
        self.done = False

    def wait(self) -> None:
        if not self.done:
            self.neighbours.recv(self.tensor, self.stage)
            self.done = True


class _Sent:
    def wait(self) -> None:
        pass


class LinkedNeighbours:
    """Stage `stage`'s end of in-process links to the other stages of one pipeline: a send is queued (a copy, as the
    wire would carry it) until its peer receives it. `pipes` is shared by every stage's end."""

    def __init__(self, pipes: defaultdict[tuple[int, int], deque[torch.Tensor]], stage: int):
        self.pipes, self.stage = pipes, stage

    def send(self, tensor: torch.Tensor, stage: int) -> None:
        self.pipes[(self.stage, stage)].append(tensor.detach().clone())

    def recv(self, tensor: torch.Tensor, stage: int) -> None:
        tensor.copy_(self.pipes[(stage, self.stage)].popleft())

    def post(self, sends: Sequence[tuple[torch.Tensor, int]], recvs: Sequence[tuple[torch.Tensor, int]]) -> list[Work]:
        for tensor, stage in sends:
            self.send(tensor, stage)
        return [_Sent() for _ in sends] + [_PostedRecv(self, tensor, stage) for tensor, stage in recvs]

    def ready(self, stage: int) -> bool:
        """Whether a message from `stage` is waiting."""
        return bool(self.pipes[(stage, self.stage)])
