"""The vocabulary of a programme with virtual stages (parallel/planning/virtual_schedules.py builds them): which
schedules place v model chunks per rank, where each virtual stage lives (`Placement`), one instruction of a rank's
programme (`ChunkCommand`), the programme itself (`VirtualProgram`, one step per lock-step slot), and the slots an
instruction takes when a programme is laid out (`Slots`). Pure: no DeepSpeed, no process group."""

from dataclasses import dataclass

from parallel.planning import schedules

VIRTUAL_SCHEDULES = ("interleaved-1f1b", "zb-v", "v-half")
"""The schedules with virtual stages."""
V_SHAPED = ("zb-v", "v-half")
"""Those with the V placement and V_CHUNKS chunks per rank."""
SPLIT_BACKWARD = ("zb-h1", *V_SHAPED)
"""The schedules whose backward is split into B and W (zero-bubble): W, each Linear's weight gradient, runs later."""
V_CHUNKS = 2
"""A V's chunks per rank (rank r: r and 2p - 1 - r); interleaved 1F1B's fewest."""


@dataclass(frozen=True)
class Placement:
    """Which rank holds which virtual stage: `interleaved` (rank r: r, r + p, ...) or `v` (rank r: r, 2p - 1 - r)."""

    shape: str
    ranks: int
    chunks: int

    def __post_init__(self):
        if self.shape not in ("interleaved", "v"):
            raise ValueError(f"unknown placement {self.shape!r}: expected interleaved or v")
        if self.shape == "v" and self.chunks != V_CHUNKS:
            raise ValueError(f"a V placement has {V_CHUNKS} chunks per rank, got {self.chunks}")
        if self.ranks < 1 or self.chunks < 1:
            raise ValueError(f"ranks and chunks must be >= 1, got {self.ranks} and {self.chunks}")

    @property
    def virtual_stages(self) -> int:
        return self.ranks * self.chunks

    def virtual_stage(self, rank: int, chunk: int) -> int:
        if self.shape == "v" and chunk == 1:
            return 2 * self.ranks - 1 - rank
        return chunk * self.ranks + rank

    def holder(self, virtual_stage: int) -> tuple[int, int]:
        """(rank, its chunk) holding the virtual stage."""
        chunk, rank = divmod(virtual_stage, self.ranks)
        if self.shape == "v" and chunk == 1:
            return self.ranks - 1 - rank, 1
        return rank, chunk


def placement_of(schedule: str, ranks: int, chunks: int) -> Placement:
    return Placement("v" if schedule in V_SHAPED else "interleaved", ranks, chunks)


@dataclass(frozen=True)
class ChunkCommand:
    """One instruction of a rank's programme with virtual stages: parallel/planning/schedules.py's instruction
    `kind`, on the rank's chunk `chunk` (its virtual stage `stage`) for micro-batch `micro_batch`; both None for the
    once-per-step instructions. `peer` is the rank a communication instruction talks to."""

    kind: type[schedules.Command]
    chunk: int | None = None
    stage: int | None = None
    micro_batch: int | None = None
    peer: int | None = None

    @property
    def name(self) -> str:
        return self.kind.__name__

    def message(self) -> tuple[str, int, int]:
        """The message a communication instruction sends or receives, the same key on both sides: (what, the
        sending virtual stage, micro-batch)."""
        if self.kind is schedules.SendActivation:
            return ("activation", self.stage, self.micro_batch)
        if self.kind is schedules.RecvActivation:
            return ("activation", self.stage - 1, self.micro_batch)
        if self.kind is schedules.SendGrad:
            return ("grad", self.stage, self.micro_batch)
        if self.kind is schedules.RecvGrad:
            return ("grad", self.stage + 1, self.micro_batch)
        raise ValueError(f"{self.name} is no communication")


VirtualStep = tuple[ChunkCommand, ...]


@dataclass(frozen=True)
class VirtualProgram:
    """What rank `rank` runs in one training step: `steps[t]` is slot t's computation, then the communication of
    the boundary after it, posted as one batch (`p2p_batches`)."""

    schedule: str
    ranks: int
    chunks: int
    micro_batches: int
    rank: int
    steps: tuple[VirtualStep, ...]

    @property
    def placement(self) -> Placement:
        return placement_of(self.schedule, self.ranks, self.chunks)

    def commands(self) -> list[ChunkCommand]:
        return [command for step in self.steps for command in step]

    def message_read(self, command: ChunkCommand) -> tuple[str, int, int] | None:
        """The message (ChunkCommand.message's key) a computation reads: a forward its input activation, a backward
        (or B) its output's gradient; None for the first virtual stage's forward, the last's backward, and the rest."""
        last = self.placement.virtual_stages - 1
        if command.kind is schedules.ForwardPass and command.stage > 0:
            return ("activation", command.stage - 1, command.micro_batch)
        if command.kind in (schedules.BackwardPass, schedules.BackwardInput) and command.stage < last:
            return ("grad", command.stage + 1, command.micro_batch)
        return None

    def p2p_batches(self) -> list[tuple[ChunkCommand, ...]]:
        """The rank's communication in the order its engine posts it: each step's as one batch."""
        batches = [tuple(c for c in step if c.kind in schedules.COMMUNICATION) for step in self.steps]
        return [batch for batch in batches if batch]


@dataclass(frozen=True)
class Slots:
    """The lock-step slots a forward, a B and a W take when a programme is laid out (a whole backward: B's and W's).
    The papers' unit costs by default; measured prices give a run its own ratio (parallel/planning/virtual_slots.py),
    which decides the V shapes' greedy order."""

    forward: int = 1
    backward_input: int = 1
    backward_weight: int = 1

    def __post_init__(self):
        if min(self.forward, self.backward_input, self.backward_weight) < 1:
            raise ValueError(f"every op takes at least one slot, got {self}")

    def of(self, kind: type[schedules.Command]) -> int:
        """The slots an op of `kind` takes."""
        if kind is schedules.ForwardPass:
            return self.forward
        if kind is schedules.BackwardInput:
            return self.backward_input
        if kind is schedules.BackwardWeight:
            return self.backward_weight
        if kind is schedules.BackwardPass:
            return self.backward_input + self.backward_weight
        raise ValueError(f"{kind.__name__} takes no slot")

    def text(self) -> str:
        return f"{self.forward}:{self.backward_input}:{self.backward_weight}"


UNIT_SLOTS = Slots()
