"""The pipeline layout: which layers each stage holds and what each stage recomputes. Pure: the
start-up print, the dry run and the engine all read the same layout."""
from dataclasses import dataclass

from model import Block, GPTConfig, LayerRecipe, gpt_layers
from parallel.config import RecomputeConfig
from parallel.partition import StageRange, partition_layers
from parallel.recompute import StagePlan, plan_stage


@dataclass(frozen=True)
class PipelineLayout:
    recipes: list[LayerRecipe]
    stages: list[StageRange]
    plans: list[StagePlan]

    def describe(self) -> list[str]:
        """One line per stage: its layers, each with its recompute choice."""
        lines = []
        for stage, plan in zip(self.stages, self.plans):
            names = []
            for local, flat in enumerate(stage.layers):
                recipe = self.recipes[flat]
                name = "LMHead" if recipe.forward_fn else recipe.module_class.__name__
                choice = plan.choice_of(local) if recipe.module_class is Block else ""
                names.append(f"{flat}:{name}" + (f"[{choice}]" if choice and choice != "none" else ""))
            lines.append(f"stage {stage.stage}: layers {stage.start}..{stage.stop - 1} "
                         f"({len(names)} layers) " + " ".join(names))
        return lines

    def as_dict(self) -> list[dict]:
        """The layout as plain data, for W&B's run config and summaries."""
        return [
            {"stage": s.stage, "layers": [s.start, s.stop],
             "choices": [p.choice_of(local) for local, flat in enumerate(s.layers)
                         if self.recipes[flat].module_class is Block]}
            for s, p in zip(self.stages, self.plans)
        ]


def pipeline_layout(model: GPTConfig, recompute: RecomputeConfig, num_stages: int,
                    partition_method: str, seed: int) -> PipelineLayout:
    recipes = gpt_layers(model, seed)
    stages = partition_layers(recipes, num_stages, partition_method)
    plans = [plan_stage([recipes[i].module_class is Block for i in s.layers], recompute) for s in stages]
    return PipelineLayout(recipes, stages, plans)
