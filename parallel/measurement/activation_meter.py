"""Measured activation memory: the bytes kept for backward per micro-batch, and peak memory per rank.

The meter counts every distinct storage (once, however many tensors view it) that autograd's
saved-tensor hooks see during the forward passes it records, parameters excluded. Inside a
non-reentrant checkpoint the checkpoint's own hooks win and it holds its inputs by reference, so those
never reach an outer hook: parallel/runtime/recompute.py reports each such kept tensor to `observe_stored`, and
the meter counts them too. It is armed for a few steps only (the hooks cost Python calls per op).
"""

import resource
from collections.abc import Callable, Iterable
from contextlib import contextmanager

import torch

from parallel.runtime.recompute import observe_stored


class ActivationMeter:
    def __init__(self, parameters: Callable[[], Iterable[torch.Tensor]]):
        self._parameters = parameters
        """Called at each recording: DeepSpeed's optimizers move parameters into flat buffers."""
        self._excluded: set[int] = set()
        self._current: dict[int, int] | None = None
        self._input_ptr: int | None = None
        self.armed = False
        self.micro_batches: list[dict[int, int]] = []
        """One {storage address: bytes} per recorded forward pass."""
        self.input_ptrs: list[int | None] = []

    def _see(self, t: torch.Tensor) -> None:
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr and ptr not in self._excluded:
            self._current[ptr] = storage.nbytes()

    @contextmanager
    def record(self, stage_input: torch.Tensor | None = None, new: bool = True):
        """Count what is kept for backward inside the block: a new micro-batch, or (new=False, the loss
        on the last stage) more of the last one."""
        if new or self._current is None:
            self._excluded = {p.untyped_storage().data_ptr() for p in self._parameters()}
            self._current = {}
            self.micro_batches.append(self._current)
            self.input_ptrs.append(
                stage_input.untyped_storage().data_ptr() if isinstance(stage_input, torch.Tensor) else None
            )

        def pack(t: torch.Tensor) -> torch.Tensor:
            self._see(t)
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, _unpack), observe_stored(self._see):
            yield

    def bytes_per_micro_batch(self) -> list[int]:
        return [sum(record.values()) for record in self.micro_batches]

    def stage_input_bytes(self) -> list[int]:
        """Bytes of each recorded forward's input storage when it was kept (0 when it was not)."""
        return [record.get(ptr, 0) if ptr else 0 for record, ptr in zip(self.micro_batches, self.input_ptrs)]

    def reset(self) -> None:
        self.micro_batches, self.input_ptrs, self._current = [], [], None


def _unpack(t: torch.Tensor) -> torch.Tensor:
    return t


def attach_to_pipeline(module, meter: ActivationMeter) -> None:
    """Record the pipeline stage's forward passes (and the loss, on the last stage) while `meter` is
    armed. DeepSpeed calls `module(...)` and `module.loss_fn(outputs, labels)`; both are wrapped here,
    as parallel/runtime/recompute.py wraps module forwards."""
    forward, loss_fn = module.forward, module.loss_fn

    def metered_forward(x):
        if not meter.armed:
            return forward(x)
        with meter.record(stage_input=x):
            return forward(x)

    def metered_loss(outputs, labels):
        if not meter.armed or loss_fn is None:
            return loss_fn(outputs, labels)
        with meter.record(new=False):
            return loss_fn(outputs, labels)

    module.forward = metered_forward
    module.loss_fn = metered_loss


def peak_memory_bytes(device: str) -> int:
    """Peak memory of this process: allocated CUDA memory on GPU, resident set size on CPU (which
    includes the interpreter and libraries, a few hundred MB; parallel/measurement/tensor_peak.py measures live
    tensors)."""
    if device == "cuda":
        return int(torch.cuda.max_memory_allocated())
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB
