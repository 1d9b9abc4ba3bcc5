"""The GPT as a DeepSpeed PipelineModule whose stages run under recompute plans."""

import hashlib
from collections.abc import Callable, Sequence
from functools import partial
from typing import NamedTuple

import torch
import torch.nn as nn
from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec

from model import LayerRecipe, head_module
from model.fused_loss import HeadLoss
from parallel.planning.partition import StageRange
from parallel.planning.stage_plan import StagePlan
from parallel.runtime.compile_blocks import compile_blocks
from parallel.runtime.recompute import apply_plan, run_stage


def layer_specs(recipes: Sequence[LayerRecipe]) -> list[LayerSpec]:
    specs = []
    for recipe in recipes:
        if recipe.tie_key is None:
            specs.append(LayerSpec(recipe.module_class, *recipe.args))
        else:
            specs.append(
                TiedLayerSpec(
                    recipe.tie_key,
                    recipe.module_class,
                    *recipe.args,
                    forward_fn=recipe.forward_fn,
                    tied_weight_attr=[recipe.module_class.head_weight_name],
                )
            )
    return specs


class BuiltLayer(NamedTuple):
    """One layer a stage built: its flat index, its module's class and the function that runs it (a tied
    module's `forward_fn`; None: the module itself), as its LayerRecipe names them."""

    index: int
    module_class: type
    forward_fn: Callable | None

    @classmethod
    def planned(cls, recipes: Sequence[LayerRecipe], index: int) -> "BuiltLayer":
        return cls(index, recipes[index].module_class, recipes[index].forward_fn)

    def __str__(self) -> str:
        return f"{self.index}:{self.forward_fn.__name__ if self.forward_fn else self.module_class.__name__}"


def check_built_as_planned(
    built: Sequence[BuiltLayer],
    parts: Sequence[int],
    stages: Sequence[StageRange],
    recipes: Sequence[LayerRecipe],
    stage_id: int,
) -> None:
    """Raise unless DeepSpeed's partition (`parts`: each stage's first layer, then one past the last) is the plan's
    and this stage built exactly the layers of its StageRange, each as its recipe says: a stage plan counts its
    layers from the stage's first, so a layer built off by one would run under another layer's recompute."""
    planned_parts = [s.start for s in stages] + [stages[-1].stop]
    if list(parts) != planned_parts:
        raise RuntimeError(f"DeepSpeed partitioned {list(parts)}, the plan assumed {planned_parts}")
    planned = [BuiltLayer.planned(recipes, i) for i in stages[stage_id].layers]
    if list(built) != planned:
        names = {"built": ", ".join(map(str, built)), "planned": ", ".join(map(str, planned))}
        raise RuntimeError(f"stage {stage_id} built layers [{names['built']}], its plan names [{names['planned']}]")


class RecomputingPipelineModule(PipelineModule):
    """DeepSpeed's PipelineModule, with the stage forward run under our StagePlan.

    DeepSpeed's own activation checkpointing counts intervals in layers from the stage's first
    layer (embeddings included) and picks layers by class-name heuristics; our plans count in
    blocks, so DeepSpeed's interval stays 0 and `forward` runs the plan instead.
    """

    def __init__(
        self,
        recipes: Sequence[LayerRecipe],
        stages: Sequence[StageRange],
        plans: Sequence[StagePlan],
        partition_method: str,
        compile: bool = False,
        **kwargs,
    ):
        # Read by _partition_layers, which DeepSpeed's __init__ calls (plain data: safe before Module.__init__).
        self._planned_parts = [s.start for s in stages] + [stages[-1].stop]
        self._head_loss = HeadLoss.of(recipes)
        super().__init__(
            layers=layer_specs(recipes),
            num_stages=len(stages),
            loss_fn=self.stage_loss,
            partition_method=partition_method,
            activation_checkpoint_interval=0,
            **kwargs,
        )
        check_built_as_planned(self.built_layers(), [int(p) for p in self.parts], stages, recipes, self.stage_id)
        self.stage_plan = plans[self.stage_id]
        apply_plan(self.forward_funcs, self.stage_plan)
        if compile:  # train.compile: after the plan, as torchtitan compiles after applying activation checkpointing
            compile_blocks(self.forward_funcs)
        self._training_forwards = 0
        """Training forwards of the current step: the index of the micro-batch the next one runs."""

    def stage_loss(self, outputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """DeepSpeed's loss_fn(outputs, labels), on the last stage: the fused loss reads the LM head's weight there
        (the tied embedding's, or the untied head's)."""
        return self._head_loss(outputs, labels, head_module(self.forward_funcs[-1]).head_weight)

    def _partition_layers(self, method="uniform"):
        """DeepSpeed's own methods stay DeepSpeed's (`check_built_as_planned` compares them with the plan);
        `balanced` boundaries come from the plan (parallel/planning/layout.py), set the way DeepSpeed sets its own."""
        if method != "balanced":
            return super()._partition_layers(method=method)
        self.parts = list(self._planned_parts)
        self._set_bounds(start=self.parts[self.stage_id], stop=self.parts[self.stage_id + 1])

    def train(self, mode: bool = True):
        """DeepSpeed's train_batch calls this first thing in every step: the step's micro-batches count from 0."""
        self._training_forwards = 0
        return super().train(mode)

    def forward(self, forward_input):
        recompute = True
        # Training forwards only: eval_batch runs in eval mode under no_grad, where nothing is kept anyway.
        if self.training and torch.is_grad_enabled():
            recompute = self.stage_plan.recomputes_micro_batch(self._training_forwards)
            self._training_forwards += 1
        first_layer = int(self._local_start)  # DeepSpeed's partition may hold numpy integers
        return run_stage(self.forward_funcs, self.stage_plan, forward_input, recompute, first_layer=first_layer)

    def built_layers(self) -> list[BuiltLayer]:
        """What DeepSpeed built on this stage, in the terms of a LayerRecipe."""
        return [
            BuiltLayer(index, type(module), fn.func if isinstance(fn, partial) else None)
            for (index, module), fn in zip(self.local_layers(), self.forward_funcs)
        ]

    def local_layers(self) -> list[tuple[int, nn.Module]]:
        """(flat index, module) of each layer this stage built; the tied LM head is its embedding's module."""
        return [(self._local_start + i, head_module(fn)) for i, fn in enumerate(self.forward_funcs)]

    def tied_weight_digest(self) -> str | None:
        """SHA-256 of the tied embedding/LM-head weight held by this stage (first and last stages),
        so a run can show that both copies stayed identical; None where there is none (an untied head)."""
        if not self.tied_modules:
            return None
        (module,) = self.tied_modules.values()
        weight = module.head_weight.detach().cpu().contiguous()
        return hashlib.sha256(weight.view(-1).view(torch.uint8).numpy().tobytes()).hexdigest()
