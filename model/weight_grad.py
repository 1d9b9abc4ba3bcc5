"""A Linear layer whose weight gradient can be deferred: Zero Bubble's split of backward into B and W.

Backward of y = x W^T + b needs the output gradient g for three products: the input gradient g W (which the
previous pipeline stage waits for), the bias gradient sum(g) and the weight gradient g^T x (which nobody waits
for). While a `WeightGradStore` defers, the Linear's backward returns the first two at once and pushes (x, g) to
the store; `store.apply_oldest()` later computes the weight gradients of the oldest deferred micro-batch and
hands them to autograd's own AccumulateGrad of each weight (so gradient hooks fire as in any backward, and the
gradients accumulate in micro-batch order). Deferred or not, each product is the same op on the same tensors as
nn.Linear's own backward, so every schedule gives bit-identical gradients.
"""

from collections import deque
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass(frozen=True)
class DeferredWeightGrad:
    """What one Linear's weight gradient needs: its input and its output gradient."""

    weight: nn.Parameter
    x: torch.Tensor
    """(..., in): the layer's input, which autograd kept for backward anyway."""
    grad_output: torch.Tensor
    """(..., out): the gradient of the layer's output, kept from B until W: the store's only new memory."""

    def apply(self) -> None:
        grad = weight_grad(self.x, self.grad_output)  # (out, in)
        torch.autograd.backward(self.weight, grad)  # through the weight's AccumulateGrad, hooks included


def weight_grad(x: torch.Tensor, grad_output: torch.Tensor) -> torch.Tensor:
    """g^T x over every token: (..., in), (..., out) -> (out, in), the product autograd's mm backward forms."""
    return grad_output.reshape(-1, grad_output.shape[-1]).t().mm(x.reshape(-1, x.shape[-1]))


class WeightGradStore:
    """Deferred weight gradients, one list per micro-batch, oldest first.

    `immediate`: weights whose gradient is never deferred. A weight that also gets a gradient from elsewhere
    in the same backward (the tied embedding and LM head on a one-stage pipeline) must stay immediate to be
    bit-exact: autograd sums a leaf's gradients of one backward before accumulating them, and a deferred one
    would be accumulated apart, in another order."""

    def __init__(self, immediate: Iterable[nn.Parameter] = ()):
        self._pending: deque[list[DeferredWeightGrad]] = deque()
        self._immediate = {id(p) for p in immediate}
        self.measure = False
        """Count, while true, what each deferring backward leaves held until its W (`held_bytes`)."""
        self.held_bytes: list[int] = []
        """Per deferring backward while measuring: the bytes of its entries' inputs and output gradients, each
        storage once (after that backward, only the store keeps them alive)."""

    @contextmanager
    def deferring(self) -> Iterator[None]:
        """Every Linear backward run inside defers its weight gradient into one new micro-batch entry."""
        global _active
        if _active is not None:
            raise RuntimeError("a WeightGradStore is already deferring")
        self._pending.append([])
        _active = self
        try:
            yield
        finally:
            _active = None
        if self.measure:
            held = [t for entry in self._pending[-1] for t in (entry.x, entry.grad_output)]
            storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in held}
            self.held_bytes.append(sum(storages.values()))

    def _defers(self, weight: nn.Parameter) -> bool:
        return id(weight) not in self._immediate

    def _push(self, entry: DeferredWeightGrad) -> None:
        self._pending[-1].append(entry)

    def apply_oldest(self) -> int:
        """Accumulate the weight gradients of the oldest deferred micro-batch; returns how many it applied.
        Each entry is applied and dropped in turn, so at most one extra weight gradient is alive at a time."""
        if not self._pending:
            raise RuntimeError("no deferred weight gradients to apply")
        entries = self._pending.popleft()
        count = len(entries)
        while entries:
            entries.pop(0).apply()
        return count

    def __len__(self) -> int:
        """Micro-batches whose weight gradients are still deferred."""
        return len(self._pending)

    def deferred_bytes(self) -> int:
        """Bytes of the output gradients held (the inputs are autograd's, counted where they were saved)."""
        return sum(e.grad_output.numel() * e.grad_output.element_size() for mb in self._pending for e in mb)


_active: WeightGradStore | None = None


class _Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: nn.Parameter, bias: torch.Tensor | None) -> torch.Tensor:
        # Saved through save_for_backward so saved-tensor hooks (the activation meter, output-discarding
        # recompute) see x exactly as they see nn.Linear's saved input. The weight is a parameter: held as is.
        ctx.save_for_backward(x)
        ctx.weight, ctx.has_bias = weight, bias is not None
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        (x,) = ctx.saved_tensors
        weight = ctx.weight
        g = grad_output.reshape(-1, grad_output.shape[-1])  # (N, out)
        grad_x = g.mm(weight).view(x.shape) if ctx.needs_input_grad[0] else None  # (..., in)
        grad_bias = g.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None  # (out,)
        grad_weight = None
        if ctx.needs_input_grad[1]:
            if _active is not None and _active._defers(weight):
                # Detached: under recompute x is the recomputed tensor, whose graph reaches back to the checkpoint's
                # input (an AccumulateGrad holds it, with its .grad); the store would keep that input alive until W.
                _active._push(DeferredWeightGrad(weight, x.detach(), grad_output))
            else:
                grad_weight = weight_grad(x, grad_output)  # (out, in)
        return grad_x, grad_weight, grad_bias


_split = False


@contextmanager
def split_backward(enabled: bool = True) -> Iterator[None]:
    """While enabled, `linear` runs through the Function whose weight gradient a deferring store defers; else
    it is F.linear itself, bit for bit the same values. Why not always the Function: inside torch's
    non-reentrant checkpoint a custom Function's saved input is packed only after its forward ran, so the
    checkpoint's early stop (recompute until the last saved tensor) can no longer skip a segment's last matmul."""
    global _split
    previous, _split = _split, enabled
    try:
        yield
    finally:
        _split = previous


def linear(x: torch.Tensor, weight: nn.Parameter, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear, through the Function a deferring WeightGradStore defers while `split_backward` is on:
    (..., in) -> (..., out)."""
    return _Linear.apply(x, weight, bias) if _split else F.linear(x, weight, bias)


class Linear(nn.Linear):
    """nn.Linear (same parameters, names and initialisation) through `linear`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)
