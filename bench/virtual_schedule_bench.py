"""Planned activation bytes per rank and simulated step time of the schedules with virtual stages against 1F1B and
ZB-H1, for one pipeline shape (no process group, no timing: bytes are the planner's, exact; times are the simulator's
in units of one block's forward).

    .venv/bin/python -m bench.virtual_schedule_bench [--ranks 4] [--micro-batches 8] [--layers 16] [--measure]
        [--modes none selective full] [--measure-layers 8]

Each schedule runs the same GPT-2 blocks (balanced over the stages by block count, parallel.partition_method
type:Block) with no recompute: 1f1b and zb-h1 on `ranks` stages, interleaved-1f1b, zb-v and v-half on 2 x `ranks`
virtual stages. The step time prices a forward at 1 per block, a backward at 2 (B 1 + W 1), transfers and the
optimizer at 0: it compares the schedules' bubbles, not a device.

`--measure` also measures, on CPU, each rank's activation bytes (its peak tensor bytes above the step's baseline of
parameters, gradients and optimizer state: parallel/measurement/tensor_peak.py) with the stage replay (1f1b:
parallel/measurement/stage_replay.py, DeepSpeed's buffers included, which its planned walk leaves out; the
virtual-stage schedules: parallel/measurement/virtual_replay.py) for a small GPT-2 (8 blocks, h 64, s 128, dropout
0.1, fp32, 2 sequences per micro-batch), under each of `--modes` (`selective`: core_attn; `full`: interval 1),
against the same plans. Bytes are exact, so the machine's load does not change them; about a minute per mode.
"""

import argparse
from dataclasses import replace

from model import BLOCK_CLASSES, GPTConfig, gpt_layers
from parallel.measurement.stage_replay import StageReplay
from parallel.measurement.virtual_replay import VirtualRankReplay
from parallel.planning.config import FullRecompute, NoRecompute, SelectiveRecompute
from parallel.planning.layout import build_layout
from parallel.planning.partition import partition_layers
from parallel.planning.shapes import RunShape, Shape, Target, Topology
from parallel.planning.stage_plan import StagePlan
from parallel.planning.step_sim import StageCosts, simulate_stages
from parallel.planning.virtual_memory import one_chunk_peaks, virtual_peaks
from parallel.planning.virtual_program import VIRTUAL_SCHEDULES
from parallel.planning.virtual_schedules import virtual_schedule
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


SMALL = GPTConfig(n_layer=8, n_head=2, n_embd=64, seq_len=128, vocab_size=64, dropout=0.1, attention="math")


MODES = {"none": NoRecompute(), "selective": SelectiveRecompute(), "full": FullRecompute()}


def measured_rows(
    ranks: int, micro_batches: int, mode: str, model: GPTConfig = SMALL
) -> list[tuple[str, list[int], list[int]]]:
    """(schedule, each rank's measured activation bytes, each rank's planned) for `model` on CPU under `mode`."""

    def layout(stages: int):
        run = RunShape(Topology(stages), Target("cpu", "fp32"), micro_batches=micro_batches, micro_batch_size=2)
        return build_layout(model, MODES[mode], run, "type:Block", 0), run

    def above_baseline(peak) -> int:
        return peak.peak_bytes - peak.baseline_bytes

    shape, target = Shape.of(model, 2), Target("cpu", "fp32")
    one, run = layout(ranks)
    measured = [above_baseline(StageReplay(one, s, run).measure_peak()) for s in range(ranks)]
    planned = one_chunk_peaks(one.recipes, one.stages, one.plans, "1f1b", micro_batches, shape, target)
    out = [("1f1b", measured, [p.bytes for p in planned])]
    virtual, _ = layout(2 * ranks)
    for schedule in VIRTUAL_SCHEDULES:
        measured = [
            above_baseline(VirtualRankReplay(virtual, schedule, 2, r, micro_batches, 2).measure_peak())
            for r in range(ranks)
        ]
        planned = virtual_peaks(
            virtual.recipes, virtual.stages, virtual.plans, schedule, 2, micro_batches, shape, target
        )
        out.append((schedule, measured, [p.bytes for p in planned]))
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--micro-batches", type=int, default=8)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--measure", action="store_true", help="also measure activation bytes per rank on CPU")
    parser.add_argument("--modes", nargs="+", choices=MODES, default=["none"], help="recompute modes measured")
    parser.add_argument("--measure-layers", type=int, default=SMALL.n_layer, help="blocks of the measured small GPT-2")
    args = parser.parse_args(argv)
    small = replace(SMALL, n_layer=args.measure_layers)
    results = rows(args.ranks, args.micro_batches, args.layers)
    base = max(results[0][1])
    print(f"{args.ranks} ranks, {args.micro_batches} micro-batches, {args.layers} GPT-2 blocks (h 768, s 1024, bf16)")
    print(f"{'schedule':<18}{'largest rank MiB':>18}{'x 1f1b':>8}{'step (block fwd)':>18}   per rank MiB")
    for schedule, peaks, step in results:
        per_rank = " ".join(f"{p / 2**20:.0f}" for p in peaks)
        print(f"{schedule:<18}{max(peaks) / 2**20:>18.1f}{max(peaks) / base:>8.2f}{step:>18.1f}   {per_rank}")
    if not args.measure:
        return 0
    for mode in args.modes:
        shape = f"{small.n_layer} blocks h {small.n_embd} s {small.seq_len}, fp32"
        print(f"\nmeasured on CPU (stage replay), {shape}, {mode}")
        print(
            f"{'schedule':<18}{'largest rank KiB':>18}{'x 1f1b':>8}{'planned KiB':>14}{'x 1f1b':>8}"
            "   per rank measured / planned bytes"
        )
        measured = measured_rows(args.ranks, args.micro_batches, mode, small)
        base, planned_base = max(measured[0][1]), max(measured[0][2])
        for schedule, bytes_, planned in measured:
            per_rank = " ".join(f"{b}/{p}" for b, p in zip(bytes_, planned))
            line = f"{schedule:<18}{max(bytes_) / 1024:>18.0f}{max(bytes_) / base:>8.2f}{max(planned) / 1024:>14.0f}"
            print(f"{line}{max(planned) / planned_base:>8.2f}   {per_rank}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
