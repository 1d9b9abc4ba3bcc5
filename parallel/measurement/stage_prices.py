"""Prices from the real stage: the seconds a plan is priced with (parallel/planning/block_prices.py's
MeasuredSeconds), timed instruction by instruction by the stage replay (parallel/measurement/stage_replay.py, the
interpreter the engine runs, with DeepSpeed's buffers and clones) at the run's exact micro-batch shape.

One probe model stands for every stage: the run's model with one block, split into three stages (the embeddings, the
block, the final norm with the head and its loss), each replayed alone against fake neighbours. The block is timed
under each option (none, each selective part, full) and both schedules' backward (1F1B's whole backward, ZB-H1's B and
W); a stage of n blocks is then priced as n of them (parallel/planning/instruction_seconds.py), so the cost does not
grow with the model's depth or the number of stages. A recompute's seconds are what its option adds to the block's
backward. The links are not timed here (one process): they come from the device profile, when it measured them.

Each instruction's seconds are the median over PROBE_MICRO_BATCHES micro-batches x TIMED_STEPS steps, after one
warm-up step. The replay keeps fp32 optimizer states on CPU only, so only such runs are measured (`refusal`).

A compiled run (train.compile) is priced from compiled instructions: the probe's block is compiled as a rank compiles
it (parallel/runtime/compile_blocks.py, after its plan) in every replay but those of the parts no compiled run runs
(selective `layernorm` and ZB-H1's split backward, both refused under compile), which are timed eager; the warm-up step
compiles, and dynamo forgets the graphs before each replay (its recompile limit is shared by every block's module).
"""

import statistics
import time
from collections import defaultdict
from dataclasses import dataclass, replace

import torch

from model import BLOCK_CLASSES, GPTConfig, gpt_layers, layer_param_counts
from parallel.measurement.stage_replay import StageReplay
from parallel.planning.block_prices import SELECTIVE_PARTS, MeasuredSeconds
from parallel.planning.flops import block_forward_flops
from parallel.planning.instruction_seconds import CPU_FLOPS_PER_S
from parallel.planning.layout import PipelineLayout
from parallel.planning.partition import stages_of_parts
from parallel.planning.shapes import RunShape, Shape, Topology
from parallel.planning.stage_bytes import stage_memory
from parallel.planning.stage_plan import StagePlan

PROBE_MICRO_BATCHES = 2
TIMED_STEPS = 2
MEASURE_LIMIT_S = 120.0
"""The most the probe may cost by the analytic estimate (a shape this device would take longer to time is priced by
the curves): a guard, not a figure."""
MEMORY_SHARE = 0.5
"""The share of a rank's memory the probe's largest stage may hold."""
EMBEDDING, BLOCK, HEAD = 0, 1, 2
"""The probe's stages."""


@dataclass(frozen=True)
class StageMeasurement:
    """What the probe measured, and what it cost."""

    seconds: MeasuredSeconds
    replays: int
    """Stage replays run (each a warm-up step and TIMED_STEPS timed ones)."""
    wall_s: float
    """Seconds the whole measurement took."""


def probe_layout(model: GPTConfig, run: RunShape, schedule: str) -> tuple[PipelineLayout, RunShape]:
    """The run's model with one block, as three stages (embeddings | block | head), planned with no recompute, and
    the run it is replayed in (PROBE_MICRO_BATCHES micro-batches of the run's size, one data-parallel replica)."""
    recipes = gpt_layers(replace(model, n_layer=1), seed=0)
    (block,) = [i for i, recipe in enumerate(recipes) if recipe.module_class in BLOCK_CLASSES]
    stages = stages_of_parts([0, block, block + 1, len(recipes)])
    probe_run = RunShape(Topology(3), run.target, PROBE_MICRO_BATCHES, run.micro_batch_size, grad_clip=run.grad_clip)
    return PipelineLayout(recipes, stages, [StagePlan()] * 3, schedule=schedule), probe_run


def refusal(model: GPTConfig, run: RunShape, available_bytes: int) -> str | None:
    """Why this run's stage cannot be measured here (None: it can): its device and precision, the probe's bytes
    against `available_bytes` (a rank's share of the machine), its estimated time against MEASURE_LIMIT_S. Every rank
    must reach the same answer from the same inputs."""
    target = run.target
    if target.device != "cpu" or target.precision != "fp32":
        return f"the stage replay runs fp32 on CPU only (this run: {target.precision} on {target.device})"
    layout, probe_run = probe_layout(model, run, "1f1b")
    shape = Shape.of(model, run.micro_batch_size)
    counts = layer_param_counts(layout.recipes)
    peak = max(
        stage_memory(layout.recipes, stage, StagePlan(), shape, probe_run, counts).predicted_peak_bytes
        for stage in layout.stages
    )
    if peak > MEMORY_SHARE * available_bytes:
        return (
            f"one block at this shape holds {peak / 2**30:.1f} GiB, more than {MEMORY_SHARE:.0%} of a rank's "
            f"{available_bytes / 2**30:.1f} GiB"
        )
    # a block's forward, backward and recompute for every replay's micro-batches, at the analytic CPU rate
    estimate = 4 * block_forward_flops(shape) * len(_probes()) * (TIMED_STEPS + 1) * PROBE_MICRO_BATCHES
    if estimate / CPU_FLOPS_PER_S > MEASURE_LIMIT_S:
        return f"timing one block at this shape would take about {estimate / CPU_FLOPS_PER_S:.0f} s on this device"
    return None


def _probes() -> list[tuple[str, int, StagePlan]]:
    """(schedule, stage, the stage's plan) of each replay the measurement runs."""
    none = StagePlan()
    return [
        ("1f1b", EMBEDDING, none),
        ("1f1b", BLOCK, none),
        ("1f1b", HEAD, none),
        *(("1f1b", BLOCK, StagePlan(selective={0: (part,)})) for part in SELECTIVE_PARTS),
        ("1f1b", BLOCK, StagePlan(segments=((0, 1),))),
        ("zb-h1", BLOCK, none),
        ("zb-h1", HEAD, none),
    ]


def _compiles(schedule: str, stage: int, plan: StagePlan) -> bool:
    """Whether a compiled run's replay of this probe compiles its block: every 1F1B block probe but selective
    `layernorm`'s (parallel/runtime/compile_blocks.py's compile_refusal refuses it and zb-h1)."""
    return schedule == "1f1b" and stage == BLOCK and "layernorm" not in plan.selective.get(0, ())


def _instruction_seconds(layout: PipelineLayout, stage: int, run: RunShape, compile: bool = False) -> dict[str, float]:
    """The median seconds of each instruction kind of one replayed stage (`compile`: its block compiled)."""
    if compile:
        torch._dynamo.reset()
    replay = StageReplay(layout, stage, run, compile=compile)
    replay.step()  # warm-up: allocates the gradients and the optimizer's states
    spans = defaultdict(list)
    for _ in range(TIMED_STEPS):
        for name, seconds in replay.timed_step():
            spans[name].append(seconds)
    return {name: statistics.median(values) for name, values in spans.items()}


def measure_stage_prices(
    model: GPTConfig,
    run: RunShape,
    transfer: float | None = None,
    link_bytes_per_s: float | None = None,
    compile: bool = False,
) -> StageMeasurement:
    """Every part the planner prices, timed at the run's shape on this process's threads; `transfer` and
    `link_bytes_per_s`: the device profile's links, when it measured them; `compile`: train.compile (the module
    docstring)."""
    start = time.perf_counter()
    timed = {}
    for schedule, stage, plan in _probes():
        layout, probe_run = probe_layout(model, run, schedule)
        plans = list(layout.plans)
        plans[stage] = plan
        key = (schedule, stage, plan.choice_of(0))
        compiled = compile and _compiles(schedule, stage, plan)
        timed[key] = _instruction_seconds(replace(layout, plans=plans), stage, probe_run, compiled)
    if compile:
        torch._dynamo.reset()
    plain = timed[("1f1b", BLOCK, "none")]

    def recompute(choice: str) -> float:
        # what the option adds to the block's backward (noise can make it negative: nothing is added then)
        return max(0.0, timed[("1f1b", BLOCK, choice)]["BackwardPass"] - plain["BackwardPass"])

    layout, _ = probe_layout(model, run, "1f1b")
    block_params = sum(layer_param_counts(layout.recipes)[i] for i in layout.stages[BLOCK].layers)
    seconds = MeasuredSeconds(
        **{part: recompute(f"selective:{part}") for part in SELECTIVE_PARTS},
        block_recompute=recompute("full"),
        block_forward=plain["ForwardPass"],
        block_backward=plain["BackwardPass"],
        block_weight_grad=timed[("zb-h1", BLOCK, "none")]["BackwardWeight"],
        block_backward_input=timed[("zb-h1", BLOCK, "none")]["BackwardInput"],
        embedding_forward=timed[("1f1b", EMBEDDING, "none")]["ForwardPass"],
        embedding_backward=timed[("1f1b", EMBEDDING, "none")]["BackwardPass"],
        head_forward=timed[("1f1b", HEAD, "none")]["ForwardPass"],
        head_backward=timed[("1f1b", HEAD, "none")]["BackwardPass"],
        head_weight_grad=timed[("zb-h1", HEAD, "none")].get("BackwardWeight", 0.0),
        head_backward_input=timed[("zb-h1", HEAD, "none")]["BackwardInput"],
        optimizer_per_param=plain["OptimizerStep"] / block_params,
        load=timed[("1f1b", EMBEDDING, "none")]["LoadMicroBatch"],
        reduce_grads_per_param=plain["ReduceGrads"] / block_params,
        transfer=transfer,
        link_bytes_per_s=link_bytes_per_s,
    )
    return StageMeasurement(seconds, len(timed), time.perf_counter() - start)
