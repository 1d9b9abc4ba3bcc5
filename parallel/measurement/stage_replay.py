"""One pipeline stage's training step in this process, with DeepSpeed's buffers as its engine keeps them, to measure
the stage's peak tensor memory (parallel/measurement/tensor_peak.py) without launching ranks.

The stage is built and planned as parallel/measurement/local_stages.py builds it and runs its own schedule
(parallel/planning/schedules.py's programme, as the engine does); its neighbours' sends are random tensors of the
right shape. What DeepSpeed 0.19.8's PipelineEngine holds on the stage is mirrored instruction by instruction:

- LoadMicroBatch: the token ids (first stage) and labels (last stage) into the buffer;
- RecvActivation: into one receive buffer, cloned into the pipe buffer, which requires grad;
- ForwardPass: the stage runs on a clone of its pipe buffer and its output is kept in the buffer; the last stage
  computes the loss (and keeps only the last one);
- RecvGrad: into one gradient buffer;
- BackwardPass: the loss's backward on the last stage, which never drops its outputs; the output's backward with the
  received gradient elsewhere, after which the output is dropped. zb-h1's BackwardInput does the same with the
  Linear layers' weight gradients deferred (model/weight_grad.py), BackwardWeight applies the oldest, and
  RecomputeEarly runs the oldest early recompute (parallel/runtime/early_recompute.py), as the zero-bubble engine
  does;
- SendGrad: the pipe buffer's input is dropped;
- OptimizerStep: torch's AdamW, which keeps two fp32 moments per parameter as DeepSpeed's fp32 optimizer does
  (fp32 only: DeepSpeed's bf16 optimizer keeps other states).

Checked against the real engine (2 CPU ranks, `bench/peak_memory_bench.py`'s first shape: none, selective,
full(1), full(stage)): each stage's peak within 0.02 MiB of the real run's ~12-23 MiB.
"""

import gc
from contextlib import nullcontext

import torch

from model import head_module
from model.fused_loss import HeadLoss
from model.weight_grad import WeightGradStore, split_backward
from parallel.measurement.local_stages import LocalStage
from parallel.measurement.tensor_peak import TensorPeak, TensorPeakMeter
from parallel.planning.layout import PipelineLayout
from parallel.planning.schedules import train_schedule
from parallel.planning.shapes import RunShape
from parallel.runtime.early_recompute import EarlyRecompute
from parallel.runtime.recompute import run_stage


class StageReplay:
    """Stage `index` of `layout`, ready to run training steps of `run`'s micro-batches."""

    def __init__(self, layout: PipelineLayout, index: int, run: RunShape, seed: int = 0):
        if run.target.precision != "fp32":
            raise ValueError(f"a stage replay keeps fp32 optimizer states only, not {run.target.precision}")
        stages = run.topology.pipeline_stages
        self.first, self.last = index == 0, index == stages - 1
        self.plan = layout.plans[index]
        self.early = self.plan.early and not self.last
        self.split = layout.schedule == "zb-h1"
        torch.manual_seed(seed)
        self.stage = LocalStage(layout.recipes, layout.stages[index], self.plan)
        self.loss_fn = HeadLoss.of(layout.recipes)
        config = layout.recipes[0].args[0]  # the token embedding's GPTConfig
        self.vocab, self.micro_batches = config.vocab_size, run.micro_batches
        self.program = train_schedule(
            layout.schedule, self.early, run.micro_batches, stages, index, self.plan.deferred_weights
        )
        self.optimizer = torch.optim.AdamW(self.stage.parameters(), lr=1e-4)
        hidden = (run.micro_batch_size, config.seq_len, config.n_embd)
        self.tokens = hidden[:2]
        self.recv_buffer = None if self.first else torch.zeros(hidden)
        self.grad_buffer = None if self.last else torch.zeros(hidden)
        buffers = self.program.pipe_buffers
        self.inputs: list[torch.Tensor | None] = [None] * buffers
        self.outputs: list[torch.Tensor | None] = [None] * buffers
        self.labels: list[torch.Tensor | None] = [None] * buffers
        self.loss: torch.Tensor | None = None
        self.weight_grads = WeightGradStore()
        self.early_recompute = EarlyRecompute()

    def step(self) -> None:
        """One training step: every instruction of the stage's programme."""
        forwards = 0
        with split_backward(self.split):
            for command in self.program.commands():
                kind, buffer = type(command).__name__, getattr(command, "buffer_id", None)
                if kind == "ForwardPass":
                    self._forward(buffer, self.plan.recomputes_micro_batch(forwards))
                    forwards += 1
                elif kind in ("BackwardPass", "BackwardInput"):
                    with self.weight_grads.deferring() if kind == "BackwardInput" else nullcontext():
                        self._backward(buffer)
                else:
                    self._other(kind, buffer)

    def measure_peak(self, steps: int = 2) -> TensorPeak:
        """The peak of the last of `steps` steps (the earlier ones allocate the gradients and optimizer states)."""
        for _ in range(steps - 1):
            self.step()
        gc.collect()  # the garbage of earlier objects would otherwise count as alive in the window
        meter = TensorPeakMeter("cpu")
        with meter.window() as result:
            self.step()
        return result[0]

    def _forward(self, buffer: int, recompute: bool) -> None:
        x = self.inputs[buffer].clone()
        with self.early_recompute.registering() if self.early else nullcontext():
            output = run_stage(self.stage.funcs, self.plan, x, recompute)
        self.outputs[buffer] = output
        if self.last:
            head_weight = head_module(self.stage.funcs[-1]).head_weight  # tied (the embedding's) or untied
            self.loss = self.loss_fn(output, self.labels[buffer], head_weight)

    def _backward(self, buffer: int) -> None:
        if self.last:
            self.loss.backward()
            return
        self.outputs[buffer].backward(self.grad_buffer)
        self.outputs[buffer] = None

    def _other(self, kind: str, buffer: int | None) -> None:
        if kind == "LoadMicroBatch":
            if self.first:
                self.inputs[buffer] = torch.randint(0, self.vocab, self.tokens)
            if self.last:
                self.labels[buffer] = torch.randint(0, self.vocab, self.tokens)
        elif kind == "RecvActivation":
            self.recv_buffer.normal_()
            self.inputs[buffer] = self.recv_buffer.clone().detach().requires_grad_()
        elif kind == "RecvGrad":
            self.grad_buffer.normal_()
        elif kind == "SendGrad":
            self.inputs[buffer] = None
        elif kind == "BackwardWeight":
            self.weight_grads.apply_oldest()
        elif kind == "RecomputeEarly":
            self.early_recompute.recompute_next()
        elif kind == "OptimizerStep":
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=False)  # DeepSpeed keeps its gradient buffers between steps
