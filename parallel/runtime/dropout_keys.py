"""Dropout keyed by layer and micro-batch: the random state a layer's training forward starts from is a function of
(run seed, data-parallel replica, optimizer step, micro-batch, layer) alone, never of the order forwards run in.

A stage draws its masks from its device's default generator. Drawn in the order its forwards run, the masks of a
layer would depend on the schedule (a rank of a virtual-stage schedule runs other layers in another order than a
1F1B stage) and on the placement (which layers share a rank's stream). So the interpreter of a stage's programme
(parallel/runtime/stage_interpreter.py) opens `keyed_forward` around each training forward with its micro-batch's
key, and `run_stage` (parallel/runtime/recompute.py) seeds the generator with each layer's key as that layer starts:
every schedule, placement and recompute mode draws the same masks. A checkpoint's recompute draws them again: the
seeding is part of the checkpointed function (a segment of several blocks re-seeds each block), and torch's
checkpoint and early recompute restore the state at the segment's start besides.

The CPU generator (mt19937) takes the low 32 bits of a seed; CUDA's (Philox) all 64.
"""

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial

import torch

from model import LayerFn

_BITS_64 = (1 << 64) - 1


def _mix(*parts: int) -> int:
    """splitmix64 folded over `parts`: keys that differ in one part give unrelated 63-bit seeds."""
    h = 0
    for part in parts:
        h = (h ^ (part & _BITS_64)) + 0x9E3779B97F4A7C15 & _BITS_64
        h = (h ^ (h >> 30)) * 0xBF58476D1CE4E5B9 & _BITS_64
        h = (h ^ (h >> 27)) * 0x94D049BB133111EB & _BITS_64
        h ^= h >> 31
    return h >> 1  # torch.manual_seed's range without the sign question


@dataclass(frozen=True)
class DropoutKeys:
    """The dropout stream of one data-parallel replica of a run."""

    seed: int = 0
    """The run's seed (run.seed; the layout's: parallel/planning/layout.py)."""
    replica: int = 0
    """The data-parallel rank: replicas train on other micro-batches, so they draw other masks."""

    def micro_batch(self, step: int, micro_batch: int) -> int:
        """The key of micro-batch `micro_batch` of the training step after `step` optimizer steps."""
        return _mix(self.seed, self.replica, step, micro_batch)


_forward_key: int | None = None
"""The key of the micro-batch whose training forward runs now (None: none is keyed)."""


@contextmanager
def keyed_forward(key: int) -> Iterator[None]:
    """Around one micro-batch's training forward on a stage: its layers draw from keyed states (`keyed_layers`)."""
    global _forward_key
    previous, _forward_key = _forward_key, key
    try:
        yield
    finally:
        _forward_key = previous


def keyed_layers(funcs: Sequence[LayerFn], first_layer: int) -> Sequence[LayerFn]:
    """A stage's layers (flat indices from `first_layer` on), each seeding its input's generator with the layer's key
    first while a forward is keyed; `funcs` themselves otherwise (an evaluation, or a caller's own stream)."""
    if _forward_key is None:
        return funcs
    return [partial(_seeded, fn, _mix(_forward_key, first_layer + i)) for i, fn in enumerate(funcs)]


def _seeded(fn: Callable[[torch.Tensor], torch.Tensor], key: int, x: torch.Tensor) -> torch.Tensor:
    # Only the generator this layer draws from: torch.manual_seed would seed every CUDA device besides.
    if x.device.type == "cpu":
        torch.default_generator.manual_seed(key)
    else:
        torch.get_device_module(x.device.type).default_generators[x.device.index].manual_seed(key)
    return fn(x)
