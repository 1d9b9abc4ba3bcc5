"""Synthetic source: uniform random tokens, for runs that must not touch storage."""

from __future__ import annotations

import torch

from data.sampling import batch_rng, check_batch_args, split_inputs_labels


class SyntheticTokenSource:
    """Tokens drawn uniformly from [0, vocab_size) by the per-batch generator."""

    # There is no finite corpus behind this source.
    num_tokens: int | None = None

    def __init__(self, vocab_size: int) -> None:
        if vocab_size < 1:
            raise ValueError(f"model.vocab_size={vocab_size} must be >= 1 for synthetic data")
        self.vocab_size = vocab_size

    def batch(
        self, seed: int, step: int, dp_rank: int, micro: int, micro_batch_size: int, seq_len: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        check_batch_args(seed, step, dp_rank, micro, micro_batch_size, seq_len)
        rng = batch_rng(seed, step, dp_rank, micro)
        # One extra column so labels are the inputs shifted by one, as with real text.
        windows = rng.integers(0, self.vocab_size, size=(micro_batch_size, seq_len + 1))
        return split_inputs_labels(windows)  # (B, T), (B, T)

    def __repr__(self) -> str:
        return f"SyntheticTokenSource(vocab_size={self.vocab_size})"
