"""The links between a rank's chunks and the other ranks' under a virtual-stage schedule: every message of a programme
boundary posted as one batch (parallel/planning/virtual_schedules.py), and each waited for only where it must be.

A programme posts each message on both of its ranks at the same boundary. A rank posts a boundary's sends and
receives together without waiting for them, and waits
- for a received message just before the computation that reads it (`wait_for`),
- for an activation it sent when the gradient of that micro-batch arrives (the peer had the activation to make it:
  it is surely delivered, and the output it shares storage with is alive until that backward anyway),
- for the gradients it sent at one boundary when it posts the one after next (their input gradients, which nothing else
  holds, live two slots longer; parallel/planning/virtual_walk.py counts them so): waiting at the next post stalled a
  rank whose peer had not yet posted the receive (on this CPU about one post in four waited 1-9 ms, and ZB-V's steps
  ran 2-3% slower),
- and for everything at the end of the step's last boundary (`complete`).
No rank can wait on a peer that waits on it: whoever waits needs a message its peer posts at a boundary before the
rank's own position, and a peer not there yet is itself waiting for an earlier boundary. Gloo's sends are rendezvous
(docs/PITFALLS.md): waiting for a whole boundary's batch at once made every boundary with a message a meeting of the
two ranks, and each slot's shortest rank waited for the longest (interleaved 1F1B's traced steps, replayed with
their own instruction times under this rule, took 0.85x as long: docs/virtual_stages.md).

The chunks' interpreters (parallel/runtime/stage_interpreter.py) run with `posted_sends` off and call `send` and
`recv` on their `ChunkLink`, which only notes the message, under the key the rank's runner names (`noting`); the
runner posts the batch at the boundary (parallel/runtime/virtual_rank.py). The chunk's work receives each message into
a tensor of its own and reads it in a later step (parallel/runtime/chunk_work.py). A message between two chunks of the
same rank (the V's turn on rank p - 1) is a copy at the post.

Within a boundary each rank sends at most one message to each peer, and both ranks post their messages in boundary
order, so gloo and NCCL match them in order without tags; `post` checks it.
"""

from collections import Counter, defaultdict, deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist

from parallel.runtime.posted_works import PostedWorks

Message = tuple[str, int, int]
"""(activation or grad, the sending virtual stage, micro-batch): parallel/planning/virtual_program.py's
ChunkCommand.message, the same on both sides."""


Exchange = Callable[[list[tuple[torch.Tensor, int]], list[tuple[torch.Tensor, int]]], list]
"""Posts (sends, receives), each (tensor, peer rank), at once and returns their Works without waiting: one per
operation (gloo) or one for all (NCCL)."""


def p2p_exchange(sends: list[tuple[torch.Tensor, int]], recvs: list[tuple[torch.Tensor, int]]) -> list:
    """torch.distributed's point-to-point, as one batch."""
    ops = [dist.P2POp(dist.isend, t, peer) for t, peer in sends] + [
        dist.P2POp(dist.irecv, t, peer) for t, peer in recvs
    ]
    return dist.batch_isend_irecv(ops) if ops else []


class BoundaryBatch:
    """A rank's messages, by virtual stage; `rank_of(virtual stage)` is the global rank that holds it, `me` this
    process's; `exchange` moves the messages to and from the other ranks (the stage replay's fake neighbours:
    parallel/measurement/virtual_replay.py)."""

    def __init__(self, rank_of: Callable[[int], int], me: int, exchange: Exchange = p2p_exchange):
        self.rank_of, self.me, self.exchange = rank_of, me, exchange
        self._message: Message | None = None
        self._sends: list[tuple[torch.Tensor, int, int, Message]] = []  # (tensor, from stage, to stage, message)
        self._recvs: list[tuple[torch.Tensor, int, int, Message]] = []
        self._local: defaultdict[tuple[int, int], deque[torch.Tensor]] = defaultdict(deque)
        self._received: dict[Message, PostedWorks] = {}
        self._sent_activations: dict[Message, tuple[PostedWorks, torch.Tensor]] = {}
        self._sent_grads: list[tuple[PostedWorks, torch.Tensor]] = []
        """The last posted boundary's gradient sends."""
        self._older_grads: list[tuple[PostedWorks, torch.Tensor]] = []
        """The boundary's before, waited for at the next post."""

    def link(self, stage: int) -> "ChunkLink":
        return ChunkLink(self, stage)

    @contextmanager
    def noting(self, message: Message) -> Iterator[None]:
        """The send or receive noted inside is `message`."""
        self._message = message
        try:
            yield
        finally:
            self._message = None

    def note_send(self, tensor: torch.Tensor, frm: int, to: int) -> None:
        self._sends.append((tensor, frm, to, self._noted()))

    def note_recv(self, tensor: torch.Tensor, frm: int, to: int) -> None:
        self._recvs.append((tensor, frm, to, self._noted()))

    def _noted(self) -> Message:
        if self._message is None:
            raise RuntimeError("a message noted outside BoundaryBatch.noting: its key names what waits for it")
        return self._message

    @property
    def pending(self) -> bool:
        """Messages are noted for the next post."""
        return bool(self._sends or self._recvs)

    def post(self) -> None:
        """Wait for the gradients sent at the boundary before the last, then post this boundary's messages as one
        batch, without waiting for them."""
        for completion, _ in self._older_grads:
            completion.wait()
        self._older_grads = self._sent_grads
        self._sent_grads = []
        remote_sends = [(t, self.rank_of(to), m) for t, frm, to, m in self._sends if self.rank_of(to) != self.me]
        remote_recvs = [(t, self.rank_of(frm), m) for t, frm, to, m in self._recvs if self.rank_of(frm) != self.me]
        for kind, peers in (("sends", remote_sends), ("receives", remote_recvs)):
            repeated = [peer for peer, n in Counter(p for _, p, _ in peers).items() if n > 1]
            if repeated:
                raise RuntimeError(f"rank {self.me}: two {kind} with rank {repeated[0]} at one boundary")
        works = self.exchange([(t, peer) for t, peer, _ in remote_sends], [(t, peer) for t, peer, _ in remote_recvs])
        operations = len(remote_sends) + len(remote_recvs)
        # One Work per operation on gloo, one for the whole batch on NCCL.
        each = [PostedWorks([w]) for w in works] if len(works) == operations else [PostedWorks(works)] * operations
        for (tensor, _, message), completion in zip(remote_sends, each):
            if message[0] == "activation":
                self._sent_activations[message] = (completion, tensor)
            else:
                self._sent_grads.append((completion, tensor))
        for (_, _, message), completion in zip(remote_recvs, each[len(remote_sends) :]):
            self._received[message] = completion
        for tensor, frm, to, _ in self._sends:
            if self.rank_of(to) == self.me:
                self._local[(frm, to)].append(tensor)
        for tensor, frm, to, _ in self._recvs:
            if self.rank_of(frm) == self.me:
                tensor.copy_(self._local[(frm, to)].popleft())
        self._sends, self._recvs = [], []

    def wait_for(self, message: Message) -> None:
        """`message` has arrived (a no-op for one from the rank itself); a gradient also completes the activation send
        of its micro-batch."""
        received = self._received.pop(message, None)
        if received is not None:
            received.wait()
        what, sender, micro_batch = message
        if what == "grad":
            sent = self._sent_activations.pop(("activation", sender - 1, micro_batch), None)
            if sent is not None:
                sent[0].wait()

    def complete(self) -> None:
        """Every posted message complete: after the step's last boundary."""
        outstanding = [*self._received.values(), *(c for c, _ in self._sent_activations.values())]
        for completion in outstanding + [c for c, _ in self._sent_grads + self._older_grads]:
            completion.wait()
        self._received, self._sent_activations, self._sent_grads, self._older_grads = {}, {}, [], []


class ChunkLink:
    """Virtual stage `stage`'s end of the rank's boundary batch: the interpreter's Transport, with sends and receives
    noted for the next flush (posted_sends off)."""

    def __init__(self, batch: BoundaryBatch, stage: int):
        self.batch, self.stage = batch, stage

    def send(self, tensor: torch.Tensor, stage: int) -> None:
        self.batch.note_send(tensor, self.stage, stage)

    def recv(self, tensor: torch.Tensor, stage: int) -> None:
        self.batch.note_recv(tensor, stage, self.stage)
