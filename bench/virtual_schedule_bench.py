"""Planned activation bytes per rank and simulated step time of the schedules with virtual stages against 1F1B and
ZB-H1, for one pipeline shape (no process group, no timing: bytes are the planner's, exact; times are the simulator's
in units of one block's forward).

    .venv/bin/python -m bench.virtual_schedule_bench [--ranks 4] [--micro-batches 8] [--layers 16]

Each schedule runs the same GPT-2 blocks (balanced over the stages by block count, parallel.partition_method
type:Block) with no recompute: 1f1b and zb-h1 on `ranks` stages, interleaved-1f1b, zb-v and v-half on 2 x `ranks`
virtual stages. The step time prices a forward at 1 per block, a backward at 2 (B 1 + W 1), transfers and the
optimizer at 0: it compares the schedules' bubbles, not a device.
"""

import argparse

from model import BLOCK_CLASSES, GPTConfig, gpt_layers
from parallel.planning.partition import partition_layers
from parallel.planning.shapes import Shape, Target
from parallel.planning.stage_plan import StagePlan
from parallel.planning.step_sim import StageCosts, simulate_stages
from parallel.planning.virtual_memory import one_chunk_peaks, virtual_peaks
from parallel.planning.virtual_schedules import VIRTUAL_SCHEDULES, virtual_schedule
from parallel.planning.virtual_sim import simulate_virtual


def block_costs(recipes, stage) -> StageCosts:
    blocks = sum(recipes[i].module_class in BLOCK_CLASSES for i in stage.layers)
    return StageCosts(blocks, 2.0 * blocks, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, weight_grad=float(blocks))


def rows(ranks: int, micro_batches: int, layers: int) -> list[tuple[str, list[int], float]]:
    """(schedule, each rank's planned activation peak in bytes, simulated step time) per schedule."""
    config = GPTConfig(n_layer=layers, n_head=12, n_embd=768, seq_len=1024, vocab_size=50257, dropout=0.1)
    recipes = gpt_layers(config, seed=0)
    shape, target = Shape.of(config, 1), Target("cuda", "bf16")
    out = []
    one = partition_layers(recipes, ranks, "type:Block")
    for schedule in ("1f1b", "zb-h1"):
        peaks = one_chunk_peaks(recipes, one, [StagePlan()] * ranks, schedule, micro_batches, shape, target)
        step = simulate_stages([block_costs(recipes, s) for s in one], micro_batches, schedule).step_time_s
        out.append((schedule, [p.bytes for p in peaks], step))
    virtual = partition_layers(recipes, 2 * ranks, "type:Block")
    for schedule in VIRTUAL_SCHEDULES:
        try:
            programs = virtual_schedule(schedule, micro_batches, ranks, 2)
        except ValueError as refused:
            print(f"{schedule}: {refused}")
            continue
        peaks = virtual_peaks(recipes, virtual, [StagePlan()] * 2 * ranks, schedule, 2, micro_batches, shape, target)
        placement = programs[0].placement
        costs = [[block_costs(recipes, virtual[placement.virtual_stage(r, c)]) for c in range(2)] for r in range(ranks)]
        out.append((schedule, [p.bytes for p in peaks], simulate_virtual(programs, costs).step_time_s))
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--micro-batches", type=int, default=8)
    parser.add_argument("--layers", type=int, default=16)
    args = parser.parse_args(argv)
    results = rows(args.ranks, args.micro_batches, args.layers)
    base = max(results[0][1])
    print(f"{args.ranks} ranks, {args.micro_batches} micro-batches, {args.layers} GPT-2 blocks (h 768, s 1024, bf16)")
    print(f"{'schedule':<18}{'largest rank MiB':>18}{'x 1f1b':>8}{'step (block fwd)':>18}   per rank MiB")
    for schedule, peaks, step in results:
        per_rank = " ".join(f"{p / 2**20:.0f}" for p in peaks)
        print(f"{schedule:<18}{max(peaks) / 2**20:>18.1f}{max(peaks) / base:>8.2f}{step:>18.1f}   {per_rank}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
