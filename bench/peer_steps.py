"""What every peer rank of bench/pipeline_peers.py shares: its command line, the batches, and the measured steps.

A peer rank trains `--steps` steps on stagecheck's synthetic batches (the same (seed, step, micro-batch) batches a
`train.py` run of the same shape draws), and writes one JSON file per rank into `--out`:
- step 1 warms the allocator and the kernels up;
- step 2 runs inside parallel/measurement/tensor_peak.py's window (the most live tensor bytes of the rank at once,
  parameters, gradients and optimizer state included), as `train.py` measures its own at train.measure_step 2;
- steps 3.. are timed (wall and CPU time of the rank), each after a barrier, as `train.py` times its steps.
"""

import argparse
import json
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

from data import SyntheticDataConfig, open_token_source
from model import GPTConfig
from parallel.measurement.tensor_peak import TensorPeakMeter

SEED = 1234
"""train.py's default `seed`: the weights and the batches of every configuration."""
METERED_STEP = 2


def parse(description: str) -> tuple[argparse.Namespace, GPTConfig]:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--variant", required=True)
    parser.add_argument("--layers", type=int, required=True)
    parser.add_argument("--embd", type=int, required=True)
    parser.add_argument("--heads", type=int, required=True)
    parser.add_argument("--seq-len", type=int, required=True)
    parser.add_argument("--dropout", type=float, required=True)
    parser.add_argument("--attention", required=True)
    parser.add_argument("--micro-batches", type=int, required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--out", type=Path, required=True)
    args, _ = parser.parse_known_args()  # the deepspeed launcher appends --local_rank
    cfg = GPTConfig(
        n_layer=args.layers,
        n_head=args.heads,
        n_embd=args.embd,
        seq_len=args.seq_len,
        vocab_size=256,
        dropout=args.dropout,
        attention=args.attention,
    )
    return args, cfg


def batches(cfg: GPTConfig, step: int, micro_batches: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The step's (inputs, labels) per micro-batch, (1, T) each: train.py's batches for data=synthetic."""
    source = open_token_source(SyntheticDataConfig(), cfg.vocab_size)
    return [source.batch(SEED, step, 0, micro, 1, cfg.seq_len) for micro in range(micro_batches)]


def measure(args: argparse.Namespace, step: Callable[[int], float | None]) -> None:
    """Runs `step(k)` (one training step, optimizer included; its loss where this rank has it) for k = 1..steps
    and writes this rank's figures."""
    record = {"rank": dist.get_rank(), "step_s": [], "cpu_s": [], "losses": []}
    for k in range(1, args.steps + 1):
        dist.barrier()
        if k == METERED_STEP:
            with TensorPeakMeter().window() as peak:
                loss = step(k)
            record.update(peak_bytes=peak[0].peak_bytes, baseline_bytes=peak[0].baseline_bytes)
            record["unaccounted_bytes"] = peak[0].unaccounted_bytes
        else:
            wall, cpu = time.perf_counter(), time.process_time()
            loss = step(k)
            if k > METERED_STEP:
                record["step_s"].append(time.perf_counter() - wall)
                record["cpu_s"].append(time.process_time() - cpu)
        record["losses"].append(loss)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"rank{dist.get_rank()}.json").write_text(json.dumps(record) + "\n")
