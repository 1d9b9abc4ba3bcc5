"""Dropout whose mask is kept for backward as bits, 8 per byte (model.packed_dropout), in plain torch ops.

torch's dropout keeps a mask element per value: on CPU the noise tensor it multiplies by, in the input dtype (4 bytes
in fp32); on CUDA a byte. The mask is one bit of information, so the bits are what is kept here.

The values are torch's own on CPU, bit for bit: aten's CPU dropout (`_dropout_impl` in Dropout.cpp) draws
`noise = empty_like(x).bernoulli_(1 - p)`, scales it in place by `div_(1 - p)` and returns `x * noise`, whose backward
is `grad * noise`. This forward runs those same ops (the same draws from the same generator, hence the same masks,
and non-reentrant checkpoints replay them) and backward rebuilds the same `noise` from the bits. On CUDA, torch's
dropout is the fused `native_dropout` kernel, which consumes the Philox stream differently: there the packed masks
are drawn by `bernoulli_` instead, so they differ from unpacked dropout's (but every recompute mode still replays
them exactly).
"""

import torch
import torch.nn as nn


def pack_bits(mask: torch.Tensor) -> torch.Tensor:
    """A bool tensor -> uint8 (ceil(numel / 8),): element i is bit i % 8 of byte i // 8.

    Each 8 mask bytes (0 or 1) are read as one int64 b0 + b1 2^8 + ... + b7 2^56 (little-endian), and three
    shift-ors move bit 8i to bit i: 7 ops over numel / 8 integers instead of 8 shifts and a sum over numel bytes."""
    flat = mask.reshape(-1).view(torch.uint8)
    if flat.numel() % 8:
        flat = torch.nn.functional.pad(flat, (0, -flat.numel() % 8))
    x = flat.view(torch.int64)  # (numel / 8,)
    x = x | (x >> 7)
    x = x | (x >> 14)
    x = x | (x >> 28)
    return (x & 0xFF).to(torch.uint8)


def unpack_bits(packed: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """pack_bits' inverse: uint8 (ceil(numel / 8),) -> a bool tensor of `shape`."""
    return unpack_bytes(packed, shape).view(torch.bool)


def unpack_bytes(packed: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """pack_bits' inverse as bytes: uint8 (ceil(numel / 8),) -> uint8 0 or 1 of `shape` (the shift-ors run
    backwards)."""
    x = packed.to(torch.int64)
    x = (x | (x << 28)) & 0x0000000F0000000F
    x = (x | (x << 14)) & 0x0003000300030003
    x = (x | (x << 7)) & 0x0101010101010101
    return x.view(torch.uint8)[: shape.numel()].view(shape)


class PackedDropoutFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, p: float) -> torch.Tensor:
        noise = torch.empty_like(x).bernoulli_(1 - p)
        ctx.shape = x.shape
        # The kept elements' value of noise.div_(1 - p), by the same kernel: backward rebuilds noise from it.
        ctx.scale = torch.ones(1, dtype=x.dtype, device=x.device).div_(1 - p)
        ctx.save_for_backward(pack_bits(noise != 0))
        return x * noise.div_(1 - p)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (packed,) = ctx.saved_tensors
        # From bytes, not bools: inductor's CPU code for a bool -> float conversion does not compile (torch 2.13,
        # train.compile), and 0 and 1 convert to the same values.
        noise = unpack_bytes(packed, ctx.shape).to(grad.dtype).mul_(ctx.scale)  # torch's noise: 1 / (1 - p) or 0
        return grad * noise, None


def packed_dropout(x: torch.Tensor, p: float, training: bool) -> torch.Tensor:
    """F.dropout(x, p, training) with the mask kept as bits."""
    if not training or p == 0:
        return x
    return PackedDropoutFunction.apply(x, p)


class PackedDropout(nn.Dropout):
    """nn.Dropout with the mask kept as bits."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return packed_dropout(x, self.p, self.training)


def dropout_layer(p: float, packed: bool) -> nn.Dropout:
    """The model's dropout module: torch's, or with `packed` (model.packed_dropout) the bit-packed one."""
    return PackedDropout(p) if packed else nn.Dropout(p)
