"""Token data for stagecheck: config schemas and deterministic batch sources."""

from data.config import (
    BYTE_VOCAB_SIZE,
    DataConfig,
    MemmapDataConfig,
    SyntheticDataConfig,
    TextDataConfig,
    check_vocab,
    data_vocab_size,
)
from data.source import TokenSource, open_token_source
from data.text_source import text_cache_path

__all__ = [
    "BYTE_VOCAB_SIZE",
    "DataConfig",
    "MemmapDataConfig",
    "SyntheticDataConfig",
    "TextDataConfig",
    "TokenSource",
    "check_vocab",
    "data_vocab_size",
    "open_token_source",
    "text_cache_path",
]
