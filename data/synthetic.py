"""Synthetic source: uniform random tokens, for runs that must not touch storage."""

from __future__ import annotations

import numpy as np
import torch

from data.sampling import batch_rng, check_batch_args, check_val_args, split_inputs_labels, val_rng


class SyntheticTokenSource:
    """Tokens drawn uniformly from [0, vocab_size) by the per-batch generator."""

    # There is no finite corpus behind this source.
    num_tokens: int | None = None
    # Validation batches come from a seed stream of their own (data/sampling.py val_rng).
    has_val = True

    def __init__(self, vocab_size: int) -> None:
        if vocab_size < 1:
            raise ValueError(f"model.vocab_size={vocab_size} must be >= 1 for synthetic data")
        self.vocab_size = vocab_size

    def batch(
        self, seed: int, step: int, dp_rank: int, micro: int, micro_batch_size: int, seq_len: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        check_batch_args(seed, step, dp_rank, micro, micro_batch_size, seq_len)
        return self._draw(batch_rng(seed, step, dp_rank, micro), micro_batch_size, seq_len)

    def val_batch(
        self, seed: int, index: int, micro_batch_size: int, seq_len: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        check_val_args(seed, index, micro_batch_size, seq_len)
        return self._draw(val_rng(seed, index), micro_batch_size, seq_len)

    def _draw(self, rng: np.random.Generator, micro_batch_size: int, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        # One extra column so labels are the inputs shifted by one, as with real text.
        windows = rng.integers(0, self.vocab_size, size=(micro_batch_size, seq_len + 1))  # (B, T+1)
        return split_inputs_labels(windows)  # (B, T), (B, T)

    def __repr__(self) -> str:
        return f"SyntheticTokenSource(vocab_size={self.vocab_size})"
