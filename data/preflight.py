"""Data problems refused at start-up, before any process group exists: a corpus or token file too short for
one window in its training or validation split, a corpus folder with no text, token ids the model cannot embed.

What needs the corpus's tokens is known exactly once its token cache exists; before that it is bounded from
above by the corpus's bytes (every token holds at least one byte), so nothing that can work is refused and the
per-batch checks of the sources stay for what only the tokens show. A memmap file can be many GB: its ids are
checked on a bounded sample here (the first and last ids and seeded random blocks) and on every batch later.
"""

from __future__ import annotations

import math
import os

import numpy as np

from data.config import BYTE_VOCAB_SIZE, DataConfig, MemmapDataConfig, TextDataConfig, data_vocab_size
from data.corpus import CorpusFiles, iter_file_bytes, resolve_corpus
from data.sampling import split_sizes
from data.text_source import text_cache_path
from data.token_files import token_dtype

# Start-up reads at most this many ids of a memmap file at each end, and this many in random blocks between.
ID_SAMPLE_END_TOKENS = 1 << 20
ID_SAMPLE_BLOCKS = 16
ID_SAMPLE_BLOCK_TOKENS = 1 << 16
# Seeds the random blocks, so every rank (and every start) checks the same ids.
_ID_SAMPLE_SEED = 0


def check_data_files(config: DataConfig, seq_len: int) -> None:
    """Refuse data that cannot give one window of ``seq_len`` + 1 tokens in each split, or that holds ids past
    data.vocab_size; raises ValueError naming the option to change."""
    if isinstance(config, TextDataConfig):
        _check_text(config, seq_len)
    elif isinstance(config, MemmapDataConfig):
        files = config.files()
        for path, option in ((files.path, "data.path"), (files.val_path, "data.val_path")):
            if path is not None:
                tokens = np.memmap(path, dtype=files.dtype, mode="r")  # (N,)
                _check_length(int(tokens.shape[0]), seq_len, option, path)
                _check_id_sample(tokens, files.vocab_size, option, path)


def _check_text(config: TextDataConfig, seq_len: int) -> None:
    files, _ = resolve_corpus(config.path, config.cache_dir)
    where = f"data.path={config.path!r}" if config.path is not None else "the embedded corpus (data.path=null)"
    if not files.paths:
        raise ValueError(
            f"{where} holds no files ({files.origin}; hidden files are skipped): set data.path to a text file "
            f"or a folder of text files, or leave it null for the embedded corpus"
        )
    needed = min_corpus_tokens(seq_len, config.val_fraction)
    cache = text_cache_path(config)
    if os.path.exists(cache):
        itemsize = token_dtype(data_vocab_size(config, BYTE_VOCAB_SIZE)).itemsize
        count, what = os.path.getsize(cache) // itemsize, f"{config.tokenizer} tokens"
    else:
        count, what = _text_bytes_up_to(files, needed), "bytes of text (tokens, at most)"
    if count == 0:
        raise ValueError(
            f"{where} selects no text ({files.origin}: {len(files.paths)} files, none non-empty UTF-8): set "
            f"data.path to a text file or a folder of text files, or leave it null for the embedded corpus"
        )
    if count < needed:
        train, val = split_sizes(count, config.val_fraction)
        raise ValueError(
            f"{where} has {count} {what}: with data.val_fraction={config.val_fraction} that is {train} for "
            f"training and {val} held out, and each split needs model.seq_len + 1 = {seq_len + 1} for one window "
            f"(at least {needed} in all): use a bigger corpus (data.path), a shorter model.seq_len or another "
            f"data.val_fraction"
        )


def min_corpus_tokens(seq_len: int, val_fraction: float) -> int:
    """The fewest tokens whose split gives both parts a window of ``seq_len`` + 1 tokens."""

    def fits(n: int) -> bool:
        return min(split_sizes(n, val_fraction)) >= seq_len + 1

    # Both parts grow by at most one token per token added, so `fits` is monotone; start near the answer.
    n = max(2 * (seq_len + 1), math.ceil(seq_len / val_fraction))
    while fits(n - 1):
        n -= 1
    while not fits(n):
        n += 1
    return n


def _text_bytes_up_to(files: CorpusFiles, limit: int) -> int:
    """Bytes of the corpus's accepted files, reading only until ``limit`` is reached (cheap for a big corpus)."""
    total = 0
    for raw in iter_file_bytes(files):
        total += len(raw)
        if total >= limit:
            break
    return total


def _check_length(count: int, seq_len: int, option: str, path: str) -> None:
    if count < seq_len + 1:
        raise ValueError(
            f"{option}={path!r} holds {count} tokens, fewer than model.seq_len + 1 = {seq_len + 1} needed for one "
            f"window: set {option} to a longer token file or use a shorter model.seq_len"
        )


def _check_id_sample(tokens: np.ndarray, vocab_size: int, option: str, path: str) -> None:
    n = int(tokens.shape[0])
    rng = np.random.default_rng(_ID_SAMPLE_SEED)
    starts = rng.integers(0, max(1, n - ID_SAMPLE_BLOCK_TOKENS), size=ID_SAMPLE_BLOCKS)
    spans = [(0, ID_SAMPLE_END_TOKENS), (max(0, n - ID_SAMPLE_END_TOKENS), n)]
    spans += [(int(s), int(s) + ID_SAMPLE_BLOCK_TOKENS) for s in sorted(starts)]
    for start, end in spans:
        block = np.asarray(tokens[start:end])  # (<= span,)
        if block.size and int(block.max()) >= vocab_size:
            at = start + int(np.argmax(block >= vocab_size))
            raise ValueError(
                f"{option}={path!r} holds token id {int(tokens[at])} at position {at}, outside "
                f"data.vocab_size={vocab_size}: set data.vocab_size to the vocabulary of the tokenizer that "
                f"wrote the file (and model.vocab_size to at least that)"
            )
