"""What a rank holds under a schedule with virtual stages, read by walking its programme
(parallel/planning/virtual_schedules.py; pure: no process group), as parallel/planning/schedule_walk.py does for one
chunk per rank."""

from collections.abc import Sequence
from dataclasses import dataclass

from parallel.planning import schedules
from parallel.planning.virtual_schedules import VirtualProgram


@dataclass(frozen=True)
class VirtualPeak:
    """The most activation bytes a rank holds at once over a step, and what is live then."""

    bytes: int
    in_flight: tuple[int, ...]
    """Per chunk: micro-batches forwarded and not yet through their backward (B)."""
    weights_pending: tuple[int, ...]
    """Per chunk: micro-batches through B whose W has not run."""
    messages: int
    """Received activations and gradients held until their forward or backward runs."""
    returning: int = 0
    """Micro-batches through their backward whose input and its gradient wait for SendGrad."""


@dataclass(frozen=True)
class RankMoments:
    """A rank's programme walked once: after each instruction that changes what it holds, per chunk, the
    micro-batches in flight, those whose W is pending, the received messages held and the micro-batches whose input
    gradient waits for its SendGrad. What the rank holds is linear in each chunk's bytes per micro-batch, so its peak
    under any of them is read from these moments (auto per chunk asks for thousands: parallel/planning/virtual_auto.py).

    A chunk holds each micro-batch in flight's output (parallel/runtime/chunk_work.py keeps it for the backward: the
    `output` bytes of `peak`), and after the backward its received input with that input's gradient until SendGrad
    sends the gradient (twice `message`); the input itself, from the forward to the backward, is its first layer's
    kept input (memory_model.stage_activations)."""

    in_flight: tuple[tuple[int, ...], ...]
    pending: tuple[tuple[int, ...], ...]
    messages: tuple[tuple[int, ...], ...]
    returning: tuple[tuple[int, ...], ...]

    @classmethod
    def of(cls, program: VirtualProgram) -> "RankMoments":
        """Per micro-batch of chunk c: in flight from its forward to its backward (B, or the whole backward), W-pending
        from its B to its W, and a received input or output gradient of the chunk held from its receive to the
        forward or backward that reads it (counted after each instruction, as schedule_walk.activation_peak counts)."""
        chunks = program.chunks
        in_flight, pending, returning = [0] * chunks, [0] * chunks, [0] * chunks
        # The first virtual stage's input is token ids, and no SendGrad follows its backwards.
        sends_grads = [program.placement.virtual_stage(program.rank, c) > 0 for c in range(chunks)]
        held: set[tuple[int, int, str]] = set()  # (chunk, micro-batch, what) of received messages not yet read
        moments: list[tuple[tuple[int, ...], ...]] = []
        for command in program.commands():
            kind, c, m = command.kind, command.chunk, command.micro_batch
            if kind is schedules.RecvActivation:
                held.add((c, m, "activation"))
            elif kind is schedules.RecvGrad:
                held.add((c, m, "grad"))
            elif kind is schedules.ForwardPass:
                held.discard((c, m, "activation"))
                in_flight[c] += 1
            elif kind in (schedules.BackwardPass, schedules.BackwardInput):
                held.discard((c, m, "grad"))
                in_flight[c] -= 1
                pending[c] += kind is schedules.BackwardInput
                returning[c] += sends_grads[c]
            elif kind is schedules.BackwardWeight:
                pending[c] -= 1
            elif kind is schedules.SendGrad:
                returning[c] -= 1
            else:
                continue
            messages = tuple(sum(k == chunk for k, _, _ in held) for chunk in range(chunks))
            moments.append((tuple(in_flight), tuple(pending), messages, tuple(returning)))
        return cls(*(tuple(m[i] for m in moments) for i in range(4)))

    def _held(
        self,
        i: int,
        weights_pending: Sequence[int],
        message: Sequence[int],
        output: Sequence[int],
    ) -> int:
        """What moment `i` holds besides the chunks' kept bytes."""
        terms = zip(self.in_flight[i], self.pending[i], self.messages[i], self.returning[i])
        return sum(
            n * o + p * w + h * m + 2 * r * m for (n, p, h, r), w, m, o in zip(terms, weights_pending, message, output)
        )

    def peak(
        self, kept: Sequence[int], weights_pending: Sequence[int], message: Sequence[int], output: Sequence[int]
    ) -> VirtualPeak:
        """The most the rank holds with `kept[c]` bytes per micro-batch of chunk c in flight (and `output[c]`, its
        output), `weights_pending[c]` per W-pending one and `message[c]` per held message."""
        best = VirtualPeak(0, (0,) * len(kept), (0,) * len(kept), 0)
        for i, in_flight in enumerate(self.in_flight):
            live = sum(n * k for n, k in zip(in_flight, kept)) + self._held(i, weights_pending, message, output)
            if live > best.bytes:
                best = VirtualPeak(live, in_flight, self.pending[i], sum(self.messages[i]), sum(self.returning[i]))
        return best

    def linear(
        self, weights_pending: Sequence[int], message: Sequence[int], output: Sequence[int]
    ) -> tuple[tuple[tuple[int, ...], int], ...]:
        """The moments as (micro-batches in flight per chunk, the bytes held besides their kept ones), without those
        another moment holds at least as much as in every term: the peak under any kept bytes per chunk is the
        largest of these rows' sums (`peak`'s bytes, read fast)."""
        rows = {
            (in_flight, self._held(i, weights_pending, message, output)) for i, in_flight in enumerate(self.in_flight)
        }
        return tuple(
            row
            for row in rows
            if not any(
                other != row and other[1] >= row[1] and all(a >= b for a, b in zip(other[0], row[0])) for other in rows
            )
        )


def virtual_activation_peak(
    program: VirtualProgram,
    kept: Sequence[int],
    weights_pending: Sequence[int],
    message: Sequence[int],
    output: Sequence[int],
) -> VirtualPeak:
    """Walk the rank's programme (RankMoments) and read its peak under these bytes per micro-batch."""
    return RankMoments.of(program).peak(kept, weights_pending, message, output)
