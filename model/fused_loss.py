"""The LM head and its cross-entropy fused and chunked: the logits never exist whole.

The unfused path (model/gpt.py's `lm_loss` of `lm_head`'s logits) keeps the (B, T, V) logits, their fp32 copy and
the fp32 log-probabilities; at V = 50257 these dwarf the blocks of the last stage. Here the loss of the final hidden
states is computed `chunk_tokens` tokens at a time: each chunk's logits are made, reduced to a per-token
log-sum-exp and dropped. Backward makes each chunk's logits again (one more forward matmul of the head) and turns
them into the chunk's gradients at once. Only the hidden states, the labels and one fp32 log-sum-exp per token stay
stored.

Why recompute and not Liger-Kernel's fused linear cross-entropy, which computes the gradients during forward and
keeps them: its stored gradients are the hidden states' (N, C) *and the tied weight's (V, C) in fp32*, per micro-batch
(2.5 GB at GPT-3's width), where recompute keeps (N, C) plus 4 bytes a token; and a gradient computed in forward
cannot be deferred by a zero-bubble schedule. The price is 2 N C V FLOPs more per micro-batch (the head's forward
once again), against which stand the passes over (N, V) fp32 tensors and the fresh pages the unfused path makes:
bench/memory_floor_bench.py measures the balance (docs/memory_floor.md).

Labels must all be token ids: there is no ignore index (the data never pads).
"""

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from model.gpt import LayerRecipe, head_returns_logits, lm_loss
from model.layers import head_logits


class ChunkedLinearCrossEntropy(torch.autograd.Function):
    """mean over tokens of cross_entropy(head_logits(hidden, weight), labels), chunk by chunk."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, chunk_tokens: int):
        x = hidden.reshape(-1, hidden.shape[-1])  # (N, C)
        y = labels.reshape(-1)  # (N,)
        lse = torch.empty(x.shape[0], dtype=torch.float32, device=x.device)  # (N,)
        total = torch.zeros((), dtype=torch.float32, device=x.device)
        for start in range(0, x.shape[0], chunk_tokens):
            stop = min(start + chunk_tokens, x.shape[0])
            logits = head_logits(x[start:stop], weight).float()  # (k, V)
            torch.logsumexp(logits, dim=-1, out=lse[start:stop])
            total += lse[start:stop].sum() - logits.gather(1, y[start:stop, None]).sum()
        ctx.chunk_tokens = chunk_tokens
        ctx.save_for_backward(hidden, weight, labels, lse)
        return total / x.shape[0]

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        hidden, weight, labels, lse = ctx.saved_tensors
        x = hidden.reshape(-1, hidden.shape[-1])  # (N, C)
        y = labels.reshape(-1)  # (N,)
        # d loss / d logits = (softmax - onehot) * grad_loss / N; the scale is applied to the (k, C) and (V, C)
        # products rather than to the (k, V) chunk, one pass fewer over the largest tensor.
        scale = grad_loss.float() / x.shape[0]
        grad_x = torch.empty_like(x)  # (N, C)
        # The weight's gradient sums the chunks' products in fp32 (as one unchunked matmul would inside), in place
        # when the weight is fp32.
        wants_w = ctx.needs_input_grad[1]
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if wants_w else None
        for start in range(0, x.shape[0], ctx.chunk_tokens):
            stop = min(start + ctx.chunk_tokens, x.shape[0])
            logits = head_logits(x[start:stop], weight).float()  # (k, V), made again
            probs = logits.sub_(lse[start:stop, None]).exp_()  # softmax, in place
            probs.scatter_add_(1, y[start:stop, None], torch.full((stop - start, 1), -1.0, device=probs.device))
            grad_logits = probs.to(x.dtype)  # (k, V)
            torch.mm(grad_logits, weight, out=grad_x[start:stop])
            if grad_w is not None and grad_logits.dtype == torch.float32:
                torch.addmm(grad_w, grad_logits.t(), x[start:stop], out=grad_w)  # FlopCounterMode misses addmm_
            elif grad_w is not None:
                grad_w += (grad_logits.t() @ x[start:stop]).float()
        grad_x = grad_x.mul_(scale.to(x.dtype)).view_as(hidden)
        return grad_x, None if grad_w is None else grad_w.mul_(scale).to(weight.dtype), None, None


def chunked_lm_loss(
    hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, chunk_tokens: int
) -> torch.Tensor:
    """Mean next-token cross-entropy of the final hidden states (B, T, C) against labels (B, T) through the LM
    head's weight (V, C), `chunk_tokens` tokens at a time: equal to lm_loss(head_logits(hidden, weight), labels) to fp32
    rounding."""
    return ChunkedLinearCrossEntropy.apply(hidden, weight, labels, chunk_tokens)


@dataclass(frozen=True)
class HeadLoss:
    """The training loss of what the flat sequence's LM head returns: logits (chunk_tokens 0) or the final hidden
    states (model.loss_chunk_tokens), given the LM head's weight (tied or not) the last stage holds."""

    chunk_tokens: int

    @classmethod
    def of(cls, recipes: Sequence[LayerRecipe]) -> "HeadLoss":
        """The loss of the flat sequence `recipes` (gpt_layers) ends in: its LM head's recipe carries the config."""
        head = recipes[-1]
        return cls(0 if head_returns_logits(head) else head.args[0].loss_chunk_tokens)

    def __call__(self, outputs: torch.Tensor, labels: torch.Tensor, head_weight: torch.Tensor) -> torch.Tensor:
        if self.chunk_tokens == 0:
            return lm_loss(outputs, labels)
        return chunked_lm_loss(outputs, head_weight, labels, self.chunk_tokens)
