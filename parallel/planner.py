"""The plan of a run before it runs: per stage, what it holds and what it computes.

`plan_run` takes the pipeline layout training would use (same partition, same StagePlans) and the
analytic models of parallel/memory_model.py and parallel/flops.py, and returns plain data: what the dry
run prints and writes to plan.json, and what a stage-aware automatic recompute can later search over
(`block_choices`: each choice's kept bytes and recompute FLOPs for one block).
"""
from dataclasses import dataclass

from model import Block, GPTConfig
from parallel.config import RecomputeConfig
from parallel.flops import (head_flops_per_token, model_flops_per_token, non_embedding_params,
                            segment_recompute_flops, selective_recompute_flops, stage_flops)
from parallel.layout import PipelineLayout
from parallel.memory_model import (Shape, Target, attention_kernel, block_full_items, block_items,
                                   model_state_bytes, pipe_buffer_bytes, selective_combinations,
                                   stage_activations, stage_input_bytes, total)
from parallel.partition import layer_param_counts
from parallel.schedule import in_flight_micro_batches, pipe_buffers

GIB = 1024 ** 3


@dataclass(frozen=True)
class RunShape:
    """The parts of a run config the plan depends on, outside the model and recompute configs."""

    micro_batches: int
    micro_batch_size: int
    data_parallel: int
    zero_stage: int
    target: Target


def block_choices(shape: Shape, target: Target) -> dict[str, dict]:
    """Every recompute choice for one block: bytes kept per micro-batch, saving against none, and the
    forward FLOPs redone in backward. `full` is a one-block segment (its input only)."""
    kernel = attention_kernel(shape, target)
    none = total(block_items(shape, target))
    choices = {"none": (none, 0),
               "full": (total(block_full_items(shape, target, True)), segment_recompute_flops(shape, 1))}
    for combo in selective_combinations():
        choices["selective:" + "+".join(combo)] = (total(block_items(shape, target, combo)),
                                                   selective_recompute_flops(shape, combo, kernel))
    return {name: {"activation_bytes": kept, "saved_bytes": none - kept, "recompute_flops": flops}
            for name, (kept, flops) in choices.items()}


def plan_run(model: GPTConfig, recompute: RecomputeConfig, layout: PipelineLayout, run: RunShape) -> dict:
    shape = Shape.of(model, run.micro_batch_size)
    target = run.target
    num_stages = len(layout.stages)
    counts = layer_param_counts(layout.recipes)
    tokens_per_step = run.micro_batches * run.micro_batch_size * model.seq_len * run.data_parallel
    stages, per_block = [], []
    for stage, plan in zip(layout.stages, layout.plans):
        is_last = stage.stage == num_stages - 1
        layers = stage_activations(layout.recipes, stage.layers, plan, shape, target, is_last)
        per_block += [layer.bytes for layer in layers if layer.flat_index >= 0
                      and layout.recipes[layer.flat_index].module_class is Block]
        activation = sum(layer.bytes for layer in layers)
        in_flight = in_flight_micro_batches(run.micro_batches, num_stages, stage.stage)
        buffers = pipe_buffers(run.micro_batches, num_stages, stage.stage)
        params = sum(counts[i] for i in stage.layers)
        states = model_state_bytes(params, target.precision, run.zero_stage, run.data_parallel)
        flops = stage_flops(layout.recipes, stage.layers, plan, shape, attention_kernel(shape, target))
        pipe = pipe_buffer_bytes(stage.stage, is_last, shape, target, buffers, in_flight)
        stages.append({
            "stage": stage.stage,
            "layers": [stage.start, stage.stop],
            "blocks": sum(1 for i in stage.layers if layout.recipes[i].module_class is Block),
            "choices": [layer.choice for layer in layers if layer.choice != "-"],  # one per block
            "params": params,
            "activation_bytes_per_microbatch": activation,
            "stage_input_bytes": stage_input_bytes(stage.stage, shape, target),
            "in_flight_microbatches": in_flight,
            "pipe_buffers": buffers,
            "peak_activation_bytes": activation * in_flight,
            "pipe_buffer_bytes": pipe,
            "param_bytes": states["params"],
            "grad_bytes": states["grads"],
            "optimizer_bytes": states["optimizer"],
            "predicted_peak_bytes": sum(states.values()) + activation * in_flight + pipe,
            "model_flops_per_step": flops.model * run.micro_batches,
            "hardware_flops_per_step": flops.hardware * run.micro_batches,
            "recompute_flops_per_step": flops.recompute * run.micro_batches,
            "layer_activation_bytes": [{"layer": layer.flat_index, "name": layer.name, "choice": layer.choice,
                                        "bytes": layer.bytes} for layer in layers],
        })
    model_flops = model_flops_per_token(model) * tokens_per_step
    matmul_model = sum(s["model_flops_per_step"] for s in stages) * run.data_parallel
    recompute_flops = sum(s["recompute_flops_per_step"] for s in stages) * run.data_parallel
    return {
        "target": {"device": target.device, "precision": target.precision,
                   "attention": model.attention, "attention_kernel": attention_kernel(shape, target),
                   "dropout": model.dropout},
        "recompute": vars(recompute),
        "pipeline_stages": num_stages,
        "data_parallel_size": run.data_parallel,
        "world_size": num_stages * run.data_parallel,
        "micro_batches": run.micro_batches,
        "micro_batch_size": run.micro_batch_size,
        "seq_len": model.seq_len,
        "stage_input_included": True,
        "stages": stages,
        "per_block_activation_bytes": per_block,
        "block_choices": block_choices(shape, target),
        "korthikanti_per_block_bytes": korthikanti(shape),
        "flops": {
            "non_embedding_params": non_embedding_params(model),
            "model_flops_per_token": model_flops_per_token(model),
            "head_flops_per_token": head_flops_per_token(model),
            "tokens_per_step": tokens_per_step,
            "model_flops_per_step": model_flops,
            "hardware_flops_per_step": model_flops + recompute_flops,
            "matmul_flops_per_step": matmul_model,
            "hardware_over_model": (model_flops + recompute_flops) / model_flops,
        },
    }


def korthikanti(shape: Shape) -> dict[str, float]:
    """Korthikanti et al. 2022, bytes per block for 16-bit training with dropout and materialised
    scores: sbh(34 + 5as/h) without recompute, 34sbh selective (attention core), 2sbh full."""
    sbh = shape.bsh
    return {"none": sbh * (34 + 5 * shape.a * shape.s / shape.h), "selective": 34.0 * sbh, "full": 2.0 * sbh}


def _gib(n: float) -> str:
    return f"{n / GIB:.3f}" if n < 10 * GIB else f"{n / GIB:.1f}"


def format_plan(plan: dict) -> list[str]:
    """The per-stage table the dry run prints (memory in GiB, FLOPs in TFLOP per step)."""
    t = plan["target"]
    flops = plan["flops"]
    lines = [
        f"plan for {t['device']} {t['precision']} | attention {t['attention']} ({t['attention_kernel']}) | "
        f"dropout {t['dropout']} | recompute {plan['recompute']} | {plan['pipeline_stages']} stages x "
        f"{plan['data_parallel_size']} data-parallel | {plan['micro_batches']} micro-batches of "
        f"{plan['micro_batch_size']} x {plan['seq_len']} tokens",
        "activation bytes per micro-batch include the stage input; memory in GiB",
    ]
    header = (f"{'stage':>5} {'layers':>9} {'blocks':>6} {'params':>14} {'act/mb':>10} {'in-flight':>9} "
              f"{'peak act':>10} {'param+grad+opt':>14} {'pipe buf':>9} {'pred. peak':>10} {'recomp TFLOP':>12}")
    lines.append(header)
    for s in plan["stages"]:
        states = s["param_bytes"] + s["grad_bytes"] + s["optimizer_bytes"]
        lines.append(
            f"{s['stage']:>5} {s['layers'][0]:>4}..{s['layers'][1] - 1:<3} {s['blocks']:>6} {s['params']:>14,} "
            f"{_gib(s['activation_bytes_per_microbatch']):>10} {s['in_flight_microbatches']:>9} "
            f"{_gib(s['peak_activation_bytes']):>10} {_gib(states):>14} {_gib(s['pipe_buffer_bytes']):>9} "
            f"{_gib(s['predicted_peak_bytes']):>10} {s['recompute_flops_per_step'] / 1e12:>12.3f}")
    k = plan["korthikanti_per_block_bytes"]
    blocks = plan["per_block_activation_bytes"]
    lines.append(f"per block: {_gib(max(blocks)) if blocks else '-'} GiB kept (largest block) | paper, 16-bit: "
                 f"none {_gib(k['none'])}, selective {_gib(k['selective'])}, full {_gib(k['full'])} GiB")
    lines.append(f"model FLOPs/step {flops['model_flops_per_step'] / 1e12:.3f} TFLOP | hardware FLOPs/step "
                 f"{flops['hardware_flops_per_step'] / 1e12:.3f} TFLOP (x{flops['hardware_over_model']:.3f})")
    return lines
