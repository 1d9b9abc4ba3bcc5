"""The forward-only pass of a virtual-stage pipeline (parallel/runtime/virtual_engine.py's `eval_batch`): each
micro-batch through the virtual stages in order, each chunk on the rank that holds it, in eval mode under no_grad.

Every rank walks the same global sequence (micro-batch, then virtual stage) and takes part only in its own steps, so
each blocking send meets its receive as the next operation of both ranks: no rendezvous can deadlock, whatever the
placement. An activation between two chunks of one rank (the V's turn) stays in the process."""

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from model import head_module
from model.fused_loss import HeadLoss
from parallel.planning.virtual_program import Placement
from parallel.runtime.planned_layers import PlannedLayers


@torch.no_grad()
def forward_losses(
    chunks: dict[int, PlannedLayers],
    placement: Placement,
    rank: int,
    global_rank: Callable[[int], int],
    micro_batches: Sequence[tuple[torch.Tensor, torch.Tensor]] | None,
    count: int,
    hidden: tuple[int, int, int],
    dtype: torch.dtype,
    loss_fn: HeadLoss,
) -> list[torch.Tensor]:
    """Each micro-batch's loss, on the rank holding the last virtual stage (else []). `chunks`: this rank's by virtual
    stage; `global_rank(pipeline rank)`: the process of this replica's pipeline; `micro_batches`: the (token ids,
    labels) of each, (b, s), on the ranks holding the first or the last stage (else None)."""
    last = placement.virtual_stages - 1
    losses = []
    for micro_batch in range(count):
        x = None  # (b, s, h) hidden states; the token ids (b, s) into stage 0
        for stage in range(placement.virtual_stages):
            holder = placement.holder(stage)[0]
            before = placement.holder(stage - 1)[0] if stage > 0 else None
            if holder != rank:
                if before == rank:
                    dist.send(x, dst=global_rank(holder))
                x = None
                continue
            chunk = chunks[stage]
            if stage == 0:
                x = micro_batches[micro_batch][0].to(next(chunk.parameters()).device)
            elif before != rank:
                x = torch.empty(hidden, dtype=dtype, device=next(chunk.parameters()).device)
                dist.recv(x, src=global_rank(before))
            x = chunk(x)
            if stage == last:
                labels = micro_batches[micro_batch][1].to(x.device)
                losses.append(loss_fn(x, labels, head_module(chunk.funcs[-1]).head_weight))
    return losses
