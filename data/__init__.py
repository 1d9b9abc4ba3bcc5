"""Token data for stagecheck: config schemas, tokenizers, deterministic training and validation batch sources."""

from data.config import (
    BYTE_VOCAB_SIZE,
    DataConfig,
    MemmapDataConfig,
    SyntheticDataConfig,
    TextDataConfig,
    check_vocab,
    data_has_val,
    data_vocab_size,
)
from data.preflight import check_data_files
from data.source import TokenSource, open_token_source
from data.text_source import text_cache_path
from data.tokenizer import Tokenizer, load_tokenizer, open_tokenizer, save_run_tokenizer, save_tokenizer

__all__ = [
    "BYTE_VOCAB_SIZE",
    "DataConfig",
    "MemmapDataConfig",
    "SyntheticDataConfig",
    "TextDataConfig",
    "TokenSource",
    "Tokenizer",
    "check_data_files",
    "check_vocab",
    "data_has_val",
    "data_vocab_size",
    "load_tokenizer",
    "open_token_source",
    "open_tokenizer",
    "save_run_tokenizer",
    "save_tokenizer",
    "text_cache_path",
]
