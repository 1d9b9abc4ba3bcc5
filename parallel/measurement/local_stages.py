"""Every stage of a pipeline layout in one process, for the recompute benchmark and tests.

Each stage builds its own layers (the tied embedding once per stage that uses it, as DeepSpeed does
across ranks), applies its StagePlan and runs it with `run_stage`, exactly as
parallel/runtime/pipeline.py's RecomputingPipelineModule does.
A step runs the micro-batches one after another through all stages and mimics what DeepSpeed's engine
does around each stage forward: the received input is a leaf that requires grad and the forward gets a
clone of it; the last stage computes the loss; backward goes stage by stage from the last.
"""

from collections.abc import Sequence
from contextlib import nullcontext

import torch
import torch.nn as nn

from model import LayerRecipe, build_layers, head_module
from model.fused_loss import HeadLoss
from parallel.measurement.activation_meter import ActivationMeter
from parallel.planning.layout import PipelineLayout
from parallel.planning.partition import StageRange
from parallel.planning.shapes import TORCH_DTYPES
from parallel.planning.stage_plan import StagePlan
from parallel.runtime.recompute import apply_plan, run_stage


class LocalStage(nn.Module):
    def __init__(self, recipes: Sequence[LayerRecipe], stage: StageRange, plan: StagePlan, precision: str = "fp32"):
        super().__init__()
        self.stage, self.plan = stage, plan
        self.layers, self.funcs = build_layers([recipes[flat] for flat in stage.layers])
        self.to(TORCH_DTYPES[precision])
        apply_plan(self.funcs, plan)
        self.meter = ActivationMeter(self.parameters)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return run_stage(self.funcs, self.plan, x)


class LocalPipeline:
    def __init__(self, layout: PipelineLayout, precision: str = "fp32"):
        self.stages = [LocalStage(layout.recipes, s, p, precision) for s, p in zip(layout.stages, layout.plans)]
        self.loss = HeadLoss.of(layout.recipes)
        self.head_weight = head_module(self.stages[-1].funcs[-1]).head_weight

    def parameters(self):
        return [p for stage in self.stages for p in stage.parameters()]

    def step(self, micro_batches: Sequence[tuple[torch.Tensor, torch.Tensor]], measure: bool = False) -> torch.Tensor:
        """Forward and backward of every (tokens, labels) micro-batch; gradients accumulate. Returns
        the mean loss. With `measure`, each stage's meter records every micro-batch."""
        losses = []
        for tokens, labels in micro_batches:
            received: list[torch.Tensor | None] = []
            outputs = []
            x = tokens
            for stage in self.stages:
                buffer = x.detach().clone()
                if buffer.is_floating_point():
                    buffer.requires_grad_()
                received.append(buffer)
                stage_input = buffer.clone()
                with stage.meter.record(stage_input=stage_input) if measure else nullcontext():
                    x = stage(stage_input)
                outputs.append(x)
            with self.stages[-1].meter.record(new=False) if measure else nullcontext():
                loss = self.loss(x, labels, self.head_weight)
            loss.backward()
            for i in range(len(self.stages) - 2, -1, -1):
                outputs[i].backward(received[i + 1].grad)
            losses.append(loss.detach())
        return torch.stack(losses).mean()
