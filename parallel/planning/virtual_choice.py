"""The schedules with virtual stages priced for a run, as the dry run prints them beside today's: the model split into
2 chunks per rank (2 x the pipeline's stages, by the same partition routine), each chunk planned under the run's
fixed recompute mode and priced by `price_stage` (its seconds per instruction), every rank's programme replayed by
parallel/planning/virtual_sim.py and walked for its activation bytes (parallel/planning/virtual_memory.py).

The engine does not run these schedules yet: the dry run shows what they would give. `auto` is not planned per
chunk here (its budget is a rank's, shared by the rank's chunks): the dry run says so.
"""

from dataclasses import dataclass, replace

from model import GPTConfig
from parallel.planning.config import AutoRecompute, RecomputeConfig
from parallel.planning.layout import PipelineLayout, build_layout
from parallel.planning.shapes import GIB, RunShape, Shape, Topology
from parallel.planning.stage_price import StagePricing, price_stage
from parallel.planning.virtual_memory import one_chunk_peaks, virtual_peaks
from parallel.planning.virtual_schedules import VIRTUAL_SCHEDULES, virtual_schedule
from parallel.planning.virtual_sim import simulate_virtual

CHUNKS = 2


@dataclass(frozen=True)
class VirtualOption:
    """One schedule with virtual stages, priced."""

    schedule: str
    step_time_s: float
    activation_bytes: tuple[int, ...]
    """Each rank's activation peak (its chunks' kept bytes, deferred W's and received messages at once)."""
    state_bytes: tuple[int, ...]
    """Each rank's parameters, gradients and optimizer state: its chunks' together."""


def virtual_options(
    model: GPTConfig, recompute: RecomputeConfig, layout: PipelineLayout, run: RunShape, seed: int
) -> list[VirtualOption]:
    """Every schedule of VIRTUAL_SCHEDULES that takes the run's micro-batches, on `layout`'s ranks x 2 chunks,
    priced with `layout`'s time model."""
    ranks = run.topology.pipeline_stages
    virtual_run = replace(run, topology=Topology(CHUNKS * ranks, run.topology.data_parallel_size))
    chunks = build_layout(model, recompute, virtual_run, "type:Block", seed, schedule="1f1b", price_alternatives=False)
    shape = Shape.of(model, run.micro_batch_size)
    pricing = StagePricing.of(layout.recipes, virtual_run, shape, layout.timing)
    prices = [price_stage(pricing, stage, plan) for stage, plan in zip(chunks.stages, chunks.plans)]
    out = []
    for schedule in VIRTUAL_SCHEDULES:
        try:
            programs = virtual_schedule(schedule, run.micro_batches, ranks, CHUNKS)
        except ValueError:  # interleaved-1f1b's rounds: micro-batches not a multiple of the ranks
            continue
        placement = programs[0].placement
        mine = [[placement.virtual_stage(rank, chunk) for chunk in range(CHUNKS)] for rank in range(ranks)]
        costs = [[prices[v].costs for v in stages] for stages in mine]
        peaks = virtual_peaks(
            layout.recipes, chunks.stages, chunks.plans, schedule, CHUNKS, run.micro_batches, shape, run.target
        )
        states = tuple(sum(sum(prices[v].memory.states.values()) for v in stages) for stages in mine)
        step = simulate_virtual(programs, costs).step_time_s
        out.append(VirtualOption(schedule, step, tuple(p.bytes for p in peaks), states))
    return out


def virtual_lines(
    model: GPTConfig, recompute: RecomputeConfig, layout: PipelineLayout, run: RunShape, seed: int
) -> list[str]:
    """The dry run's lines: each virtual-stage schedule's simulated step and largest rank, against 1F1B's
    activation peak on the layout's own stages under the same mode."""
    if isinstance(recompute, AutoRecompute):
        return [
            "virtual stages (2 chunks per rank): not priced under +recompute=auto (its budget is not split by chunk)"
        ]
    if layout.timing is None:
        return []
    shape = Shape.of(model, run.micro_batch_size)
    peaks = one_chunk_peaks(layout.recipes, layout.stages, layout.plans, "1f1b", run.micro_batches, shape, run.target)
    one_f_one_b = max(peak.bytes for peak in peaks)
    lines = [
        "virtual stages (2 chunks per rank; planned, not run by the engine yet):",
        f"{'schedule':>16} {'step (s)':>9} {'activations GiB':>15} {'x 1f1b':>7} {'states GiB':>10}",
    ]
    for option in virtual_options(model, recompute, layout, run, seed):
        largest = max(option.activation_bytes)
        lines.append(
            f"{option.schedule:>16} {option.step_time_s:>9.4g} {largest / GIB:>15.3f} "
            f"{largest / max(one_f_one_b, 1):>7.2f} {max(option.state_bytes) / GIB:>10.3f}"
        )
    return lines
