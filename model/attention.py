"""The attention core softmax(QK^T / sqrt(d)) V, the part selective recompute redoes."""
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from model.config import GPTConfig


class ScaledCausalSoftmax(torch.autograd.Function):
    """scale, causal mask and softmax in one op, like Megatron's fused softmax.

    The softmax runs in fp32 for stability, but only its output, in the input dtype, is saved
    for backward: a 16-bit model keeps 2 bytes per score instead of the 4 (+ copies) that an
    upcast softmax built from separate ops keeps.
    """

    @staticmethod
    def forward(ctx, scores: torch.Tensor, scale: float) -> torch.Tensor:
        t_q, t_k = scores.shape[-2:]
        # Recomputed rather than saved: a bool mask would cost s*s bytes per layer.
        future = torch.ones(t_q, t_k, dtype=torch.bool, device=scores.device).triu_(1)
        logits = (scores.float() * scale).masked_fill_(future, float("-inf"))
        probs = torch.softmax(logits, dim=-1).to(scores.dtype)
        ctx.save_for_backward(probs)
        ctx.scale = scale
        return probs

    @staticmethod
    def backward(ctx, grad_probs: torch.Tensor):
        (probs,) = ctx.saved_tensors
        p = probs.float()
        g = grad_probs.float()
        grad_logits = p * (g - (g * p).sum(dim=-1, keepdim=True))
        return (grad_logits * ctx.scale).to(probs.dtype), None


class AttentionCore(nn.Module):
    """q, k, v (B, nh, T, hs) -> y (B, nh, T, hs). Holds no parameters."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.kernel = config.attention
        self.dropout = config.dropout
        self.scale = 1.0 / math.sqrt(config.head_size)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        p = self.dropout if self.training else 0.0
        if self.kernel == "sdpa":
            return F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
        scores = q @ k.transpose(-2, -1)  # (B, nh, T, T)
        probs = ScaledCausalSoftmax.apply(scores, self.scale)
        probs = F.dropout(probs, p=p, training=self.training)
        return probs @ v  # (B, nh, T, hs)
