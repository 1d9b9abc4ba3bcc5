"""The one entry point the trainer uses: config in, token source out."""

from __future__ import annotations

from typing import Protocol

import torch

from data.array_source import ArrayTokenSource
from data.config import (
    DataConfig,
    MemmapDataConfig,
    SyntheticDataConfig,
    TextDataConfig,
    check_vocab,
)
from data.synthetic import SyntheticTokenSource
from data.text_source import open_text_source


class TokenSource(Protocol):
    """Anything that serves deterministic next-token batches."""

    # Number of distinct token ids the source can emit.
    vocab_size: int
    # Corpus length in tokens; None when unbounded (synthetic).
    num_tokens: int | None
    # Whether val_batch has held-out tokens to draw from.
    has_val: bool

    def batch(
        self, seed: int, step: int, dp_rank: int, micro: int, micro_batch_size: int, seq_len: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, labels), int64 (B, T) each, labels = inputs shifted by one token.

        A pure function of (seed, step, dp_rank, micro) and the shape arguments.
        """
        ...

    def val_batch(
        self, seed: int, index: int, micro_batch_size: int, seq_len: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The index-th fixed validation micro-batch, int64 (B, T) each, like batch().

        A pure function of (seed, index) and the shape arguments, drawn from held-out tokens that batch() never
        samples (synthetic: from a seed stream no training batch uses). Raises ValueError when has_val is False.
        """
        ...


def open_token_source(config: DataConfig, model_vocab_size: int) -> TokenSource:
    """Validate ``config`` against the model and open its source.

    For text this may build the cache (one process builds, the others wait for it), so call it
    on every rank that needs batches; it is safe to call concurrently.
    """
    config.validate()
    check_vocab(config, model_vocab_size)
    if isinstance(config, SyntheticDataConfig):
        return SyntheticTokenSource(model_vocab_size)
    if isinstance(config, TextDataConfig):
        return open_text_source(config)
    if isinstance(config, MemmapDataConfig):
        files = config.files()
        return ArrayTokenSource(
            files.path, vocab_size=files.vocab_size, check_ids=True, val_path=files.val_path, dtype=files.dtype
        )
    raise TypeError(
        f"open_token_source() needs a SyntheticDataConfig, TextDataConfig or MemmapDataConfig, "
        f"got {type(config).__name__} (convert an OmegaConf node with OmegaConf.to_object)"
    )
