"""The pipeline layout of a run, with `recompute=auto` planned stage by stage against the budget."""
import math
from typing import Optional

from model import Block, GPTConfig, gpt_layers
from parallel.auto_recompute import GIB, CostTable, StageBudget, analytic_costs, choose_stage, least_stage_bytes, stage_plan
from parallel.config import AutoRecompute, RecomputeConfig
from parallel.layout import PipelineLayout, pipeline_layout
from parallel.memory_model import Shape, model_state_bytes, pipe_buffer_bytes, stage_activations
from parallel.partition import layer_param_counts, partition_layers
from parallel.planner import RunShape
from parallel.recompute import StagePlan
from parallel.schedule import in_flight_micro_batches, pipe_buffers


def layout_for(model: GPTConfig, recompute: RecomputeConfig, num_stages: int, partition_method: str, seed: int,
               run: RunShape, costs: Optional[CostTable] = None) -> tuple[PipelineLayout, Optional[list[StageBudget]]]:
    """The layout training and the dry run use; for `auto`, also each stage's side of the budget."""
    if not isinstance(recompute, AutoRecompute):
        return pipeline_layout(model, recompute, num_stages, partition_method, seed), None
    return auto_layout(model, recompute, num_stages, partition_method, seed, run, costs)


def auto_layout(model: GPTConfig, auto: AutoRecompute, num_stages: int, partition_method: str, seed: int,
                run: RunShape, costs: Optional[CostTable] = None) -> tuple[PipelineLayout, list[StageBudget]]:
    recipes = gpt_layers(model, seed)
    stages = partition_layers(recipes, num_stages, partition_method)
    shape, target = Shape.of(model, run.micro_batch_size), run.target
    table = costs or analytic_costs(shape, target)
    counts = layer_param_counts(recipes)
    usable = (auto.budget_gb - auto.reserve_gb) * GIB
    plans, budgets = [], []
    for stage in stages:
        is_last = stage.stage == num_stages - 1
        positions = [local for local, flat in enumerate(stage.layers) if recipes[flat].module_class is Block]
        in_flight = in_flight_micro_batches(run.micro_batches, num_stages, stage.stage)
        buffers = pipe_buffers(run.micro_batches, num_stages, stage.stage)
        states = model_state_bytes(sum(counts[i] for i in stage.layers), target.precision, run.zero_stage,
                                   run.data_parallel)
        others = sum(layer.bytes for layer in stage_activations(recipes, stage.layers, StagePlan(), shape, target, is_last)
                     if layer.flat_index < 0 or recipes[layer.flat_index].module_class is not Block)
        fixed = (sum(states.values()) + pipe_buffer_bytes(stage.stage, is_last, shape, target, buffers, in_flight)
                 + in_flight * others)
        choice = choose_stage(len(positions), table, in_flight, usable - fixed)
        budgets.append(StageBudget(stage.stage, in_flight, fixed, choice,
                                   fixed + least_stage_bytes(len(positions), table, in_flight)))
        plans.append(stage_plan(choice, positions, table) if choice else StagePlan())
    _check_fits(auto, budgets)
    return PipelineLayout(recipes, stages, plans), budgets


def _check_fits(auto: AutoRecompute, budgets: list[StageBudget]) -> None:
    failing = [b for b in budgets if b.choice is None]
    if not failing:
        return
    # Rounded up to 0.01 GiB, so the budget quoted really fits.
    smallest = math.ceil(100 * (max(b.least_bytes for b in budgets) / GIB + auto.reserve_gb)) / 100
    stages = ", ".join(str(b.stage) for b in failing)
    raise ValueError(
        f"recompute.budget_gb={auto.budget_gb} does not fit stage {stages}, not even with full recompute of every "
        f"block: the smallest budget that fits every stage is recompute.budget_gb={smallest:.2f} (with "
        f"recompute.reserve_gb={auto.reserve_gb}). Also helps: more stages (parallel.pipeline_stages), a smaller "
        f"train.micro_batch_size, train.precision=bf16, or parallel.zero_stage=1 with data parallelism"
    )
