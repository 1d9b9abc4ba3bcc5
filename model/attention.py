"""The attention core softmax(QK^T / sqrt(d)) V, the part selective recompute redoes."""

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from model.config import GPTConfig
from model.packed_dropout import packed_dropout


class ScaledCausalSoftmax(torch.autograd.Function):
    """The softmax of scaled, causally masked scores, like Megatron's fused softmax.

    The scale and the causal mask are applied by the QK^T matmul itself (`causal_scores`), so no
    extra pass runs over the s x s scores. The softmax runs in fp32 for stability, but only its
    output, in the input dtype, is saved for backward: a 16-bit model keeps 2 bytes per score
    instead of the 4 (+ copies) that an upcast softmax built from separate ops keeps.
    """

    @staticmethod
    def forward(ctx, scores: torch.Tensor) -> torch.Tensor:
        probs = torch.softmax(scores.float(), dim=-1).to(scores.dtype)
        ctx.save_for_backward(probs)
        return probs

    @staticmethod
    def backward(ctx, grad_probs: torch.Tensor):
        (probs,) = ctx.saved_tensors
        # p * (g - sum(g * p)) in fp32, by the kernel torch.softmax's own backward runs: one fused pass over
        # the (T, T) scores instead of four elementwise ones (about 3 % of a CPU step at s=512).
        grad_scores = torch.ops.aten._softmax_backward_data(grad_probs.float(), probs.float(), -1, torch.float32)
        return grad_scores.to(probs.dtype)


class AttentionCore(nn.Module):
    """q (B, nh, T, hs), k, v (B, g, T, hs) -> y (B, nh, T, hs). Holds no parameters. With g < nh KV heads
    (grouped-query attention) each KV head serves nh / g consecutive query heads: SDPA reads them so
    (`enable_gqa`), the explicit ops repeat them first."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.groups = config.n_head // config.kv_heads
        self.kernel = config.attention
        self.dropout = config.dropout
        self.drop = packed_dropout if config.packed_dropout else F.dropout  # SDPA draws its own mask
        self.scale = 1.0 / math.sqrt(config.head_size)
        self._masks: dict[tuple, torch.Tensor] = {}

    def causal_scores(self, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        """scale * QK^T + causal mask (0 on and below the diagonal, -inf above), in one batched matmul
        (baddbmm) instead of a matmul and two more passes over the (T, T) scores."""
        B, nh, T, hs = q.shape
        key = (T, q.dtype, q.device)
        if key not in self._masks:  # built once per shape: (T, T), broadcast over batch and heads
            future = torch.ones(T, T, dtype=torch.bool, device=q.device).triu_(1)
            self._masks[key] = torch.zeros(T, T, dtype=q.dtype, device=q.device).masked_fill_(future, float("-inf"))
        scores = torch.baddbmm(
            self._masks[key], q.reshape(B * nh, T, hs), k.transpose(-2, -1).reshape(B * nh, hs, T), alpha=self.scale
        )
        return scores.view(B, nh, T, T)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q, k, v of the same T positions, each attending to itself and the positions before it."""
        p = self.dropout if self.training else 0.0
        if self.kernel == "sdpa":
            return F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True, enable_gqa=self.groups > 1)
        k, v = self._repeat_kv(k), self._repeat_kv(v)  # (B, nh, T, hs)
        probs = ScaledCausalSoftmax.apply(self.causal_scores(q, k))  # (B, nh, T, T)
        probs = self.drop(probs, p, self.training)
        return probs @ v  # (B, nh, T, hs)

    def attend_cached(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """The queries (B, nh, Tq, hs) of the last Tq of the Tk positions in k, v (B, nh, Tk, hs) -> (B, nh, Tq, hs).
        For decoding, without dropout. Query i sits at position Tk - Tq + i: the causal mask is shifted by
        Tk - Tq, which SDPA's `is_causal` (aligned to the top-left corner) does not do."""
        Tq, Tk = q.shape[2], k.shape[2]
        visible = torch.ones(Tq, Tk, dtype=torch.bool, device=q.device).tril_(Tk - Tq)  # (Tq, Tk)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=visible, enable_gqa=self.groups > 1)

    def _repeat_kv(self, x: torch.Tensor) -> torch.Tensor:
        """(B, g, T, hs) -> (B, nh, T, hs), each KV head repeated for its group of query heads."""
        return x if self.groups == 1 else x.repeat_interleave(self.groups, dim=1)
