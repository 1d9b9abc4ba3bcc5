"""A segment input stored in fewer bits until its recompute (`recompute.compress`; the formats and their bytes:
parallel/planning/compression.py). `CompressedStash.hooks()` around a torch checkpoint compresses the inputs the
checkpoint saves; an early-recomputed segment packs and unpacks its inputs itself."""

from collections.abc import Callable

import torch

FP8 = torch.float8_e4m3fn
SCALED = {"fp8": (FP8, torch.finfo(FP8).max), "int8": (torch.int8, 127.0)}
"""A format stored with one fp32 scale per row: its dtype, and the value a row's largest magnitude maps to."""


class Packed:
    """A compressed tensor: its stored parts and what decompresses them."""

    def __init__(self, parts: tuple[torch.Tensor, ...], dtype: torch.dtype, requires_grad: bool):
        self.parts, self.dtype, self.requires_grad = parts, dtype, requires_grad


class CompressedStash:
    """Packs floating tensors as `compress` says (`bf16`, `fp8` or `int8`), reporting each stored part to `note`."""

    def __init__(self, compress: str, note: Callable[..., None]):
        self.compress, self.note = compress, note

    def pack(self, t: torch.Tensor) -> Packed:
        if not t.is_floating_point():
            raise ValueError(
                f"recompute.compress={self.compress} cannot store a segment input of dtype {t.dtype}: only floating "
                f"point inputs compress; use recompute.compress=none"
            )
        x = t.detach()
        if self.compress == "bf16":
            parts = (x.to(torch.bfloat16),)
        else:
            # one scale per row (token): its largest magnitude maps to the format's largest value
            dtype, largest = SCALED[self.compress]
            scale = x.abs().amax(dim=-1, keepdim=True).float().clamp(min=torch.finfo(torch.float32).tiny) / largest
            scaled = x.float() / scale
            if dtype == torch.int8:  # a cast would truncate toward zero: round to the nearest step
                scaled = scaled.round()
            parts = (scaled.to(dtype), scale)  # (b, s, h) fp8 or int8, (b, s, 1) fp32
        self.note(*parts)
        return Packed(parts, t.dtype, t.requires_grad)

    def unpack(self, packed: Packed) -> torch.Tensor:
        if self.compress == "bf16":
            x = packed.parts[0].to(packed.dtype)
        else:
            stored, scale = packed.parts
            x = (stored.float() * scale).to(packed.dtype)
        return x.requires_grad_(packed.requires_grad)

    def hooks(self):
        """Saved-tensor hooks that store what a torch checkpoint saves of its inputs compressed."""
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)
