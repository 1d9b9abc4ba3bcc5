"""The run plan: per stage, what a run will hold and compute before it runs (plan.json, the dry run's
table, the planned figures in summary.json). The last step of planning: it reads the layout (which already
holds auto's choices), prices each stage with parallel/planning/stage_price.py, and nothing in planning reads it
back.

`plan_run` returns a typed `RunPlan` (parallel/planning/plan_record.py: its JSON and the dry run's table).
"""

import statistics

from model import BLOCK_CLASSES, GPTConfig
from parallel.planning.auto_recompute import StageBudget
from parallel.planning.block_prices import analytic_prices
from parallel.planning.compression import lossy_note
from parallel.planning.config import FullRecompute, NoRecompute, RecomputeConfig, SelectiveRecompute
from parallel.planning.flops import (
    head_flops_per_token,
    model_flops_per_token,
    non_embedding_params,
    segment_recompute_flops,
)
from parallel.planning.instruction_seconds import PEAK_EFFICIENCY, analytic_rates, time_model
from parallel.planning.layout import PipelineLayout
from parallel.planning.memory_model import attention_kernel, stage_input_bytes
from parallel.planning.plan_record import (
    BudgetEstimate,
    ChoiceEstimate,
    FlopsEstimate,
    LayerBytes,
    PaperBytes,
    PlanTarget,
    RunPlan,
    StageEstimate,
)
from parallel.planning.schedule_choice import setting_prices
from parallel.planning.shapes import RunShape, Shape, Target
from parallel.planning.stage_plan import plan_stage
from parallel.planning.stage_price import StagePrice, StagePricing, price_stage, simulate_priced
from parallel.planning.step_sim import Timeline, lower_bound_s
from parallel.planning.step_time_record import StepTimeEstimate

COMPARED_MODES = {"none": NoRecompute(), "selective": SelectiveRecompute(), "full": FullRecompute()}
"""The uniform modes whose predicted step time plan.json gives beside the chosen plan's (their defaults)."""
GPU_TARGETS = ("H100", "A100")
"""A CUDA plan's predicted step time and MFU on these, with analytic costs at their peak."""


def block_choices(shape: Shape, target: Target) -> dict[str, ChoiceEstimate]:
    """Every recompute choice for one block: bytes kept per micro-batch, saving against none, and the
    forward FLOPs redone in backward (block_prices' options; under train.compile those a compiled block was measured
    with). `full` is a one-block segment (its input only)."""
    prices = analytic_prices(shape, target)
    none = prices.block_bytes
    figures = {"none": (none, 0), "full": (prices.segment_input_bytes, segment_recompute_flops(shape, 1))}
    figures.update({o.choice: (o.kept_bytes, o.recompute_flops) for o in prices.options[1:]})
    return {name: ChoiceEstimate(kept, none - kept, flops) for name, (kept, flops) in figures.items()}


def plan_run(model: GPTConfig, recompute: RecomputeConfig, layout: PipelineLayout, run: RunShape) -> RunPlan:
    shape, target = Shape.of(model, run.micro_batch_size), run.target
    kernel = attention_kernel(shape, target)
    pricing = StagePricing.of(layout.recipes, run, shape, layout.timing)
    prices = [price_stage(pricing, stage, plan, layout.schedule) for stage, plan in zip(layout.stages, layout.plans)]
    stages = []
    for index, (stage, price) in enumerate(zip(layout.stages, prices)):
        memory, flops = price.memory, price.flops
        recomputed = price.plan.recomputed_count(run.micro_batches)
        stages.append(
            StageEstimate(
                stage=stage.stage,
                layers=(stage.start, stage.stop),
                blocks=sum(layer.is_block for layer in memory.layers),
                choices=tuple(layer.choice for layer in memory.layers if layer.is_block),
                params=memory.params,
                activation_bytes_per_microbatch=memory.activation_bytes,
                stage_input_bytes=stage_input_bytes(stage.stage, shape, target),
                in_flight_microbatches=memory.in_flight,
                pipe_buffers=memory.pipe_buffers,
                peak_activation_bytes=memory.peak_activation_bytes,
                pipe_buffer_bytes=memory.pipe_buffer_bytes,
                param_bytes=memory.states["params"],
                grad_bytes=memory.states["grads"],
                optimizer_bytes=memory.states["optimizer"],
                predicted_peak_bytes=memory.predicted_peak_bytes,
                peak_tensor_terms=memory.peak_tensor_terms,
                model_flops_per_step=flops.model * run.micro_batches,
                hardware_flops_per_step=flops.model * run.micro_batches + flops.recompute * recomputed,
                recompute_flops_per_step=flops.recompute * recomputed,
                layer_activation_bytes=tuple(
                    LayerBytes(layer.flat_index, layer.name, layer.choice, layer.bytes) for layer in memory.layers
                ),
                budget=_budget_estimate(layout.budgets[index]) if layout.budgets else None,
                recomputed_in_flight=memory.recomputed_in_flight,
                plain_activation_bytes_per_microbatch=memory.plain_activation_bytes,
                recomputed_microbatches_per_step=recomputed,
                plan=price.plan.to_record(),
            )
        )
    data_parallel = run.topology.data_parallel_size
    tokens_per_step = run.tokens_per_step(model.seq_len)
    non_embedding = non_embedding_params(pricing.recipes, pricing.param_counts)
    model_flops = model_flops_per_token(model, non_embedding) * tokens_per_step
    step_time = _step_time(layout, prices, model_flops) if layout.timing else None
    recompute_flops = sum(s.recompute_flops_per_step for s in stages) * data_parallel
    return RunPlan(
        target=PlanTarget(target.device, target.precision, model.attention, kernel, model.dropout),
        recompute=vars(recompute),
        lossy=lossy_note(layout.plans),
        pipeline_stages=len(stages),
        data_parallel_size=data_parallel,
        world_size=len(stages) * data_parallel,
        micro_batches=run.micro_batches,
        micro_batch_size=run.micro_batch_size,
        seq_len=model.seq_len,
        stage_input_included=True,
        stages=tuple(stages),
        per_block_activation_bytes=tuple(
            layer.bytes for s in stages for layer in s.layer_activation_bytes if layer.choice != "-"
        ),
        block_choices=block_choices(shape, target),
        korthikanti_per_block_bytes=PaperBytes.of(shape),
        flops=FlopsEstimate(
            non_embedding_params=non_embedding,
            model_flops_per_token=model_flops_per_token(model, non_embedding),
            head_flops_per_token=head_flops_per_token(model),
            tokens_per_step=tokens_per_step,
            model_flops_per_step=model_flops,
            hardware_flops_per_step=model_flops + recompute_flops,
            matmul_flops_per_step=sum(s.model_flops_per_step for s in stages) * data_parallel,
            hardware_over_model=(model_flops + recompute_flops) / model_flops,
        ),
        model=vars(model),
        step_time=step_time,
        considered=tuple(plan.to_json() for plan in layout.considered),
    )


def _step_time(layout: PipelineLayout, prices: list[StagePrice], model_flops: int) -> StepTimeEstimate:
    """The layout's simulated step, and beside it the same stages under each uniform mode and on each GPU."""
    pricing = prices[0].pricing
    run, timing = pricing.run, pricing.timing
    costs = [price.costs for price in prices]
    early = [price.plan.early for price in prices]
    timeline = simulate_priced(prices)
    is_block = [[layout.recipes[i].module_class in BLOCK_CLASSES for i in s.layers] for s in layout.stages]
    # Like with like: each uniform mode under the layout's schedule and early-recompute setting.
    by_mode = {
        mode: simulate_priced(
            setting_prices(
                pricing, layout.stages, [plan_stage(b, config) for b in is_block], layout.schedule, any(early)
            )
        ).step_time_s
        for mode, config in COMPARED_MODES.items()
    }
    by_gpu = {}
    if run.target.device == "cuda":
        table = analytic_prices(pricing.shape, run.target)
        for gpu in GPU_TARGETS:
            rates = analytic_rates("cuda", run.target.precision, gpu=gpu)
            on_gpu = pricing.at(time_model(pricing.shape, run, table, rates))
            # the layout's own plans and schedule: its early recompute and deferred W's included
            gpu_prices = [price_stage(on_gpu, s, p, layout.schedule) for s, p in zip(layout.stages, layout.plans)]
            step = simulate_priced(gpu_prices).step_time_s
            peak = rates.flops_per_s / PEAK_EFFICIENCY * run.topology.world_size
            by_gpu[rates.name] = {"step_time_s": step, "mfu": model_flops / step / peak}
    stages = range(len(layout.stages))
    return StepTimeEstimate(
        costs=timing.source,
        cost_source=vars(timing.table.source),
        device=timing.rates.name,
        predicted_step_time_s=timeline.step_time_s,
        stage_busy_s=tuple(timeline.busy_s(s) for s in stages),
        stage_idle_s=tuple(timeline.idle_s(s) for s in stages),
        stage_recompute_s=tuple(run.micro_batches * c.recompute for c in costs),
        by_mode_s=by_mode,
        by_gpu=by_gpu,
        schedule=layout.schedule,
        early_stages=tuple(s for s in stages if early[s]),
        lower_bound_s=lower_bound_s(costs, run.micro_batches, any(early)),
        stage_instruction_s=tuple(_instruction_seconds(timeline, stage) for stage in stages),
        by_schedule={
            o.schedule + ("+early" if o.early else ""): {
                "step_time_s": o.step_time_s,
                "lower_bound_s": o.lower_bound_s,
                "stage_peak_bytes": list(o.peak_bytes),
                "deferred_weights": [p.deferred_weights for p in o.plans],
                "fits": o.fits,
                "allowed": o.allowed,
                "chosen": o.schedule == layout.schedule and o.early == any(early),
            }
            for o in layout.schedule_options
        },
    )


def _instruction_seconds(timeline: Timeline, stage: int) -> dict[str, float]:
    """The mean simulated seconds of each instruction the stage's programme runs, from the stage reaching it to its
    end: what a traced step times of it (a blocking transfer's or a collective's wait included, as the clipping
    barrier's before an optimizer step)."""
    spans: dict[str, list[float]] = {}
    for interval in timeline.of_stage(stage):
        spans.setdefault(interval.instruction.name, []).append(interval.end_s - interval.posted_s)
    return {name: statistics.fmean(values) for name, values in spans.items()}


def _budget_estimate(budget: StageBudget) -> BudgetEstimate:
    return BudgetEstimate(budget.budget_bytes, budget.least_bytes, budget.choice.cost)
