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


def virtual_activation_peak(
    program: VirtualProgram, kept: Sequence[int], weights_pending: Sequence[int], message: Sequence[int]
) -> VirtualPeak:
    """Walk the rank's programme. Per micro-batch of its chunk c: `kept[c]` bytes from its forward to its backward
    (B, or the whole backward), `weights_pending[c]` from its B to its W, and `message[c]` for a received input or
    output gradient of the chunk, from its receive to the forward or backward that reads it (counted after each
    instruction, as schedule_walk.activation_peak counts)."""
    chunks = program.chunks
    in_flight, pending = [0] * chunks, [0] * chunks
    held: set[tuple[int, int, str]] = set()  # (chunk, micro-batch, what) of received messages not yet read
    best = VirtualPeak(0, tuple(in_flight), tuple(pending), 0)
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
        elif kind is schedules.BackwardWeight:
            pending[c] -= 1
        else:
            continue
        live = sum(in_flight[k] * kept[k] + pending[k] * weights_pending[k] for k in range(chunks))
        live += sum(message[k] for k, _, _ in held)
        if live > best.bytes:
            best = VirtualPeak(live, tuple(in_flight), tuple(pending), len(held))
    return best
