"""What a rank holds under a schedule with virtual stages, read by walking its programme
(parallel/planning/virtual_schedules.py; pure: no process group), as parallel/planning/schedule_walk.py does for one
chunk per rank."""

import functools
from collections.abc import Sequence
from dataclasses import dataclass

from parallel.planning import schedules
from parallel.planning.virtual_program import VirtualProgram


@dataclass(frozen=True)
class VirtualPeak:
    """The most activation bytes a rank holds at once over a step, and what is live then."""

    bytes: int
    in_flight: tuple[int, ...]
    """Per chunk: micro-batches forwarded and not yet through their backward (B)."""
    weights_pending: tuple[int, ...]
    """Per chunk: micro-batches through B whose W has not run."""
    messages: int
    """Received activations and gradients held until their forward or backward runs, and sent input gradients held
    until their send completes."""
    returning: int = 0
    """Micro-batches through their backward whose input and its gradient wait for SendGrad."""
    working_set: int = 0
    """Of `bytes`, the transient of the backward (B) or W running at the peak (0 when the peak is between
    instructions)."""
    running: tuple[int, int, str] | None = None
    """(chunk, micro-batch, "B" or "W") of the instruction running at the peak; None between instructions."""


@dataclass(frozen=True)
class ChunkBytes:
    """What one chunk of a rank holds under its plan, whatever the schedule."""

    kept: tuple[int, ...]
    """Per micro-batch: kept from its forward to its backward (B), its plan's or, under per-micro-batch recompute,
    `none`'s for the micro-batches that run without (StagePlan.recomputes_micro_batch)."""
    working: tuple[int, ...]
    """Per micro-batch: what its backward allocates on top while it runs (working_set.backward_working_sets)."""
    weights_pending: int
    """Per micro-batch through B whose W has not run: what its W's need."""
    weight_working: int
    """What a W allocates on top while it runs (weight_grad_bytes.weight_grad_transient_bytes)."""
    message: int
    """One received activation or gradient."""
    output: int
    """Its output, held from its forward to its backward (0 on the last virtual stage)."""


@dataclass(frozen=True)
class RankMoments:
    """A rank's programme walked once: after each instruction that changes what it holds, and inside each backward
    and W before it frees anything, per chunk, the micro-batches in flight, those whose W is pending, the received
    messages held and the micro-batches whose input gradient waits for its SendGrad.

    A chunk holds each micro-batch in flight's output (parallel/runtime/chunk_work.py keeps it for the backward), and
    after the backward its received input with that input's gradient until SendGrad (twice `message`), then the
    gradient alone until its send completes (counted among the messages held); the input itself, from the forward to
    the backward, is its first layer's kept input (memory_model.stage_activations). What the rank holds is linear in
    each chunk's bytes per micro-batch, so auto per chunk (parallel/planning/virtual_auto.py), which asks thousands of
    times, reads its peak from `linear`'s rows."""

    live: tuple[tuple[frozenset[int], ...], ...]
    """Per moment, per chunk: the micro-batches in flight."""
    pending: tuple[tuple[int, ...], ...]
    messages: tuple[tuple[int, ...], ...]
    returning: tuple[tuple[int, ...], ...]
    running: tuple[tuple[int, int, str] | None, ...]
    """Per moment: (chunk, micro-batch, "B" or "W") of the instruction it is inside, None between instructions."""

    @functools.cached_property
    def in_flight(self) -> tuple[tuple[int, ...], ...]:
        """Per moment, per chunk: how many micro-batches are in flight."""
        return tuple(tuple(len(ms) for ms in live) for live in self.live)

    @classmethod
    def of(cls, program: VirtualProgram) -> "RankMoments":
        """Per micro-batch of chunk c: in flight from its forward to its backward (B, or the whole backward), W-pending
        from its B to its W, a received input or output gradient of the chunk held from its receive to the forward or
        backward that reads it, and the input gradient it sends to another rank held from its backward until the second
        boundary after its SendGrad's is posted (parallel/runtime/boundary_links.py waits for a boundary's gradient
        sends there) or the once-per-step instructions begin (counted after each instruction and post, and inside each
        backward before it frees its micro-batch, as schedule_walk.activation_peak counts)."""
        chunks = program.chunks
        live: list[set[int]] = [set() for _ in range(chunks)]
        pending, returning = [0] * chunks, [0] * chunks
        # The first virtual stage's input is token ids, and no SendGrad follows its backwards.
        sends_grads = [program.placement.virtual_stage(program.rank, c) > 0 for c in range(chunks)]
        held: set[tuple[int, int, str]] = set()  # (chunk, micro-batch, what) of received messages not yet read
        moments: list[tuple] = []

        # Chunks whose input gradient is sent, one entry per message: this step's SendGrads, those the last posted
        # boundary sent, and the boundary's before (waited for at the next post, or all before the once-per-step
        # instructions).
        sending: list[int] = []
        sent: list[int] = []
        older: list[int] = []

        def moment(running: tuple[int, int, str] | None = None) -> None:
            in_transit = sending + sent + older
            messages = tuple(sum(k == chunk for k, _, _ in held) + in_transit.count(chunk) for chunk in range(chunks))
            moments.append((tuple(map(frozenset, live)), tuple(pending), messages, tuple(returning), running))

        for step in program.steps:
            for command in step:
                kind, c, m = command.kind, command.chunk, command.micro_batch
                if kind is schedules.RecvActivation:
                    held.add((c, m, "activation"))
                elif kind is schedules.RecvGrad:
                    held.add((c, m, "grad"))
                elif kind is schedules.ForwardPass:
                    held.discard((c, m, "activation"))
                    live[c].add(m)
                elif kind in (schedules.BackwardPass, schedules.BackwardInput):
                    moment(running=(c, m, "B"))
                    held.discard((c, m, "grad"))
                    live[c].discard(m)
                    pending[c] += kind is schedules.BackwardInput
                    returning[c] += sends_grads[c]
                elif kind is schedules.BackwardWeight:
                    moment(running=(c, m, "W"))
                    pending[c] -= 1
                elif kind is schedules.SendGrad:  # the input is dropped; its gradient stays until its send completes
                    returning[c] -= 1
                    if command.peer != program.rank:  # to the rank's own chunk (the V's turn): copied at the post
                        sending.append(c)
                elif m is None and (sending or sent or older):  # every message completes before the once-per-step ones
                    sending.clear()
                    sent.clear()
                    older.clear()
                else:
                    continue
                moment()
            if any(command.kind in schedules.COMMUNICATION for command in step):  # the post waits for `older`
                older[:] = sent
                sent[:] = sending
                sending.clear()
                moment()
        return cls(*(tuple(m[i] for m in moments) for i in range(5)))

    def _held(self, i: int, chunks: Sequence[ChunkBytes]) -> int:
        """What moment `i` holds besides the chunks' kept bytes and the working set."""
        terms = zip(self.in_flight[i], self.pending[i], self.messages[i], self.returning[i], chunks)
        return sum(n * b.output + p * b.weights_pending + (h + 2 * r) * b.message for n, p, h, r, b in terms)

    def peak(self, chunks: Sequence[ChunkBytes]) -> VirtualPeak:
        """The most the rank holds, `chunks[c]` being what chunk c holds."""
        best = VirtualPeak(0, (0,) * len(chunks), (0,) * len(chunks), 0)
        for i, live in enumerate(self.live):
            kept = sum(sum(b.kept[m] for m in ms) for ms, b in zip(live, chunks))
            running = self.running[i]
            working = 0
            if running is not None:
                chunk = chunks[running[0]]
                working = chunk.working[running[1]] if running[2] == "B" else chunk.weight_working
            total = kept + working + self._held(i, chunks)
            if total > best.bytes:
                held = sum(self.messages[i]), sum(self.returning[i])
                best = VirtualPeak(total, self.in_flight[i], self.pending[i], *held, working, running)
        return best

    @functools.cached_property
    def most_in_flight(self) -> tuple[int, ...]:
        """Per chunk: the most micro-batches it holds in flight at once (its `in_flight` for per-micro-batch
        recompute: a chunk runs its forwards, and its backwards, in micro-batch order, so those it holds are always
        consecutive, as StagePlan.recomputes_micro_batch's rule needs)."""
        return tuple(max(counts) for counts in zip(*self.in_flight))

    def linear(
        self, chunks: Sequence[ChunkBytes], some: bool = False
    ) -> tuple[tuple[tuple[tuple[int, ...], ...], int], ...]:
        """The moments between instructions as (per chunk: how many of its micro-batches in flight it recomputes,
        and the bytes held besides their kept ones), `chunks` giving every term but the kept bytes, without those
        another moment holds at least as much as in every term: the peak without working sets under any kept bytes
        per chunk is the largest of these rows' sums. Per chunk, the counts are (in flight,); with `some`, how many
        of them a plan for k of its P = `most_in_flight` recomputes, for k = 0 .. P (the last: all of them)."""
        between = [i for i, running in enumerate(self.running) if running is None]
        rows = {
            (self._recomputed(i) if some else tuple((n,) for n in self.in_flight[i]), self._held(i, chunks))
            for i in between
        }
        # a chunk's term grows with both how many it recomputes and how many it does not: compare both
        flat = {row: (*(n for counts in row[0] for k in counts for n in (k, counts[-1] - k)), row[1]) for row in rows}
        return tuple(
            row
            for row in rows
            if not any(other != row and all(a >= b for a, b in zip(flat[other], flat[row])) for other in rows)
        )

    def _recomputed(self, i: int) -> tuple[tuple[int, ...], ...]:
        """Per chunk, for k = 0 .. P: how many of the micro-batches it holds at moment `i` a plan for k of P recomputes
        (StagePlan.recomputes_micro_batch: index mod P >= P - k)."""
        return tuple(
            tuple(sum(m % most >= most - k for m in live) for k in range(most + 1))
            for live, most in zip(self.live[i], self.most_in_flight)
        )
