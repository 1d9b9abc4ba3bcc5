"""DeepSpeed's PipelineEngine running the schedules of parallel/planning/schedules.py through the one interpreter of a
stage's programme (parallel/runtime/stage_interpreter.py): ZB-H1's split backward, early recompute and posted sends.

DeepSpeed's `train_batch` builds its schedule with `_train_schedule()` and runs each instruction through the
class's `_INSTRUCTION_MAP`. Here every instruction of the map, DeepSpeed's own and the three new ones
(parallel/runtime/ds_schedule.py), goes to the stage's `StageInterpreter`, and the engine is the interpreter's
`StageWork`: DeepSpeed's own handlers compute and keep the stage's tensors (its buffers, bf16's gradient bookkeeping,
ZeRO's hooks, the loss), and DeepSpeed's p2p, routed through the interpreter, moves them. So 1F1B without early
recompute runs DeepSpeed's handlers unchanged, with its blocking sends; parallel/measurement/trace.py times each
instruction under its DeepSpeed class name like any other.

- BackwardInput: DeepSpeed's own backward pass (the last stage through `engine.backward(loss)`, the others
  through their outputs' backward with bf16's gradient bookkeeping around it), with the Linear layers' weight
  gradients deferred into the interpreter's `WeightGradStore` (model/weight_grad.py).
- BackwardWeight: the oldest deferred micro-batch's weight gradients, through each weight's AccumulateGrad (so
  ZeRO's and bf16's gradient hooks fire as in any backward) and, under bf16, moved into the fp32 gradients
  exactly as a non-last stage's backward moves them: once, after clearing the 16-bit gradients.
- RecomputeEarly: the oldest registered micro-batch's recompute (parallel/runtime/early_recompute.py), registered by
  the forward passes of a stage whose plan is early.

Gradient clipping, the optimizer step and the tied-weight all-reduce all run after ReduceTiedGrads, which
refuses to run while a weight gradient is still deferred or a recompute still pending.
"""

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch
import torch.distributed as dist
from deepspeed.runtime.bf16_optimizer import BF16_Optimizer
from deepspeed.runtime.pipe import p2p
from deepspeed.runtime.pipe.engine import PipelineEngine

from model.weight_grad import WeightGradStore
from parallel.planning import schedules
from parallel.planning.layout import PipelineLayout
from parallel.runtime.dropout_keys import DropoutKeys
from parallel.runtime.ds_schedule import DEEPSPEED_INSTRUCTION, deepspeed_schedule
from parallel.runtime.engine_backward import engine_backward
from parallel.runtime.stage_interpreter import Recv, Send, StageInterpreter, Work

_DEEPSPEED_SEND, _DEEPSPEED_RECV = p2p.send, p2p.recv
"""DeepSpeed's blocking p2p, which the engine's transport calls while the handlers' p2p is routed."""


@contextmanager
def _routed(send: Send | None = None, recv: Recv | None = None) -> Iterator[None]:
    """DeepSpeed's handlers' p2p.send / p2p.recv through the interpreter's `send` / `recv` while active."""
    if send is not None:
        p2p.send = lambda tensor, dest_stage, async_op=False: send(tensor, dest_stage)
    if recv is not None:
        p2p.recv = lambda tensor, src_stage, async_op=False: recv(tensor, src_stage)
    try:
        yield
    finally:
        p2p.send, p2p.recv = _DEEPSPEED_SEND, _DEEPSPEED_RECV


class DistTransport:
    """Stage to stage over torch.distributed: DeepSpeed's p2p for a rendezvous, `batch_isend_irecv` for posted
    operations."""

    def __init__(self, grid):
        self.grid = grid

    def send(self, tensor: torch.Tensor, stage: int) -> None:
        _DEEPSPEED_SEND(tensor, stage)

    def recv(self, tensor: torch.Tensor, stage: int) -> None:
        _DEEPSPEED_RECV(tensor, stage)

    def post(self, sends: Sequence[tuple[torch.Tensor, int]], recvs: Sequence[tuple[torch.Tensor, int]]) -> list[Work]:
        rank = self.grid.stage_to_global
        ops = [dist.P2POp(dist.isend, t, rank(stage_id=stage)) for t, stage in sends]
        ops += [dist.P2POp(dist.irecv, t, rank(stage_id=stage)) for t, stage in recvs]
        return dist.batch_isend_irecv(ops)


class ZeroBubblePipelineEngine(PipelineEngine):
    """Set up by `zero_bubble(engine, layout)`; until then a plain PipelineEngine's attributes."""

    def train_batch(self, data_iter=None):
        # global_steps: the optimizer steps taken, restored with DeepSpeed's checkpoint (the dropout masks' key)
        with self.interpreter.training_step(self.global_steps):
            return super().train_batch(data_iter)

    def eval_batch(self, *args, **kwargs):
        """DeepSpeed's evaluation, whose posted sends complete before it returns: none outlives it."""
        self.interpreter.step = ()
        try:
            return super().eval_batch(*args, **kwargs)
        finally:
            self.interpreter.complete_sends()

    def _train_schedule(self):
        self.planned_schedule = deepspeed_schedule(
            self.schedule_kind, self.early, self.micro_batches, self.num_stages, self.stage_id, self.deferred_weights
        )
        self.planned_schedule.on_step = lambda step: setattr(self.interpreter, "step", step)
        return self.planned_schedule


class EngineStageWork:
    """The interpreter's StageWork on DeepSpeed's engine: its own handlers compute and keep the stage's tensors."""

    def __init__(self, engine: PipelineEngine):
        self.engine = engine

    def load_micro_batch(self, buffer_id: int) -> None:
        PipelineEngine._exec_load_micro_batch(self.engine, buffer_id)

    def forward(self, buffer_id: int) -> None:
        PipelineEngine._exec_forward_pass(self.engine, buffer_id)

    def backward(self, buffer_id: int) -> None:
        engine = self.engine
        if not (engine.is_last_stage() and isinstance(engine.optimizer, BF16_Optimizer)):
            PipelineEngine._exec_backward_pass(engine, buffer_id)
            return
        # DeepSpeed clears bf16's 16-bit gradients in its backward prologue, run by a hook on the stage's output once
        # the output's gradient is made. On the last stage the loss comes after the output (the fused loss reads the
        # LM head's weight there), so autograd has accumulated the head weight's gradient by then, and the prologue
        # wiped it: that weight never trained. So the last stage clears them before its loss's backward instead.
        engine.optimizer.clear_lp_grads()
        engine.optimizer.backward_prologue = _no_prologue
        try:
            PipelineEngine._exec_backward_pass(engine, buffer_id)
        finally:
            del engine.optimizer.backward_prologue  # the class's again

    def send_activation(self, buffer_id: int, send: Send) -> None:
        with _routed(send=send):
            PipelineEngine._exec_send_activations(self.engine, buffer_id)

    def recv_activation(self, buffer_id: int, recv: Recv) -> None:
        with _routed(recv=recv):
            PipelineEngine._exec_recv_activations(self.engine, buffer_id)

    def send_grad(self, buffer_id: int, send: Send) -> None:
        with _routed(send=send):
            PipelineEngine._exec_send_grads(self.engine, buffer_id)

    def recv_grad(self, buffer_id: int, recv: Recv) -> None:
        with _routed(recv=recv):
            PipelineEngine._exec_recv_grads(self.engine, buffer_id)

    def fresh_grad_buffer(self, buffer_id: int) -> torch.Tensor:
        """A new receive buffer for the output's gradient (DeepSpeed's `grad_layer`), never the previous one: without
        dropout a block's last Linear gets the stage output's gradient itself, so a W still deferred holds that
        buffer (model/weight_grad.py), and a receive into it would change that W's weight gradient. The previous
        buffer is freed once no W holds it: still one buffer, as parallel/planning/stage_bytes.py counts it."""
        outputs = self.engine.pipe_buffers["outputs"][buffer_id]
        if not torch.is_tensor(outputs) or self.engine.dynamic_shape:
            raise RuntimeError("a stagecheck schedule's stage must output one tensor of a fixed shape")
        self.engine.grad_layer = torch.empty_like(outputs)
        return self.engine.grad_layer

    def apply_weight_grads(self, store: WeightGradStore) -> None:
        with engine_backward(self.engine):
            store.apply_oldest()

    def reduce_tied_grads(self) -> None:
        PipelineEngine._exec_reduce_tied_grads(self.engine)

    def reduce_grads(self) -> None:
        PipelineEngine._exec_reduce_grads(self.engine)

    def optimizer_step(self) -> None:
        PipelineEngine._exec_optimizer_step(self.engine)


def _no_prologue() -> None:
    """BF16_Optimizer's backward prologue on the last stage, whose 16-bit gradients were cleared before its backward."""


def _interpreted(planned: type[schedules.Command]):
    """The engine's handler of DeepSpeed's form of `planned`: the interpreter runs the planned instruction."""

    def handler(engine: ZeroBubblePipelineEngine, **kwargs) -> None:
        engine.interpreter.execute(planned(**kwargs))

    return handler


ZeroBubblePipelineEngine._INSTRUCTION_MAP = {
    deepspeed: _interpreted(planned) for planned, deepspeed in DEEPSPEED_INSTRUCTION.items()
}


def zero_bubble(engine: PipelineEngine, layout: PipelineLayout) -> ZeroBubblePipelineEngine:
    """The built engine, now running `layout.schedule` with its stage plan's early setting."""
    engine.__class__ = ZeroBubblePipelineEngine
    plan = layout.plans[engine.stage_id]
    engine.schedule_kind, engine.deferred_weights = layout.schedule, plan.deferred_weights
    # The last stage's backward follows its forward with no wait: it never recomputes early.
    engine.early = plan.early and not engine.is_last_stage()
    # A one-stage pipeline holds the tied embedding and LM head together: their weight gradient stays immediate.
    tied = engine.is_first_stage() and engine.is_last_stage()
    engine.interpreter = StageInterpreter(
        work=EngineStageWork(engine),
        transport=DistTransport(engine.grid),
        stage_id=engine.stage_id,
        stages=engine.num_stages,
        micro_batches=engine.micro_batches,
        schedule=layout.schedule,
        early=engine.early,
        # parallel/planning/schedules.py's schedules send a forward's output before the early work of its step, which
        # only posted sends allow; DeepSpeed's own 1F1B keeps its blocking sends (parallel/planning/step_sim.py models
        # both).
        posted_sends=schedules.posts_sends(layout.schedule, [p.early for p in layout.plans]),
        immediate_weights=[p for m in engine.module.tied_modules.values() for p in m.parameters()] if tied else (),
        dropout=DropoutKeys(layout.seed, engine.grid.get_data_parallel_rank()),
    )
    return engine
