"""A stage's layers built from their recipes in this process and run under the stage's plan: what
parallel/runtime/pipeline.py's RecomputingPipelineModule builds on its rank, without DeepSpeed's PipelineModule (which
holds one contiguous layer range per rank). A rank of a virtual-stage schedule holds one per chunk
(parallel/runtime/virtual_engine.py); the stage replay and the local pipelines hold one per stage
(parallel/measurement/in_process.py's LocalStage)."""

from collections.abc import Sequence

import torch
import torch.nn as nn

from model import LayerRecipe, build_layers
from parallel.planning.partition import StageRange
from parallel.planning.shapes import TORCH_DTYPES
from parallel.planning.stage_plan import StagePlan
from parallel.runtime.compile_blocks import compile_blocks
from parallel.runtime.recompute import apply_plan, run_stage


class PlannedLayers(nn.Module):
    """The layers of `stage` (the tied embedding once per stage that uses it, as DeepSpeed builds it on each rank that
    holds it), in `precision`, planned by `plan`, its blocks compiled under `compile` (train.compile)."""

    def __init__(
        self,
        recipes: Sequence[LayerRecipe],
        stage: StageRange,
        plan: StagePlan,
        precision: str = "fp32",
        compile: bool = False,
    ):
        super().__init__()
        self.stage, self.plan = stage, plan
        self.layers, self.funcs = build_layers([recipes[flat] for flat in stage.layers])
        self.to(TORCH_DTYPES[precision])
        apply_plan(self.funcs, plan)
        if compile:  # train.compile, after the plan as on a rank
            compile_blocks(self.funcs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return run_stage(self.funcs, self.plan, x, first_layer=self.stage.start)
