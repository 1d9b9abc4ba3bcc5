"""Measured peak tensor memory: the most bytes of live tensors this process holds at once over a window
(one training step), as the allocator sees them, the tensors alive when the window opens included.

On CPU the resident set cannot check a predicted peak (the interpreter and libraries add a few hundred
MiB), so the allocator's own events are read instead: inside the window the torch profiler, with
`profile_memory=True`, reports every allocation and free of the CPU allocator (+/- bytes, timestamped).
It cannot report the free of a block allocated before it started (it never learnt the block's size), so:

- the baseline is every distinct tensor storage alive when the window opens, found through the garbage
  collector (every `torch.Tensor` is a tracked object; parameters' gradients are read off the leaves);
- each baseline storage gets a finalizer that marks its free in the profiler's timeline (a
  `record_function` named with the storage's pointer and size): torch keeps a storage's Python object alive
  as long as the storage lives, so the finalizer runs exactly when the memory is released. (The allocator
  does report the free of a block allocated under an earlier profiler session: `_deltas` counts it once.)

The profiler sees the calling thread's allocations only. A free in another thread is missed, and the count
stays that much too high from then on: DeepSpeed's flattened gradient all-reduce buffer, released by a gloo
worker thread at times, after the step's last backward. `unaccounted_bytes` (a second pass at the close)
shows any such miss.

Live bytes after each event are the baseline plus the running sum; the peak is their maximum. On CUDA
the caching allocator reports every free with its size, so the baseline is `memory_allocated()` and no
finalizer is needed (not exercised here: no GPU).

The window costs what the profiler costs (a few us per op) plus two passes over the collector's objects:
measure one step. The C++ allocator prints one warning per 1000 baseline frees ("Memory block of unknown
size was allocated before the profiling started"): those are the frees the finalizers account for.
"""

import gc
import os
import weakref
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch._C._profiler import _EventType  # the profiler's event tree: allocations carry their pointer
from torch._subclasses.fake_tensor import is_fake
from torch.profiler import ProfilerActivity, profile, record_function

FREE_MARK = "stagecheck.baseline_free:"
"""Name prefix of the profiler range a baseline storage's finalizer records; the storage's bytes follow."""


@dataclass(frozen=True)
class TensorPeak:
    """Live tensor bytes of one process over one window (bytes)."""

    baseline_bytes: int
    """Alive when the window opened: parameters, gradients, optimizer state, buffers, anything else."""
    peak_bytes: int
    """The most alive at once inside the window, the baseline included."""
    end_bytes: int
    """Alive when it closed, by the same count (baseline + allocations - frees)."""
    unaccounted_bytes: int | None
    """CPU: live storages found at the close minus `end_bytes`. Zero when every allocation and free inside
    the window was seen; otherwise an allocation the profiler missed (another thread's, or memory torch did
    not allocate, such as a tensor over a numpy array) or a missed free. None on CUDA (not checked)."""
    peak_op: str
    """The innermost profiled op running when the peak was reached (empty: between ops)."""


def live_storages(device: str = "cpu") -> dict[int, torch.UntypedStorage]:
    """Every distinct storage of a strided tensor on `device` that the process holds, by data pointer
    (views and parameters sharing a flat buffer count once), gradients of leaf tensors included."""
    found: dict[int, torch.UntypedStorage] = {}

    def add(t: torch.Tensor) -> None:
        if t.layout is not torch.strided or t.device.type != device or is_fake(t):
            return  # a fake tensor: the compiler's stand-in for a shape (train.compile), holding no memory
        storage = t.untyped_storage()
        if storage.data_ptr():
            found[storage.data_ptr()] = storage

    for obj in gc.get_objects():
        # type() rather than isinstance: isinstance would read `__class__` of every proxy object
        if issubclass(type(obj), torch.Tensor):
            add(obj)
            if obj.is_leaf and obj.requires_grad and obj.grad is not None:
                add(obj.grad)  # a gradient may live in C++ only, with no Python object of its own
    return found


def storages_now() -> list[weakref.ref]:
    """Weak references to every CPU storage alive now: what a later window leaves out as another owner's
    (`TensorPeakMeter(foreign=...)`), without keeping any of it alive."""
    return [weakref.ref(storage) for storage in live_storages().values()]


class TensorPeakMeter:
    def __init__(self, device: str = "cpu", foreign: list[weakref.ref] | None = None):
        """`foreign` (CPU): storages alive before what is measured existed (storages_now), such as tensors an earlier
        test or a library's cache holds in the same process: left out of every figure, so that the window measures
        its own tensors only. None of them may be freed inside the window."""
        if device not in ("cpu", "cuda"):
            raise ValueError(f"no tensor peak measurement for device {device!r}: use cpu or cuda")
        self.device = device
        self._foreign = foreign or []
        self._profiler: profile | None = None
        self._baseline = 0
        self._finalizers: list[weakref.finalize] = []
        self._foreign_ptrs: set[int] = set()

    def start(self) -> None:
        """Open the window: count what is alive and begin recording the allocator's events."""
        # Kineto reads its log level when the first profiler starts: 6, above its USDT level (5), keeps the
        # `USDT: ... profiler_start` and `profiler_stop` lines it prints on every start and stop off stderr.
        os.environ.setdefault("KINETO_LOG_LEVEL", "6")
        if self.device == "cuda":
            self._baseline = torch.cuda.memory_allocated()
            self._profiler = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
            self._profiler.start()
            return
        storages = live_storages()  # strong references: nothing in it can be freed until the finalizers exist
        foreign = {storage.data_ptr() for storage in (ref() for ref in self._foreign) if storage is not None}
        storages = {ptr: storage for ptr, storage in storages.items() if ptr not in foreign}
        self._foreign_ptrs = foreign
        self._baseline = sum(s.nbytes() for s in storages.values())
        self._profiler = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
        self._profiler.start()
        self._finalizers = [weakref.finalize(s, _mark_free, ptr, s.nbytes()) for ptr, s in storages.items()]

    def stop(self) -> TensorPeak:
        """Close the window and return its figures."""
        self._profiler.stop()
        for finalizer in self._finalizers:
            finalizer.detach()
        self._finalizers = []
        tree = self._profiler.profiler.kineto_results.experimental_event_tree()
        self._profiler = None
        live, peak, peak_op = self._baseline, self._baseline, ""
        for _, delta, op in _deltas(_flatten(tree, self.device)):
            live += delta
            if live > peak:
                peak, peak_op = live, op
        unaccounted = None
        if self.device == "cpu":
            own = (s for ptr, s in live_storages().items() if ptr not in self._foreign_ptrs)
            unaccounted = sum(s.nbytes() for s in own) - live
        return TensorPeak(self._baseline, peak, live, unaccounted, peak_op)

    @contextmanager
    def window(self):
        """`with meter.window() as result:` ... then `result[0]` is the TensorPeak."""
        result: list[TensorPeak] = []
        self.start()
        try:
            yield result
        finally:
            result.append(self.stop())


def _mark_free(ptr: int, nbytes: int) -> None:
    with record_function(f"{FREE_MARK}{ptr}:{nbytes}"):
        pass


Event = tuple[int, str, int, int, str]
"""(time in ns, `alloc` or `mark`, data pointer, signed bytes, the innermost op around it)."""


def _flatten(tree, device: str) -> list[Event]:
    """The allocator's events on `device` and the baseline free marks, in time order."""
    out: list[Event] = []

    def walk(events, op: str) -> None:
        for e in events:
            if e.tag == _EventType.Allocation:
                fields = e.extra_fields
                if fields.device.type == device:
                    out.append((e.start_time_ns, "alloc", fields.ptr, fields.alloc_size, op))
            elif e.name.startswith(FREE_MARK):
                ptr, nbytes = e.name[len(FREE_MARK) :].split(":")
                out.append((e.start_time_ns, "mark", int(ptr), -int(nbytes), op))
            else:
                walk(e.children, e.name)

    walk(tree, "")
    return sorted(out, key=lambda event: event[0])  # stable: ties keep the tree's order


def _deltas(events: list[Event]) -> list[tuple[int, int, str]]:
    """(time, bytes added to the live total, op) per event. A block allocated inside the window adds on
    allocation and subtracts on its free. A baseline block subtracts once: at its mark, or at the
    allocator's free when the allocator knew it (it was allocated under an earlier profiler session: the
    allocator remembers sizes across sessions), whichever comes first."""
    allocated: set[int] = set()
    baseline_freed: set[int] = set()
    out = []
    for ns, kind, ptr, nbytes, op in events:
        if kind == "alloc" and nbytes > 0:
            allocated.add(ptr)
        elif kind == "alloc" and ptr in allocated:
            allocated.discard(ptr)
        elif ptr in baseline_freed:
            baseline_freed.discard(ptr)  # the other report of a free already counted
            continue
        else:
            baseline_freed.add(ptr)
        out.append((ns, nbytes, op))
    return out
