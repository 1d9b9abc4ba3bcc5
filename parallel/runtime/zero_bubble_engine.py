"""DeepSpeed's PipelineEngine running the schedules of parallel/planning/schedules.py: ZB-H1's split backward and early
recompute.

DeepSpeed's `train_batch` builds its schedule with `_train_schedule()` and runs each instruction through the
class's `_INSTRUCTION_MAP`, so the planned programme in DeepSpeed's instructions (parallel/runtime/ds_schedule.py)
and the handlers of its three new instructions are all it takes (as Megatron-DeepSpeed's zero-bubble schedule did).
parallel/runtime/engine.py swaps a built engine's class to this one; parallel/measurement/trace.py times the new
instructions under their class names like any other.

- BackwardInput: DeepSpeed's own backward pass (the last stage through `engine.backward(loss)`, the others
  through their outputs' backward with bf16's gradient bookkeeping around it), with the Linear layers' weight
  gradients deferred into the stage's `WeightGradStore` (model/weight_grad.py).
- BackwardWeight: the oldest deferred micro-batch's weight gradients, through each weight's AccumulateGrad (so
  ZeRO's and bf16's gradient hooks fire as in any backward) and, under bf16, moved into the fp32 gradients
  exactly as a non-last stage's backward moves them: once, after clearing the 16-bit gradients.
- RecomputeEarly: the oldest registered micro-batch's recompute (parallel/runtime/early_recompute.py), registered by
  the forward passes of a stage whose plan is early.

Gradient clipping, the optimizer step and the tied-weight all-reduce all run after ReduceTiedGrads, which
refuses to run while a weight gradient is still deferred or a recompute still pending.
"""

from contextlib import contextmanager

import torch
import torch.distributed as dist
from deepspeed.runtime.pipe import p2p, schedule
from deepspeed.runtime.pipe.engine import PipelineEngine

from model.weight_grad import WeightGradStore, split_backward
from parallel.planning.layout import PipelineLayout
from parallel.planning.schedules import RecvGrad as RecvGradCommand
from parallel.planning.schedules import posts_sends, sends_activation_first
from parallel.runtime.ds_schedule import BackwardInput, BackwardWeight, RecomputeEarly, deepspeed_schedule
from parallel.runtime.early_recompute import EarlyRecompute


class ZeroBubblePipelineEngine(PipelineEngine):
    """Set up by `zero_bubble(engine, layout)`; until then a plain PipelineEngine's attributes."""

    def train_batch(self, data_iter=None):
        # zb-h1's forwards run the Linear layers through the Function whose weight gradient B can defer.
        with split_backward(self.schedule_kind == "zb-h1"):
            return super().train_batch(data_iter)

    def _train_schedule(self):
        self.planned_schedule = deepspeed_schedule(
            self.schedule_kind, self.early, self.micro_batches, self.num_stages, self.stage_id, self.deferred_weights
        )
        return self.planned_schedule

    def _exec_forward_pass_registering(self, buffer_id):
        if not (self.early and self.module.training and torch.is_grad_enabled()):  # eval_batch: nothing to register
            return PipelineEngine._exec_forward_pass(self, buffer_id)
        with self.early_recompute.registering():
            return PipelineEngine._exec_forward_pass(self, buffer_id)

    def _exec_backward_input(self, buffer_id):
        with self.weight_grads.deferring():
            PipelineEngine._exec_backward_pass(self, buffer_id)

    def _exec_backward_weight(self, buffer_id):
        bf16 = self.using_bf16_optimizer
        if bf16:  # the 16-bit gradients hold only what this W adds (B moved its own into fp32 already)
            self.optimizer.clear_lp_grads()
        # As around DeepSpeed's own non-last-stage backward: the post-backward hook of ZeRO optimizers must not
        # run its epilogue for this graph.
        self._running_engine_backward = True
        try:
            self.weight_grads.apply_oldest()
        finally:
            self._running_engine_backward = False
        if bf16 and not self._config.bfloat16_config.immediate_grad_update:
            self.optimizer.update_hp_grads(clear_lp_grads=False)

    @contextmanager
    def _sending(self, receiving: list[torch.Tensor] = ()):
        """DeepSpeed's send handlers with their p2p.send posted as isend (the stagecheck schedules: zb-h1 or early
        recompute). A blocking gloo send waits for the peer's recv, so a stage busy with early work or a W would
        hold up its neighbour's send; the posted sends complete by ReduceTiedGrads. Each keeps its tensor alive
        until then (DeepSpeed drops its own reference to the sent gradient right after the send).

        `receiving`: the step's gradient buffers, whose receive is posted with the sends as one batch
        (parallel/planning/schedules.py's `p2p_batches`); the step's RecvGrad then waits for the batch."""
        if not self.async_sends:
            yield
            return
        blocking = p2p.send
        sends: list[tuple[torch.Tensor, int]] = []

        def post(tensor, dest_stage, async_op=False):
            sends.append((tensor, self.grid.stage_to_global(stage_id=dest_stage)))

        p2p.send = post
        try:
            yield
        finally:
            p2p.send = blocking
        ops = [dist.P2POp(dist.isend, tensor, peer) for tensor, peer in sends]
        if receiving:
            source = self.grid.stage_to_global(stage_id=self.next_stage)
            ops += [dist.P2POp(dist.irecv, buffer, source) for buffer in receiving]
        # One Work per operation on gloo, one for the whole batch on NCCL: the batch is waited for as a whole.
        works = dist.batch_isend_irecv(ops)
        if receiving:
            self.posted_exchange = (works, [t for t, _ in sends], receiving)
        else:
            self.posted_sends += [(work, [t for t, _ in sends]) for work in works]

    def _fresh_grad_buffer(self, buffer_id: int) -> torch.Tensor:
        """A new receive buffer for the output's gradient (DeepSpeed's `grad_layer`), never the previous one: without
        dropout a block's last Linear gets the stage output's gradient itself, so a W still deferred holds that
        buffer (model/weight_grad.py), and a receive into it would change that W's weight gradient. The previous
        buffer is freed once no W holds it: still one buffer, as parallel/planning/stage_costs.py counts it."""
        outputs = self.pipe_buffers["outputs"][buffer_id]
        if not torch.is_tensor(outputs) or self.dynamic_shape:
            raise RuntimeError("a stagecheck schedule's stage must output one tensor of a fixed shape")
        self.grad_layer = torch.empty_like(outputs)
        return self.grad_layer

    def _exec_send_activations_posted(self, buffer_id):
        step = self.planned_schedule.current
        receiving = []
        if self.async_sends and sends_activation_first(step):
            (recv_grad,) = [c for c in step if isinstance(c, RecvGradCommand)]
            receiving = [self._fresh_grad_buffer(recv_grad.buffer_id)]
        with self._sending(receiving):
            PipelineEngine._exec_send_activations(self, buffer_id)

    def _exec_send_grads_posted(self, buffer_id):
        with self._sending():
            PipelineEngine._exec_send_grads(self, buffer_id)

    def _exec_recv_grads_posted(self, buffer_id):
        """DeepSpeed's RecvGrad, into a fresh buffer on the stagecheck schedules; where the step's SendActivation
        posted the receive, its p2p.recv waits for that batch instead."""
        if self.posted_exchange is None:
            if self.async_sends:
                self._fresh_grad_buffer(buffer_id)
            return PipelineEngine._exec_recv_grads(self, buffer_id)
        (works, _, buffers), self.posted_exchange = self.posted_exchange, None
        blocking = p2p.recv

        def wait(tensor, src_stage, async_op=False):
            if not any(tensor is buffer for buffer in buffers):
                raise RuntimeError("RecvGrad received into another buffer than its posted receive")
            for work in works:
                work.wait()

        p2p.recv = wait
        try:
            PipelineEngine._exec_recv_grads(self, buffer_id)
        finally:
            p2p.recv = blocking

    def _exec_recompute_early(self, buffer_id):
        self.early_recompute.recompute_next()

    def _exec_reduce_tied_grads_complete(self):
        if len(self.weight_grads) or len(self.early_recompute):
            raise RuntimeError(
                f"stage {self.stage_id}: ReduceTiedGrads with {len(self.weight_grads)} micro-batches' weight "
                f"gradients still deferred and {len(self.early_recompute)} early recomputes pending: the schedule "
                f"must run every BackwardWeight and RecomputeEarly before it"
            )
        for work, _ in self.posted_sends:
            work.wait()
        self.posted_sends.clear()
        PipelineEngine._exec_reduce_tied_grads(self)

    _INSTRUCTION_MAP = {
        **PipelineEngine._INSTRUCTION_MAP,
        schedule.ForwardPass: _exec_forward_pass_registering,
        schedule.ReduceTiedGrads: _exec_reduce_tied_grads_complete,
        schedule.SendActivation: _exec_send_activations_posted,
        schedule.SendGrad: _exec_send_grads_posted,
        schedule.RecvGrad: _exec_recv_grads_posted,
        BackwardInput: _exec_backward_input,
        BackwardWeight: _exec_backward_weight,
        RecomputeEarly: _exec_recompute_early,
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
    engine.weight_grads = WeightGradStore(
        immediate=[p for m in engine.module.tied_modules.values() for p in m.parameters()] if tied else ()
    )
    engine.early_recompute = EarlyRecompute()
    # parallel/planning/schedules.py's schedules send a forward's output before the early work of its step, which only
    # posted sends allow; DeepSpeed's own 1F1B keeps its blocking sends (parallel/planning/step_sim.py models both).
    engine.async_sends = posts_sends(layout.schedule, [p.early for p in layout.plans])
    engine.posted_sends = []
    engine.posted_exchange = None
    return engine
