"""Deterministic batch sampling shared by all token sources.

Every batch is a pure function of (seed, step, dp_rank, micro): no state carries between
calls, so the data does not depend on how many processes exist, on what was sampled before,
or on which pipeline stage asks (the first stage needs the inputs, the last the labels).
Validation batches are a pure function of (seed, index), drawn from a seed stream of their own.
"""

from __future__ import annotations

import math

import numpy as np
import torch


def check_batch_args(seed: int, step: int, dp_rank: int, micro: int, micro_batch_size: int, seq_len: int) -> None:
    _check_coordinates(
        "batch", {"seed": seed, "step": step, "dp_rank": dp_rank, "micro": micro}, micro_batch_size, seq_len
    )


def check_val_args(seed: int, index: int, micro_batch_size: int, seq_len: int) -> None:
    _check_coordinates("val_batch", {"seed": seed, "index": index}, micro_batch_size, seq_len)


def _check_coordinates(caller: str, coordinates: dict[str, int], micro_batch_size: int, seq_len: int) -> None:
    # numpy's SeedSequence rejects negative entries with a message that names none of these.
    for label, value in coordinates.items():
        if value < 0:
            raise ValueError(f"{caller}(): {label}={value} must be >= 0")
    if micro_batch_size < 1:
        raise ValueError(f"{caller}(): micro_batch_size={micro_batch_size} must be >= 1")
    if seq_len < 1:
        raise ValueError(f"{caller}(): seq_len={seq_len} must be >= 1")


# Leads the seed of every validation batch: training seeds have four entries, validation seeds three with this
# tag first, so no validation batch can share a generator with any training batch.
_VAL_STREAM = 0x76616C  # b"val"


def batch_rng(seed: int, step: int, dp_rank: int, micro: int) -> np.random.Generator:
    """A generator seeded by the batch coordinates alone."""
    return np.random.default_rng([seed, step, dp_rank, micro])


def val_rng(seed: int, index: int) -> np.random.Generator:
    """The generator of the index-th validation batch: a stream of its own, distinct from every training batch's."""
    return np.random.default_rng([_VAL_STREAM, seed, index])


def split_sizes(num_tokens: int, val_fraction: float) -> tuple[int, int]:
    """(training, held-out) token counts when the last ``val_fraction`` of ``num_tokens`` is held out."""
    held_out = math.ceil(num_tokens * val_fraction)
    return num_tokens - held_out, held_out


def split_inputs_labels(windows: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """Turn (B, T+1) token windows into next-token (inputs, labels), each int64 (B, T)."""
    windows = windows.astype(np.int64, copy=False)  # (B, T+1)
    # Separate contiguous copies: DeepSpeed's pipeline sends these between stages and
    # views into one buffer would be non-contiguous.
    inputs = torch.from_numpy(np.ascontiguousarray(windows[:, :-1]))  # (B, T)
    labels = torch.from_numpy(np.ascontiguousarray(windows[:, 1:]))  # (B, T)
    return inputs, labels


def sample_windows(
    tokens: np.ndarray, rng: np.random.Generator, micro_batch_size: int, seq_len: int, split: str = "training"
) -> np.ndarray:
    """B windows of T+1 consecutive tokens at uniform random offsets, shape (B, T+1)."""
    n = int(tokens.shape[0])
    if n < seq_len + 1:
        # Start-up (data/preflight.py) refuses such corpora; this guards direct callers of a source.
        raise ValueError(
            f"the {split} split has {n} tokens, fewer than seq_len + 1 = {seq_len + 1} needed for one "
            f"window: use a bigger corpus (data.path) or a shorter sequence length (model.seq_len)"
        )
    # Last valid start is n - (T+1); integers() excludes its upper bound.
    offsets = rng.integers(0, n - seq_len, size=micro_batch_size)  # (B,)
    index = offsets[:, None] + np.arange(seq_len + 1)[None, :]  # (B, T+1)
    return np.asarray(tokens[index])  # (B, T+1)
