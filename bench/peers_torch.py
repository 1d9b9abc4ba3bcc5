"""Peer rank: torch.distributed.pipelining, as torchtitan drives it, without stagecheck.

    torchrun --nproc_per_node 2 -m bench.peers_torch --variant 1f1b+ckpt ... (bench/pipeline_peers.py runs it)

`--variant SCHEDULE[+ckpt]`: `1f1b` (Schedule1F1B, one stage per rank), `interleaved` (ScheduleInterleaved1F1B, two
stages per rank in a loop: rank r holds stages r and r + 2) or `zbv` (ScheduleZBVZeroBubble, two stages per rank in a
V: rank 0 holds stages 0 and 3, rank 1 stages 1 and 2); `+ckpt` wraps every block in torch's `checkpoint_wrapper`
(non-reentrant torch.utils.checkpoint, torchtitan's full activation checkpointing). The blocks split evenly over the
stages; the embeddings sit on stage 0, the final norm and an untied LM head on the last (torchtitan ties no weights
across stages). The optimizer is train.py's AdamW per rank, with the gradient norm clipped to 1.0 over both ranks.
"""

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleInterleaved1F1B, ScheduleZBVZeroBubble

from bench import peer_gpt
from bench.peer_steps import SEED, batches, measure, parse

SCHEDULES = {"1f1b": Schedule1F1B, "interleaved": ScheduleInterleaved1F1B, "zbv": ScheduleZBVZeroBubble}


def stages_of_rank(schedule: str, rank: int) -> list[int]:
    return {"1f1b": [rank], "interleaved": [rank, rank + 2], "zbv": [rank, 3 - rank]}[schedule]


def stage_module(cfg, index: int, stages: int, checkpointed: bool) -> nn.Module:
    per_stage = cfg.n_layer // stages
    blocks = [peer_gpt.Block(cfg, SEED, i) for i in range(index * per_stage, (index + 1) * per_stage)]
    layers = [checkpoint_wrapper(b) if checkpointed else b for b in blocks]
    if index == 0:
        layers = [peer_gpt.TokenEmbedding(cfg, SEED), peer_gpt.PositionEmbedding(cfg, SEED), *layers]
    if index == stages - 1:
        layers.append(peer_gpt.UntiedHead(cfg, SEED))
    return nn.Sequential(*layers)


def clip_grad_norm(params: list[nn.Parameter], max_norm: float) -> None:
    """torch's clip_grad_norm_ over the parameters of both ranks (each rank holds only its stages')."""
    squares = torch.stack([p.grad.pow(2).sum() for p in params if p.grad is not None]).sum()
    dist.all_reduce(squares)
    scale = (max_norm / (squares.sqrt() + 1e-6)).clamp(max=1.0)
    for p in params:
        if p.grad is not None:
            p.grad.mul_(scale)


def main() -> None:
    args, cfg = parse(__doc__.split("\n")[0])
    schedule_name, _, ckpt = args.variant.partition("+")
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    num_stages = 2 if schedule_name == "1f1b" else 4
    ids = stages_of_rank(schedule_name, rank)
    modules = [stage_module(cfg, i, num_stages, ckpt == "ckpt") for i in ids]
    stages = [PipelineStage(m, i, num_stages, torch.device("cpu")) for m, i in zip(modules, ids)]
    schedule_class = SCHEDULES[schedule_name]
    if schedule_name == "1f1b":
        schedule = schedule_class(stages[0], n_microbatches=args.micro_batches, loss_fn=peer_gpt.loss_fn)
    else:
        schedule = schedule_class(stages, n_microbatches=args.micro_batches, loss_fn=peer_gpt.loss_fn)
    params = [p for m in modules for p in m.parameters()]
    optimizer = torch.optim.AdamW(params, lr=6e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)

    def step(k: int) -> float | None:
        micro = batches(cfg, k, args.micro_batches)
        x = torch.cat([x for x, _ in micro])  # (m, T): the schedule splits it into m micro-batches
        y = torch.cat([y for _, y in micro])
        losses: list[torch.Tensor] = []
        kwargs = {}
        if 0 in ids:
            kwargs["x"] = x
        if num_stages - 1 in ids:
            kwargs.update(target=y, losses=losses)
        x_arg = kwargs.pop("x", None)
        schedule.step(*(() if x_arg is None else (x_arg,)), **kwargs)
        clip_grad_norm(params, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return float(torch.stack(losses).mean()) if losses else None

    measure(args, step)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
