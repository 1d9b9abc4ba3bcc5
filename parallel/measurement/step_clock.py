"""The clocks of a traced step: a mark at each edge of an instruction, read as seconds after the step.

On CPU an instruction's work is done when its call returns: the host's `perf_counter` is the clock. On CUDA the
host only queues kernels (and posts sends on NCCL's stream); waiting for the device at every edge would time
another, synchronous execution, in which a posted send completes inside its own instruction. There each mark is a
CUDA event recorded on the current stream, and the events are read once the step is over: an event's time is when
the stream reached it, after the kernels queued before it (and after a blocking send or recv the stream waits on).
"""

import time

import torch


class HostClock:
    """perf_counter at each mark (CPU)."""

    def start(self) -> None:
        """Marks after this read from zero."""
        self._zero = time.perf_counter()

    def mark(self) -> float:
        return time.perf_counter()

    def seconds(self, marks: list) -> list[float]:
        """Each mark's seconds since `start`."""
        return [mark - self._zero for mark in marks]


class CudaEventClock:
    """A timing event on the current stream at each mark, read after the step (CUDA)."""

    def start(self) -> None:
        torch.cuda.synchronize()  # outside the step: the device is idle, so the zero event is the host's now
        self._zero = self.mark()

    def mark(self) -> torch.cuda.Event:
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def seconds(self, marks: list) -> list[float]:
        torch.cuda.synchronize()  # after the step: every event has been reached
        return [self._zero.elapsed_time(mark) / 1e3 for mark in marks]


def step_clock(device: str) -> HostClock | CudaEventClock:
    return CudaEventClock() if device == "cuda" else HostClock()
