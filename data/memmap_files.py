"""What data=memmap reads: a folder prepare_data.py wrote (its metadata gives the dtype, the vocabulary, the
validation file and the tokenizer), or a bare nanoGPT .bin (uint16, vocabulary data.vocab_size or GPT-2's)."""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np

from data.token_files import (
    MAX_UINT16_VOCAB_SIZE,
    META_FILE,
    TRAIN_FILE,
    TokenFiles,
    meta_path_of,
    read_token_files,
)
from data.tokenizer_file import file_digest

# A bare .bin's vocabulary when data.vocab_size is not set: GPT-2's BPE, nanoGPT's.
BARE_BIN_VOCAB_SIZE = 50257
# Corpus files (prepare_data.py's inputs, and text) that a bare token file never is.
CORPUS_SUFFIXES = (".jsonl", ".json", ".parquet", ".txt", ".md", ".csv")


@dataclass(frozen=True)
class MemmapFiles:
    """The token files of a data=memmap config, settled: paths, dtype, vocabulary and the tokenizer's file."""

    path: str
    val_path: str | None
    dtype: np.dtype
    vocab_size: int
    # Where the vocabulary comes from, for messages.
    vocab_origin: str
    meta: TokenFiles

    @property
    def prepared(self) -> bool:
        return self.meta.meta_path is not None


def memmap_files(path: str, val_path: str | None, vocab_size: int | None, tokenizer_file: str | None) -> MemmapFiles:
    """Settle data.path (a token file, or the folder prepare_data.py wrote), data.val_path, data.vocab_size and
    data.tokenizer_file against the metadata; ValueError naming the option that disagrees with it."""
    if os.path.isdir(path):
        if not os.path.exists(meta_path_of(path)):
            raise ValueError(
                f"data.path={path!r} is a folder without {META_FILE}: give a folder prepare_data.py wrote, or a .bin "
                f"token file"
            )
        path = os.path.join(path, TRAIN_FILE)
    meta = read_token_files(path)
    if meta.meta_path is None and path.lower().endswith(CORPUS_SUFFIXES):
        raise ValueError(
            f"data.path={path!r} is a corpus, not token ids: tokenize it first with "
            f"`python prepare_data.py input={path} out=DIR`, then train with data=memmap data.path=DIR"
        )
    if meta.meta_path is None:
        size = BARE_BIN_VOCAB_SIZE if vocab_size is None else vocab_size
        origin = f"data.vocab_size={size}" if vocab_size is not None else f"a bare .bin's default, {size} (GPT-2)"
        if not 1 <= size <= MAX_UINT16_VOCAB_SIZE:
            raise ValueError(
                f"data.vocab_size={size} is out of range: set data.vocab_size to the tokenizer's vocabulary size, an "
                f"integer in [1, {MAX_UINT16_VOCAB_SIZE}] (a bare .bin holds uint16 tokens)"
            )
        return MemmapFiles(path, val_path, meta.dtype, size, origin, meta)
    if vocab_size is not None and vocab_size != meta.vocab_size:
        raise ValueError(
            f"data.vocab_size={vocab_size} disagrees with {meta.meta_path}, whose tokenizer has {meta.vocab_size} ids: "
            f"leave data.vocab_size unset (null) for prepared data"
        )
    if tokenizer_file is not None:
        _check_same_tokenizer(tokenizer_file, meta)
    origin = f"the {meta.vocab_size} ids of the tokenizer in {meta.meta_path}"
    return MemmapFiles(
        path, val_path if val_path is not None else meta.val_path, meta.dtype, meta.vocab_size, origin, meta
    )


def _check_same_tokenizer(tokenizer_file: str, meta: TokenFiles) -> None:
    if meta.tokenizer_sha256 is None:
        raise ValueError(
            f"data.tokenizer_file={tokenizer_file!r} disagrees with {meta.meta_path}: the data was tokenized with the "
            f"{meta.tokenizer_kind} tokenizer: drop data.tokenizer_file (prepared data is read with its folder's "
            f"tokenizer)"
        )
    if file_digest(tokenizer_file) != meta.tokenizer_sha256:
        raise ValueError(
            f"data.tokenizer_file={tokenizer_file!r} is not the tokenizer that wrote the data (its SHA-256 differs "
            f"from the one {meta.meta_path} records): drop data.tokenizer_file (prepared data is read with the "
            f"tokenizer.json its folder holds)"
        )
