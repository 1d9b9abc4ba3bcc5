"""RMSNorm as one autograd function that keeps only its input and an fp32 reciprocal RMS per token.

torch's `F.rms_norm` on CPU runs as separate ops that keep the input, the fp32 upcast, the normalised tensor and
the rstd twice; this one keeps what LayerNorm keeps (the input and one statistic per token), the figure the memory
model (parallel/planning/memory_model.py) counts. Forward computes in fp32 and rounds once, as Hugging Face's
LlamaRMSNorm does: weight * (x / rms(x)).to(x.dtype).
"""

import torch
import torch.nn as nn


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    """fp32 for 16-bit and fp32 inputs; fp64 stays fp64 (gradcheck)."""
    return torch.promote_types(x.dtype, torch.float32)


def _rstd(x: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.to(_compute_dtype(x))
    return torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)  # (..., 1) fp32 (fp64 for fp64 x)


class _RMSNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float, keep_rstd: bool) -> torch.Tensor:
        rstd = _rstd(x, eps)
        ctx.eps = eps
        ctx.save_for_backward(x, weight, *((rstd,) if keep_rstd else ()))
        return weight * (x.to(rstd.dtype) * rstd).to(x.dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight, *kept = ctx.saved_tensors
        rstd = kept[0] if kept else _rstd(x, ctx.eps)  # the same values: made from the same x
        normed = x.to(rstd.dtype) * rstd  # (..., C) fp32, made again
        grad_weight = None
        if ctx.needs_input_grad[1]:
            grad_weight = (grad * normed.to(x.dtype)).reshape(-1, x.shape[-1]).sum(0)
        g = grad.to(rstd.dtype) * weight.to(rstd.dtype)  # d loss / d normed
        # d normed / d x = rstd (I - normed normed^T / C)
        grad_x = rstd * (g - normed * (g * normed).mean(-1, keepdim=True))
        return grad_x.to(x.dtype), grad_weight, None, None


class RMSNorm(nn.Module):
    """(..., C) -> (..., C): x / sqrt(mean(x^2) + eps) times a learned gain (no bias). `keep_rstd` false: backward
    makes the rstd again from the kept input instead of keeping it (selective recompute of Qwen3's q and k norms,
    whose output nothing keeps)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.keep_rstd = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _RMSNormFunction.apply(x, self.weight, self.eps, self.keep_rstd)
