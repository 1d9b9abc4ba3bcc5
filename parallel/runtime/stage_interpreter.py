"""The one interpreter of a stage's programme (parallel/planning/schedules.py's StageProgram): DeepSpeed's engine
(parallel/runtime/zero_bubble_engine.py), the stage replay and the local pipeline (parallel/measurement/) all run a
stage's instructions through `StageInterpreter.execute`, so what one holds and does, all do.

What differs between them is behind two seams:

- `StageWork`: what the stage computes and which tensors it keeps in its pipe buffers (DeepSpeed's own handlers in
  the engine; the stage's layers on local tensors in the replay and the local pipeline);
- `Transport`: how tensors reach the neighbours (DeepSpeed's p2p over torch.distributed in the engine; in-process
  neighbours in the replay and the local pipeline).

The interpreter owns everything a schedule adds to DeepSpeed's 1F1B: ZB-H1's deferred weight gradients (B and W),
early recompute, and posted sends. A posted send keeps its tensor alive until it is surely complete, and no longer:
an activation send until the stage has received that micro-batch's gradient (the next stage had the activation
before it could send it), a gradient send until the previous stage has posted its receive
(schedules.grad_sends_released), and whatever is left at ReduceTiedGrads (or at the end of an evaluation, whose
sends must not outlive it). The memory model counts the gradients so held (parallel/planning/schedule_walk.py).

It also keys each training forward's dropout masks by the step and the micro-batch (the k-th forward of a step is
micro-batch k's; parallel/runtime/dropout_keys.py), so every runtime and every schedule draws the same masks.
"""

from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.nn as nn

from model.weight_grad import WeightGradStore, split_backward
from parallel.planning import schedules
from parallel.runtime.dropout_keys import DropoutKeys, keyed_forward
from parallel.runtime.early_recompute import EarlyRecompute
from parallel.runtime.posted_works import PostedWorks

Send = Callable[[torch.Tensor, int], None]
"""(tensor, the peer's stage index)."""
Recv = Callable[[torch.Tensor, int], None]
"""(the buffer to receive into, the peer's stage index)."""


class Work(Protocol):
    def wait(self) -> object: ...


class Transport(Protocol):
    """How a stage's tensors reach its neighbours (stage indices, not ranks)."""

    def send(self, tensor: torch.Tensor, stage: int) -> None:
        """Send and return once the peer has it (a rendezvous on gloo)."""

    def recv(self, tensor: torch.Tensor, stage: int) -> None:
        """Receive into `tensor`."""

    def post(self, sends: Sequence[tuple[torch.Tensor, int]], recvs: Sequence[tuple[torch.Tensor, int]]) -> list[Work]:
        """Post the sends and receives at once and return their Works, without waiting."""


class StageWork(Protocol):
    """What one stage computes and keeps. A `send` or `recv` argument is the interpreter's: the work hands it the
    tensors to move."""

    def load_micro_batch(self, buffer_id: int) -> None: ...

    def forward(self, buffer_id: int) -> None: ...

    def backward(self, buffer_id: int) -> None:
        """The stage's backward of the micro-batch in the buffer (B under a deferring weight-gradient store)."""

    def send_activation(self, buffer_id: int, send: Send) -> None: ...

    def recv_activation(self, buffer_id: int, recv: Recv) -> None: ...

    def send_grad(self, buffer_id: int, send: Send) -> None: ...

    def recv_grad(self, buffer_id: int, recv: Recv) -> None: ...

    def fresh_grad_buffer(self, buffer_id: int) -> torch.Tensor:
        """A new tensor for the output's gradient, which the next RecvGrad receives into."""

    def apply_weight_grads(self, store: WeightGradStore) -> None:
        """W: the oldest deferred micro-batch's weight gradients."""

    def reduce_tied_grads(self) -> None: ...

    def reduce_grads(self) -> None: ...

    def optimizer_step(self) -> None: ...


@dataclass(eq=False)
class _Posted:
    """Posted sends of one instruction, kept alive until waited for."""

    works: PostedWorks
    tensors: list[torch.Tensor]
    micro_batch: int
    """The k-th send of its kind is micro-batch k's."""

    def complete(self) -> None:
        self.works.wait()
        self.tensors = []


@dataclass
class _Exchange:
    """A step's SendActivation and RecvGrad posted as one batch (schedules.sends_activation_first)."""

    posted: _Posted
    buffer: torch.Tensor


@dataclass
class _Counts:
    """Instructions of each kind run so far in this training step: the k-th is micro-batch k."""

    forwards: int = 0
    sent_activations: int = 0
    received_activations: int = 0
    sent_grads: int = 0
    received_grads: int = 0


@dataclass
class StageInterpreter:
    """Stage `stage_id`'s instructions run one at a time (`execute`), with its deferred weight gradients, early
    recomputes and posted sends."""

    work: StageWork
    transport: Transport
    stage_id: int
    stages: int
    micro_batches: int
    schedule: str
    """The layout's schedule (parallel/planning/schedules.py's SCHEDULES)."""
    early: bool
    """The stage recomputes early (never the last stage)."""
    posted_sends: bool
    """The pipeline runs on posted sends (schedules.posts_sends); else every send is a rendezvous."""
    immediate_weights: Iterable[nn.Parameter] = ()
    """Weights whose gradient is never deferred (model/weight_grad.py's WeightGradStore)."""
    dropout: DropoutKeys = DropoutKeys()
    """The dropout stream of the stage's data-parallel replica (run seed, replica)."""
    weight_grads: WeightGradStore = field(init=False)
    early_recompute: EarlyRecompute = field(init=False)
    step: schedules.Step = ()
    """The programme's step whose instructions run now (how it communicates decides how its sends are posted)."""

    def __post_init__(self):
        self.weight_grads = WeightGradStore(immediate=self.immediate_weights)
        self.early_recompute = EarlyRecompute()
        self._released_at = schedules.grad_sends_released(self.micro_batches, self.stages, self.stage_id)
        self._activation_sends: deque[_Posted] = deque()
        self._grad_sends: deque[_Posted] = deque()
        self._exchange: _Exchange | None = None
        self._counts = _Counts()
        self._optimizer_step = 0

    @contextmanager
    def training_step(self, optimizer_step: int) -> Iterator[None]:
        """Around one training step's instructions, after `optimizer_step` optimizer steps (keys its dropout masks):
        zb-h1's forwards run the Linear layers through the Function whose weight gradient B can defer."""
        self._counts = _Counts()
        self._optimizer_step = optimizer_step
        with split_backward(self.schedule == "zb-h1"):
            yield

    def run(
        self,
        program: schedules.StageProgram,
        optimizer_step: int,
        around: Callable[[schedules.Command], AbstractContextManager] | None = None,
    ) -> None:
        """Every instruction of a training step's programme, after `optimizer_step` optimizer steps; `around(command)`
        wraps each one when given (the stage replay times them with it)."""
        with self.training_step(optimizer_step):
            for step in program.steps:
                self.step = step
                for command in step:
                    with around(command) if around else nullcontext():
                        self.execute(command)

    def execute(self, command: schedules.Command) -> None:
        _HANDLERS[type(command)](self, command)

    def complete_sends(self) -> None:
        """Wait for every posted send and drop its tensors: at ReduceTiedGrads, and after an evaluation."""
        for posted in (*self._activation_sends, *self._grad_sends):
            posted.complete()
        self._activation_sends.clear()
        self._grad_sends.clear()

    # The instructions, by their planned class.

    def _load(self, command: schedules.LoadMicroBatch) -> None:
        self.work.load_micro_batch(command.buffer_id)

    def _forward(self, command: schedules.ForwardPass) -> None:
        if not torch.is_grad_enabled():  # an evaluation: no dropout, nothing registered
            self.work.forward(command.buffer_id)
            return
        key = self.dropout.micro_batch(self._optimizer_step, self._counts.forwards)
        self._counts.forwards += 1
        with keyed_forward(key), self.early_recompute.registering() if self.early else nullcontext():
            self.work.forward(command.buffer_id)

    def _backward(self, command: schedules.BackwardPass) -> None:
        self.work.backward(command.buffer_id)

    def _backward_input(self, command: schedules.BackwardInput) -> None:
        with self.weight_grads.deferring():
            self.work.backward(command.buffer_id)

    def _backward_weight(self, command: schedules.BackwardWeight) -> None:
        self.work.apply_weight_grads(self.weight_grads)

    def _recompute_early(self, command: schedules.RecomputeEarly) -> None:
        self.early_recompute.recompute_next()

    def _send_activation(self, command: schedules.SendActivation) -> None:
        micro_batch = self._counts.sent_activations
        self._counts.sent_activations += 1
        receiving: list[tuple[torch.Tensor, int]] = []
        if self.posted_sends and schedules.sends_activation_first(self.step):
            (recv_grad,) = [c for c in self.step if isinstance(c, schedules.RecvGrad)]
            receiving = [(self.work.fresh_grad_buffer(recv_grad.buffer_id), self.stage_id + 1)]
        posted = self._sending(lambda send: self.work.send_activation(command.buffer_id, send), micro_batch, receiving)
        if posted is not None:
            self._activation_sends.append(posted)
            if receiving:
                self._exchange = _Exchange(posted, receiving[0][0])

    def _send_grad(self, command: schedules.SendGrad) -> None:
        micro_batch = self._counts.sent_grads
        self._counts.sent_grads += 1
        posted = self._sending(lambda send: self.work.send_grad(command.buffer_id, send), micro_batch)
        if posted is not None:
            self._grad_sends.append(posted)

    def _sending(
        self, run: Callable[[Send], None], micro_batch: int, receiving: Sequence[tuple[torch.Tensor, int]] = ()
    ) -> _Posted | None:
        """Run a send instruction: as a rendezvous (None), or posted, with `receiving` in the same batch."""
        if not self.posted_sends:
            run(self.transport.send)
            return None
        sends: list[tuple[torch.Tensor, int]] = []
        run(lambda tensor, stage: sends.append((tensor, stage)))
        # One Work per operation on gloo, one for the whole batch on NCCL: a batch is waited for as a whole.
        return _Posted(PostedWorks(self.transport.post(sends, receiving)), [t for t, _ in sends], micro_batch)

    def _recv_activation(self, command: schedules.RecvActivation) -> None:
        micro_batch = self._counts.received_activations
        self._counts.received_activations += 1
        self.work.recv_activation(command.buffer_id, self.transport.recv)
        if self.posted_sends and torch.is_grad_enabled():
            _complete_oldest(self._grad_sends, self._released_at[micro_batch])

    def _recv_grad(self, command: schedules.RecvGrad) -> None:
        micro_batch = self._counts.received_grads
        self._counts.received_grads += 1
        if self._exchange is None:
            if self.posted_sends:
                self.work.fresh_grad_buffer(command.buffer_id)
            self.work.recv_grad(command.buffer_id, self.transport.recv)
        else:
            exchange, self._exchange = self._exchange, None

            def wait(tensor: torch.Tensor, stage: int) -> None:
                if tensor is not exchange.buffer:
                    raise RuntimeError("RecvGrad received into another buffer than its posted receive")
                exchange.posted.complete()  # waited for as a whole: the batch's own send is complete too

            self.work.recv_grad(command.buffer_id, wait)
            self._activation_sends.remove(exchange.posted)
        # The next stage had this micro-batch's activation before it could send its gradient: that send (and every
        # earlier one) is complete.
        _complete_oldest(self._activation_sends, micro_batch + 1)

    def _reduce_tied_grads(self, command: schedules.ReduceTiedGrads) -> None:
        if len(self.weight_grads) or len(self.early_recompute):
            raise RuntimeError(
                f"stage {self.stage_id}: ReduceTiedGrads with {len(self.weight_grads)} micro-batches' weight "
                f"gradients still deferred and {len(self.early_recompute)} early recomputes pending: the schedule "
                f"must run every BackwardWeight and RecomputeEarly before it"
            )
        self.complete_sends()
        self.work.reduce_tied_grads()

    def _reduce_grads(self, command: schedules.ReduceGrads) -> None:
        self.work.reduce_grads()

    def _optimizer_step(self, command: schedules.OptimizerStep) -> None:
        self.work.optimizer_step()


def _complete_oldest(posted: deque[_Posted], count: int) -> None:
    """Complete the posted sends of the micro-batches before `count` (each is sure to be complete)."""
    while posted and posted[0].micro_batch < count:
        posted.popleft().complete()


_HANDLERS: dict[type[schedules.Command], Callable[[StageInterpreter, schedules.Command], None]] = {
    schedules.LoadMicroBatch: StageInterpreter._load,
    schedules.ForwardPass: StageInterpreter._forward,
    schedules.BackwardPass: StageInterpreter._backward,
    schedules.BackwardInput: StageInterpreter._backward_input,
    schedules.BackwardWeight: StageInterpreter._backward_weight,
    schedules.RecomputeEarly: StageInterpreter._recompute_early,
    schedules.SendActivation: StageInterpreter._send_activation,
    schedules.SendGrad: StageInterpreter._send_grad,
    schedules.RecvActivation: StageInterpreter._recv_activation,
    schedules.RecvGrad: StageInterpreter._recv_grad,
    schedules.ReduceTiedGrads: StageInterpreter._reduce_tied_grads,
    schedules.ReduceGrads: StageInterpreter._reduce_grads,
    schedules.OptimizerStep: StageInterpreter._optimizer_step,
}
"""Every planned instruction's handler: a new instruction has one here, and so runs wherever a stage runs."""
