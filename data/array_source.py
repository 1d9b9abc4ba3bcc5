"""Source backed by a flat uint16 token file (the text cache or a nanoGPT ``.bin``)."""

from __future__ import annotations

import numpy as np
import torch

from data.sampling import batch_rng, check_batch_args, sample_windows, split_inputs_labels


class ArrayTokenSource:
    """Random windows of a memory-mapped uint16 token array."""

    def __init__(self, path: str, vocab_size: int, check_ids: bool = False) -> None:
        self.path = path
        self.vocab_size = vocab_size
        # Scanning a multi-GB file up front is too slow, so a foreign .bin is checked per
        # batch instead: an id past the embedding table would otherwise surface as an opaque
        # CUDA device-side assert.
        self._check_ids = check_ids
        # Read-only mapping: pages come from the page cache, shared by all ranks on a node.
        self.tokens = np.memmap(path, dtype=np.uint16, mode="r")  # (N,)
        self.num_tokens = int(self.tokens.shape[0])

    def batch(
        self, seed: int, step: int, dp_rank: int, micro: int, micro_batch_size: int, seq_len: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        check_batch_args(seed, step, dp_rank, micro, micro_batch_size, seq_len)
        rng = batch_rng(seed, step, dp_rank, micro)
        windows = sample_windows(self.tokens, rng, micro_batch_size, seq_len)  # (B, T+1)
        if self._check_ids:
            top = int(windows.max())
            if top >= self.vocab_size:
                raise ValueError(
                    f"data.path={self.path!r} holds token id {top}, outside data.vocab_size="
                    f"{self.vocab_size}: set data.vocab_size to the vocabulary of the tokenizer "
                    f"that wrote the file"
                )
        return split_inputs_labels(windows)  # (B, T), (B, T)

    def __repr__(self) -> str:
        return f"ArrayTokenSource(path={self.path!r}, num_tokens={self.num_tokens}, vocab_size={self.vocab_size})"
