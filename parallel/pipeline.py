"""The GPT as a DeepSpeed PipelineModule whose stages run under recompute plans."""

import hashlib
from collections.abc import Sequence

import torch
from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec

from model import LayerRecipe, lm_loss
from parallel.partition import StageRange
from parallel.recompute import apply_plan, run_stage
from parallel.stage_plan import StagePlan


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
                    tied_weight_attr=["wte.weight"],
                )
            )
    return specs


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
        **kwargs,
    ):
        super().__init__(
            layers=layer_specs(recipes),
            num_stages=len(stages),
            loss_fn=lm_loss,
            partition_method=partition_method,
            activation_checkpoint_interval=0,
            **kwargs,
        )
        expected = [s.start for s in stages] + [stages[-1].stop]
        if [int(p) for p in self.parts] != expected:
            raise RuntimeError(f"DeepSpeed partitioned {list(self.parts)}, the plan assumed {expected}")
        self.stage_plan = plans[self.stage_id]
        apply_plan(self.forward_funcs, self.stage_plan)

    def forward(self, forward_input):
        return run_stage(self.forward_funcs, self.stage_plan, forward_input)

    def tied_weight_digest(self) -> str | None:
        """SHA-256 of the tied embedding/LM-head weight held by this stage (first and last stages),
        so a run can show that both copies stayed identical."""
        if not self.tied_modules:
            return None
        (module,) = self.tied_modules.values()
        weight = module.wte.weight.detach().cpu().contiguous()
        return hashlib.sha256(weight.view(-1).view(torch.uint8).numpy().tobytes()).hexdigest()
