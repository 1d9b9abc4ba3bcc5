"""The links between a rank's chunks and the other ranks' under a virtual-stage schedule: every message of a programme
boundary posted as one batch (parallel/planning/virtual_schedules.py).

A programme posts each message on both of its ranks at the same boundary, so a rank that posts all of a boundary's
sends and receives together, then waits for them, can never wait on a peer that waits on it, even where a send is a
rendezvous (gloo's, and NCCL's for large messages: docs/PITFALLS.md). The chunks' interpreters
(parallel/runtime/stage_interpreter.py) run with `posted_sends` off and call `send` and `recv` on their `ChunkLink`,
which only notes the message; the rank's runner flushes the batch at the boundary (parallel/runtime/virtual_rank.py).
A receive is therefore complete only after the flush: the chunk's work receives each message into a tensor of its
own and reads it in a later step (parallel/runtime/chunk_work.py). A message between two chunks of the same rank (the
V's turn on rank p - 1) is a copy at the flush.

Within a boundary each rank sends at most one message (one compute instruction ends per slot), so messages between
two ranks never need a tag to be told apart; `flush` checks it.
"""

from collections import Counter, defaultdict, deque
from collections.abc import Callable

import torch
import torch.distributed as dist


class BoundaryBatch:
    """A rank's messages of the current boundary, by virtual stage; `rank_of(virtual stage)` is the global rank that
    holds it, `me` this process's."""

    def __init__(self, rank_of: Callable[[int], int], me: int):
        self.rank_of, self.me = rank_of, me
        self._sends: list[tuple[torch.Tensor, int, int]] = []  # (tensor, from stage, to stage)
        self._recvs: list[tuple[torch.Tensor, int, int]] = []
        self._local: defaultdict[tuple[int, int], deque[torch.Tensor]] = defaultdict(deque)

    def link(self, stage: int) -> "ChunkLink":
        return ChunkLink(self, stage)

    def note_send(self, tensor: torch.Tensor, frm: int, to: int) -> None:
        self._sends.append((tensor, frm, to))

    def note_recv(self, tensor: torch.Tensor, frm: int, to: int) -> None:
        self._recvs.append((tensor, frm, to))

    @property
    def pending(self) -> bool:
        """Messages are noted for the next flush."""
        return bool(self._sends or self._recvs)

    def flush(self) -> None:
        """Post the boundary's messages as one batch and wait for all of them."""
        remote_sends = [(t, self.rank_of(to)) for t, frm, to in self._sends if self.rank_of(to) != self.me]
        remote_recvs = [(t, self.rank_of(frm)) for t, frm, to in self._recvs if self.rank_of(frm) != self.me]
        for kind, peers in (("sends", remote_sends), ("receives", remote_recvs)):
            repeated = [peer for peer, n in Counter(p for _, p in peers).items() if n > 1]
            if repeated:
                raise RuntimeError(f"rank {self.me}: two {kind} with rank {repeated[0]} at one boundary")
        ops = [dist.P2POp(dist.isend, t, peer) for t, peer in remote_sends]
        ops += [dist.P2POp(dist.irecv, t, peer) for t, peer in remote_recvs]
        works = dist.batch_isend_irecv(ops) if ops else []
        for tensor, frm, to in self._sends:
            if self.rank_of(to) == self.me:
                self._local[(frm, to)].append(tensor)
        for tensor, frm, to in self._recvs:
            if self.rank_of(frm) == self.me:
                tensor.copy_(self._local[(frm, to)].popleft())
        for work in works:  # one Work per operation on gloo, one for the whole batch on NCCL
            work.wait()
        self._sends, self._recvs = [], []


class ChunkLink:
    """Virtual stage `stage`'s end of the rank's boundary batch: the interpreter's Transport, with sends and receives
    noted for the next flush (posted_sends off)."""

    def __init__(self, batch: BoundaryBatch, stage: int):
        self.batch, self.stage = batch, stage

    def send(self, tensor: torch.Tensor, stage: int) -> None:
        self.batch.note_send(tensor, self.stage, stage)

    def recv(self, tensor: torch.Tensor, stage: int) -> None:
        self.batch.note_recv(tensor, stage, self.stage)
