"""Deterministic batch sampling shared by all token sources.

Every batch is a pure function of (seed, step, dp_rank, micro): no state carries between
calls, so the data does not depend on how many processes exist, on what was sampled before,
or on which pipeline stage asks (the first stage needs the inputs, the last the labels).
"""

from __future__ import annotations

import numpy as np
import torch


def check_batch_args(seed: int, step: int, dp_rank: int, micro: int, micro_batch_size: int, seq_len: int) -> None:
    # numpy's SeedSequence rejects negative entries with a message that names none of these.
    for label, value in (("seed", seed), ("step", step), ("dp_rank", dp_rank), ("micro", micro)):
        if value < 0:
            raise ValueError(f"batch(): {label}={value} must be >= 0")
    if micro_batch_size < 1:
        raise ValueError(f"batch(): micro_batch_size={micro_batch_size} must be >= 1")
    if seq_len < 1:
        raise ValueError(f"batch(): seq_len={seq_len} must be >= 1")


def batch_rng(seed: int, step: int, dp_rank: int, micro: int) -> np.random.Generator:
    """A generator seeded by the batch coordinates alone."""
    return np.random.default_rng([seed, step, dp_rank, micro])


def split_inputs_labels(windows: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """Turn (B, T+1) token windows into next-token (inputs, labels), each int64 (B, T)."""
    windows = windows.astype(np.int64, copy=False)  # (B, T+1)
    # Separate contiguous copies: DeepSpeed's pipeline sends these between stages and
    # views into one buffer would be non-contiguous.
    inputs = torch.from_numpy(np.ascontiguousarray(windows[:, :-1]))  # (B, T)
    labels = torch.from_numpy(np.ascontiguousarray(windows[:, 1:]))  # (B, T)
    return inputs, labels


def sample_windows(tokens: np.ndarray, rng: np.random.Generator, micro_batch_size: int, seq_len: int) -> np.ndarray:
    """B windows of T+1 consecutive tokens at uniform random offsets, shape (B, T+1)."""
    n = int(tokens.shape[0])
    if n < seq_len + 1:
        raise ValueError(
            f"the corpus has {n} tokens, fewer than seq_len + 1 = {seq_len + 1} needed for one "
            f"training window: use a bigger corpus (data.path) or a shorter sequence length"
        )
    # Last valid start is n - (T+1); integers() excludes its upper bound.
    offsets = rng.integers(0, n - seq_len, size=micro_batch_size)  # (B,)
    index = offsets[:, None] + np.arange(seq_len + 1)[None, :]  # (B, T+1)
    return np.asarray(tokens[index])  # (B, T+1)
