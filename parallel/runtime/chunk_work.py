"""The StageWork (parallel/runtime/stage_interpreter.py) of one model chunk on a rank of a virtual-stage schedule
(parallel/planning/virtual_schedules.py), with the micro-batch as its buffer.

A chunk keeps each micro-batch's input, output, labels, received gradient and loss in a slot of its own, each dropped
once read: its programme receives a gradient at the boundary where it was sent, which may come before the backward
of an earlier micro-batch, and the last chunk may run another forward between a micro-batch's forward and its
backward (DeepSpeed's one gradient buffer and one loss serve 1F1B only). Its receives land at the boundary's flush
(parallel/runtime/boundary_links.py), so each receives into a tensor of its own, read by a later step only.

The last chunk's backward runs on its loss divided by the micro-batches, as DeepSpeed's engine scales it
(`DeepSpeedEngine.backward`), so gradients accumulate as under DeepSpeed's 1F1B, bit for bit. The once-per-step
instructions reach every chunk of the rank; the rank's `RankStep` runs them once, for the chunk given it.
"""

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Protocol

import torch

from model import head_module
from model.fused_loss import HeadLoss
from model.weight_grad import WeightGradStore
from parallel.runtime.planned_layers import PlannedLayers
from parallel.runtime.recompute import run_stage
from parallel.runtime.stage_interpreter import Recv, Send

MicroBatchSource = Callable[[int], tuple[torch.Tensor, torch.Tensor]]
"""Micro-batch k's (token ids, labels), each (b, s)."""

BackwardScope = Callable[[], AbstractContextManager]
"""Around each backward and W of a chunk: its optimizer's gradient bookkeeping (DeepSpeed's, on the engine:
parallel/runtime/engine_backward.py); none in one process."""

ForwardScope = Callable[[int, torch.Tensor | None, bool], AbstractContextManager]
"""Around each forward of a chunk and the last chunk's loss: (virtual stage, the chunk's input (None for the loss),
whether a micro-batch's forward starts (False: the loss adds to it)) -> what records it (the activation meter of a
metered step: harness/virtual_accounting.py)."""


def unobserved(stage: int, x: torch.Tensor | None, new: bool) -> AbstractContextManager:
    """No recording: a step that is not metered."""
    return nullcontext()


class RankStep(Protocol):
    """What a rank does once per training step, after all its chunks' backwards."""

    def reduce_tied_grads(self) -> None: ...

    def reduce_grads(self) -> None: ...

    def optimizer_step(self) -> None: ...


class ChunkStageWork:
    """Virtual stage `stage` of `stages`, its layers `chunk`, for one training step of `micro_batches`; `hidden` is a
    micro-batch's hidden states, (b, s, h), in `dtype`. `rank_step`: given to the rank's last chunk only."""

    def __init__(
        self,
        chunk: PlannedLayers,
        stage: int,
        stages: int,
        loss_fn: HeadLoss,
        hidden: tuple[int, int, int],
        dtype: torch.dtype,
        micro_batches: int,
        data: MicroBatchSource,
        rank_step: RankStep | None,
        backward_scope: BackwardScope = nullcontext,
        forward_scope: ForwardScope = unobserved,
    ):
        self.chunk, self.stage, self.micro_batches = chunk, stage, micro_batches
        self.first, self.last = stage == 0, stage == stages - 1
        self.loss_fn, self.data, self.rank_step = loss_fn, data, rank_step
        self.backward_scope, self.forward_scope = backward_scope, forward_scope
        self.hidden, self.dtype, self.device = hidden, dtype, next(chunk.parameters()).device
        self.inputs: list[torch.Tensor | None] = [None] * micro_batches
        self.outputs: list[torch.Tensor | None] = [None] * micro_batches
        self.labels: list[torch.Tensor | None] = [None] * micro_batches
        self.grads: list[torch.Tensor | None] = [None] * micro_batches
        self.losses: list[torch.Tensor | None] = [None] * micro_batches
        self.step_losses: list[torch.Tensor] = []
        """The last chunk's loss of each micro-batch, detached, in micro-batch order."""

    def _received(self) -> torch.Tensor:
        return torch.empty(self.hidden, dtype=self.dtype, device=self.device)

    def load_micro_batch(self, buffer_id: int) -> None:
        tokens, labels = self.data(buffer_id)
        if self.first:
            self.inputs[buffer_id] = tokens.to(self.device)
        if self.last:
            self.labels[buffer_id] = labels.to(self.device)

    def forward(self, buffer_id: int) -> None:
        plan = self.chunk.plan
        # A received activation (complete since its boundary's flush) becomes the leaf whose gradient SendGrad sends.
        x = self.inputs[buffer_id] if self.first else self.inputs[buffer_id].requires_grad_()
        # A chunk runs its micro-batches' forwards in order: the k-th forward of the step is micro-batch k's.
        recompute = plan.recomputes_micro_batch(buffer_id)
        with self.forward_scope(self.stage, x, True):
            output = run_stage(self.chunk.funcs, plan, x, recompute, first_layer=self.chunk.stage.start)
        if self.first:  # no gradient goes back from the token ids
            self.inputs[buffer_id] = None
        if not self.last:
            self.outputs[buffer_id] = output  # (b, s, h)
            return
        head_weight = head_module(self.chunk.funcs[-1]).head_weight  # tied (the embedding's) or untied
        with self.forward_scope(self.stage, None, False):
            self.losses[buffer_id] = self.loss_fn(output, self.labels[buffer_id], head_weight)
        self.labels[buffer_id] = None
        self.step_losses.append(self.losses[buffer_id].detach())

    def backward(self, buffer_id: int) -> None:
        """The micro-batch's backward (B under a deferring weight-gradient store)."""
        with self.backward_scope():
            if self.last:
                (self.losses[buffer_id] / self.micro_batches).backward()
                self.losses[buffer_id] = None
                return
            self.outputs[buffer_id].backward(self.grads[buffer_id])
        self.outputs[buffer_id] = self.grads[buffer_id] = None

    def send_activation(self, buffer_id: int, send: Send) -> None:
        send(self.outputs[buffer_id].detach(), self.stage + 1)

    def recv_activation(self, buffer_id: int, recv: Recv) -> None:
        self.inputs[buffer_id] = self._received()
        recv(self.inputs[buffer_id], self.stage - 1)

    def send_grad(self, buffer_id: int, send: Send) -> None:
        send(self.inputs[buffer_id].grad, self.stage - 1)
        self.inputs[buffer_id] = None

    def recv_grad(self, buffer_id: int, recv: Recv) -> None:
        self.grads[buffer_id] = self._received()
        recv(self.grads[buffer_id], self.stage + 1)

    def fresh_grad_buffer(self, buffer_id: int) -> torch.Tensor:
        raise RuntimeError(
            "a chunk's sends are never posted by its interpreter: recv_grad makes each gradient's tensor"
        )

    def apply_weight_grads(self, store: WeightGradStore) -> None:
        with self.backward_scope():
            store.apply_oldest()

    def reduce_tied_grads(self) -> None:
        if self.rank_step is not None:
            self.rank_step.reduce_tied_grads()

    def reduce_grads(self) -> None:
        if self.rank_step is not None:
            self.rank_step.reduce_grads()

    def optimizer_step(self) -> None:
        if self.rank_step is not None:
            self.rank_step.optimizer_step()
