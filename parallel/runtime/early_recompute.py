"""Early recompute at run time (Mario, PPoPP'25): a micro-batch's recompute runs as its own pipeline instruction
(RecomputeEarly, parallel/planning/schedules.py) while the stage would otherwise wait for that micro-batch's output
gradient, and its backward then runs on the activations already recomputed.

Torch's non-reentrant checkpoint cannot be run ahead: it keys what it recomputes by the id of the backward
graph task that asks, so a recompute outside backward is never found. Here instead, while a stage's forward
runs under `EarlyRecompute.registering()`, every recompute region of the plan registers itself for that
micro-batch:

- a checkpoint (a full segment, a selective `core_attn` or `mlp`) runs as `_EarlyCheckpoint`, a reentrant-style
  autograd Function: its forward runs without grad and keeps its inputs and the RNG state; the region's
  recompute reruns it with grad from detached inputs into a fresh graph, with the same RNG state (dropout masks
  are redrawn identically); its backward backpropagates through that graph;
- an output-discarding recompute (`mlp_act`, `layernorm`) becomes a `DiscardedOutput` whose recompute remakes
  the producer's deterministic output without grad and holds it until the consumer's backward unpacks it.

`recompute_next()` recomputes the oldest registered micro-batch (micro-batches are recomputed in forward order,
as RecomputeEarly's run in micro-batch order). A region its micro-batch's backward reaches before any early
recompute ran recomputes there, inside backward, as a checkpoint does. Every recompute, early or not, runs inside
the bracket parallel/runtime/recompute.py passes (the trace times it).
"""

from collections import deque
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Protocol

import torch
from torch.autograd.graph import GradientEdge, get_gradient_edge
from torch.utils.checkpoint import get_device_states, set_device_states

Bracket = Callable[[], AbstractContextManager]


class Stash(Protocol):
    """How a segment stores its inputs until its recompute (parallel/runtime/compressed_stash.py's)."""

    def pack(self, t: torch.Tensor) -> object: ...
    def unpack(self, packed: object) -> torch.Tensor: ...


class _RngState:
    """The CPU and device RNG states at a checkpoint's forward, to redraw its dropout masks on recompute."""

    def __init__(self, tensors: tuple[torch.Tensor, ...]):
        self.cpu = torch.get_rng_state()
        self.devices, self.device_states = get_device_states(*tensors)  # CUDA tensors' devices; none on CPU

    @contextmanager
    def restored(self) -> Iterator[None]:
        with torch.random.fork_rng(devices=self.devices):
            torch.set_rng_state(self.cpu)
            set_device_states(self.devices, self.device_states)
            yield


class _Segment:
    """A checkpointed call fn(*inputs): its inputs, RNG state, and once recomputed, its fresh graph."""

    def __init__(self, fn: Callable, inputs: tuple[torch.Tensor, ...], bracket: Bracket, stash: Stash | None = None):
        self.fn, self.bracket, self.stash = fn, bracket, stash
        self.rng = _RngState(inputs)
        self.inputs = tuple(stash.pack(t) for t in inputs) if stash else inputs
        """The inputs, or their compressed copies (recompute.compress)."""
        self.recomputed: tuple[tuple[torch.Tensor, ...], GradientEdge] | None = None
        """The detached inputs and the output's gradient edge: the output tensor itself is dropped, so only
        what its graph saved stays alive until backward."""
        self.kept_bytes = 0
        """Bytes the early recompute made that live until backward (counted only when it measured)."""

    def recompute(self, measure: bool = False) -> None:
        inputs = tuple(self.stash.unpack(p) for p in self.inputs) if self.stash else self.inputs
        detached = tuple(t.detach().requires_grad_(t.requires_grad) for t in inputs)
        kept = _KeptBytes()
        with self.bracket(), kept.counting(measure), self.rng.restored(), torch.enable_grad():
            output = self.fn(*detached)
        self.recomputed, self.kept_bytes = (detached, get_gradient_edge(output)), kept.bytes
        self.inputs = ()

    def backward(self, grad_output: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        if self.recomputed is None:  # nothing ran early: recompute now, inside backward
            self.recompute()
        (detached, output), self.recomputed = self.recomputed, None
        torch.autograd.backward(output, grad_output)  # the segment's weight gradients accumulate here
        return tuple(t.grad if t.requires_grad else None for t in detached)


class _EarlyCheckpoint(torch.autograd.Function):
    @staticmethod
    def forward(ctx, segment: _Segment, *inputs: torch.Tensor) -> torch.Tensor:
        ctx.segment = segment
        with torch.no_grad():
            return segment.fn(*inputs)

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        segment, ctx.segment = ctx.segment, None
        return None, *segment.backward(grad_output)


class DiscardedOutput:
    """A producer's output that a consumer saved, remade from the producer's inputs (no grad: deterministic). Every
    op of the consumer that saved it (`users`: Llama's q, k and v projections share one norm output) takes the one
    remade output; it is dropped when the last has."""

    def __init__(self, producer: Callable[..., torch.Tensor], inputs: tuple[torch.Tensor, ...], bracket: Bracket):
        self.producer, self.inputs, self.bracket = producer, inputs, bracket
        self.output: torch.Tensor | None = None
        self.kept_bytes = 0
        self.users = 0

    def recompute(self, measure: bool = False) -> None:
        with torch.no_grad(), self.bracket():
            self.output = self.producer(*self.inputs)
        self.kept_bytes = self.output.untyped_storage().nbytes()

    def take(self) -> torch.Tensor:
        """The recomputed output, made now if no early recompute ran; the region keeps nothing after its last user's
        take."""
        if self.output is None:
            self.recompute()
        output = self.output
        self.users -= 1
        if self.users <= 0:
            self.output = None
        return output


class _KeptBytes:
    """Distinct storages a recompute saves for backward, seen through saved-tensor hooks while counting;
    parameters and the detached inputs (and views of them) are excluded: both are held anyway. Opt-in: a pack
    hook that returns a tensor its own node outputs makes a reference cycle, left to the garbage collector."""

    def __init__(self):
        self._storages: dict[int, int] = {}

    def see(self, t: torch.Tensor) -> None:
        base = t if t._base is None else t._base
        if base.is_leaf and base.requires_grad:
            return
        storage = t.untyped_storage()
        if storage.data_ptr():
            self._storages[storage.data_ptr()] = storage.nbytes()

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        self.see(t)
        return t

    def counting(self, active: bool) -> AbstractContextManager:
        return torch.autograd.graph.saved_tensors_hooks(self._pack, _identity) if active else nullcontext()

    @property
    def bytes(self) -> int:
        return sum(self._storages.values())


def _identity(t: torch.Tensor) -> torch.Tensor:
    return t


Region = _Segment | DiscardedOutput


class EarlyRecompute:
    """One stage's registered recompute regions, one list per micro-batch whose recompute has not run yet."""

    def __init__(self):
        self._pending: deque[list[Region]] = deque()
        self.measure = False
        """Count, while true, the bytes each early recompute keeps for backward (`recomputed_bytes`)."""
        self.recomputed_bytes: list[int] = []
        """Per `recompute_next()` while measuring: the bytes it made that live until that micro-batch's backward
        (the recomputed regions' saved tensors and outputs)."""

    @contextmanager
    def registering(self) -> Iterator[None]:
        """Around one micro-batch's forward: its recompute regions register for a later `recompute_next()`."""
        global _registry
        if _registry is not None:
            raise RuntimeError("an EarlyRecompute is already registering")
        self._pending.append([])
        _registry = self
        try:
            yield
        finally:
            _registry = None

    def recompute_next(self) -> None:
        """Recompute every region of the oldest registered micro-batch, ahead of its backward."""
        if not self._pending:
            raise RuntimeError("RecomputeEarly with no registered micro-batch")
        regions = self._pending.popleft()
        for region in regions:
            region.recompute(self.measure)
        if self.measure:
            self.recomputed_bytes.append(sum(region.kept_bytes for region in regions))

    def __len__(self) -> int:
        """Micro-batches registered whose recompute has not run yet."""
        return len(self._pending)


_registry: EarlyRecompute | None = None


def registering() -> bool:
    """Whether the forward running now registers its recompute regions. (Not tied to grad mode: the pack hooks
    of output-discarding recompute run while autograd saves a Function's tensors, with grad mode off.)"""
    return _registry is not None


def checkpoint(fn: Callable, *inputs: torch.Tensor, bracket: Bracket, stash: Stash | None = None) -> torch.Tensor:
    """fn(*inputs), keeping only the inputs (compressed by `stash` when given), with its recompute registered for the
    current micro-batch."""
    if not any(t.requires_grad for t in inputs):
        # The Function's output would not require grad: backward would never reach the parameters inside.
        raise RuntimeError("an early-recomputed checkpoint needs an input that requires grad")
    segment = _Segment(fn, inputs, bracket, stash)
    _registry._pending[-1].append(segment)
    return _EarlyCheckpoint.apply(segment, *inputs)


def discarded_output(producer: Callable[..., torch.Tensor], inputs: tuple[torch.Tensor, ...], bracket: Bracket):
    """A DiscardedOutput of producer(*inputs), registered for the current micro-batch."""
    region = DiscardedOutput(producer, inputs, bracket)
    _registry._pending[-1].append(region)
    return region
