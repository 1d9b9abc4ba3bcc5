"""Source backed by flat uint16 or uint32 token files (the text cache, prepared data, or nanoGPT ``train.bin``)."""

from __future__ import annotations

import numpy as np
import torch

from data.sampling import (
    batch_rng,
    check_batch_args,
    check_val_args,
    sample_windows,
    split_inputs_labels,
    split_sizes,
    val_rng,
)

# nanoGPT's .bin and every cache whose vocabulary fits 16 bits.
UINT16 = np.dtype(np.uint16)


class ArrayTokenSource:
    """Random windows of a memory-mapped token array (uint16 or uint32), with a held-out part for validation.

    The held-out part is either the last ``val_fraction`` of ``path`` (never sampled for training) or a
    separate file ``val_path``; with neither, the source has no validation batches.
    """

    def __init__(
        self,
        path: str,
        vocab_size: int,
        check_ids: bool = False,
        val_fraction: float = 0.0,
        val_path: str | None = None,
        dtype: np.dtype = UINT16,
    ) -> None:
        if val_fraction and val_path is not None:
            raise ValueError("ArrayTokenSource: give val_fraction or val_path, not both")
        self.path = path
        self.val_path = val_path
        self.vocab_size = vocab_size
        # Scanning a multi-GB file up front is too slow, so a foreign .bin is checked per batch (start-up checks
        # only a sample, data/preflight.py): an id past the embedding table would otherwise surface as an
        # opaque CUDA device-side assert.
        self._check_ids = check_ids
        # Read-only mapping: pages come from the page cache, shared by all ranks on a node.
        self.tokens = np.memmap(path, dtype=dtype, mode="r")  # (N,)
        self.num_tokens = int(self.tokens.shape[0])
        self.train_tokens = self.tokens  # (N_train,)
        self.val_tokens: np.ndarray | None = None  # (N_val,)
        if val_path is not None:
            self.val_tokens = np.memmap(val_path, dtype=dtype, mode="r")
        elif val_fraction:
            num_train, _ = split_sizes(self.num_tokens, val_fraction)
            self.train_tokens, self.val_tokens = self.tokens[:num_train], self.tokens[num_train:]

    @property
    def has_val(self) -> bool:
        return self.val_tokens is not None

    def batch(
        self, seed: int, step: int, dp_rank: int, micro: int, micro_batch_size: int, seq_len: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        check_batch_args(seed, step, dp_rank, micro, micro_batch_size, seq_len)
        rng = batch_rng(seed, step, dp_rank, micro)
        windows = sample_windows(self.train_tokens, rng, micro_batch_size, seq_len)  # (B, T+1)
        self._check_window_ids(windows, self.path)
        return split_inputs_labels(windows)  # (B, T), (B, T)

    def val_batch(
        self, seed: int, index: int, micro_batch_size: int, seq_len: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        check_val_args(seed, index, micro_batch_size, seq_len)
        if self.val_tokens is None:
            raise ValueError(f"{self!r} holds no validation tokens: set data.val_path (memmap) or use data=text")
        windows = sample_windows(self.val_tokens, val_rng(seed, index), micro_batch_size, seq_len, "validation")
        self._check_window_ids(windows, self.val_path or self.path)  # (B, T+1)
        return split_inputs_labels(windows)  # (B, T), (B, T)

    def _check_window_ids(self, windows: np.ndarray, path: str) -> None:
        if not self._check_ids:
            return
        top = int(windows.max())
        if top >= self.vocab_size:
            option = "data.val_path" if path == self.val_path else "data.path"
            raise ValueError(
                f"{option}={path!r} holds token id {top}, outside data.vocab_size={self.vocab_size}: set "
                f"data.vocab_size to the vocabulary of the tokenizer that wrote the file"
            )

    def __repr__(self) -> str:
        return (
            f"ArrayTokenSource(path={self.path!r}, num_tokens={self.num_tokens}, vocab_size={self.vocab_size}, "
            f"val_path={self.val_path!r}, val_tokens={None if self.val_tokens is None else len(self.val_tokens)})"
        )
