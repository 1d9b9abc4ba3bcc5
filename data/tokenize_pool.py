"""Tokenize a stream of chunks in worker processes and write the tokens in input order, with a progress bar.

The main process reads chunks and writes results; ``workers`` forked processes parse and encode. Results are
taken in submission order, and at most a few chunks per worker are in flight, so the output is the same for any
worker count and memory does not grow with the corpus.
"""

from __future__ import annotations

import multiprocessing
import os
import sys
import time
from collections import deque
from collections.abc import Callable, Iterable
from contextlib import contextmanager
from dataclasses import dataclass
from typing import BinaryIO

from data.documents import Chunk
from data.encode_worker import ChunkEncoder, Encoded, EncoderSpec, encode_in_worker, init_worker

# Chunks submitted ahead of the one being written, per worker: enough to keep every worker busy; and the input bytes
# they may hold together beyond the oldest one (a text file is one chunk, however big).
IN_FLIGHT_PER_WORKER = 4
IN_FLIGHT_BYTES = 256 << 20


@dataclass
class TokenCounts:
    """What a tokenization wrote: tokens and documents per split, empty documents skipped, input bytes read."""

    train_tokens: int = 0
    val_tokens: int = 0
    train_documents: int = 0
    val_documents: int = 0
    empty_documents: int = 0
    input_bytes: int = 0
    seconds: float = 0.0
    workers: int = 1

    def add(self, encoded: Encoded) -> None:
        self.train_tokens += int(encoded.train.shape[0])
        self.val_tokens += int(encoded.val.shape[0])
        self.train_documents += encoded.train_documents
        self.val_documents += encoded.val_documents
        self.empty_documents += encoded.empty_documents
        self.input_bytes += encoded.input_bytes


def tokenize_chunks(
    chunks: Iterable[Chunk],
    spec: EncoderSpec,
    workers: int,
    train_out: BinaryIO,
    val_out: BinaryIO | None,
    val_documents: Callable[[Chunk], frozenset[int]] = lambda chunk: frozenset(),
    total_documents: int | None = None,
    label: str = "tokenizing",
) -> TokenCounts:
    """Encode ``chunks`` in ``workers`` processes (0: in this one, for the bytes tokenizer, whose encoding is a copy
    that a worker would only add a round trip to); training tokens go to ``train_out``, validation tokens (the
    documents ``val_documents(chunk)`` names) to ``val_out``. ValueError from a worker (bad input) ends it."""
    counts = TokenCounts(workers=workers)
    start = time.perf_counter()
    progress = _progress(total_documents, label)
    if workers == 0:
        encoder = ChunkEncoder(spec)
        for chunk in chunks:
            _write(encoder.encode(chunk, val_documents(chunk)), counts, train_out, val_out, progress, start)
    else:
        _encode_in_pool(chunks, spec, workers, val_documents, counts, train_out, val_out, progress, start)
    progress.close()
    counts.seconds = time.perf_counter() - start
    return counts


def _encode_in_pool(chunks, spec, workers, val_documents, counts, train_out, val_out, progress, start) -> None:
    with _pool(spec, workers) as pool:
        pending: deque = deque()  # (result, input bytes)
        for chunk in chunks:
            pending.append((pool.apply_async(encode_in_worker, (chunk, val_documents(chunk))), chunk.size))
            while len(pending) >= IN_FLIGHT_PER_WORKER * workers or _bytes_after_oldest(pending) > IN_FLIGHT_BYTES:
                _write(pending.popleft()[0].get(), counts, train_out, val_out, progress, start)
        while pending:
            _write(pending.popleft()[0].get(), counts, train_out, val_out, progress, start)


def _bytes_after_oldest(pending: deque) -> int:
    return sum(size for _, size in pending) - pending[0][1]


def _write(encoded: Encoded, counts: TokenCounts, train_out, val_out, progress, start: float) -> None:
    encoded.train.tofile(train_out)
    if encoded.val.size:
        encoded.val.tofile(val_out)
    counts.add(encoded)
    progress.update(encoded.train_documents + encoded.val_documents + encoded.empty_documents)
    tokens = counts.train_tokens + counts.val_tokens
    progress.set_postfix_str(f"{tokens / max(time.perf_counter() - start, 1e-9):,.0f} tokens/s", refresh=False)


def _progress(total: int | None, label: str):
    from tqdm import tqdm  # tqdm imports in 0.1 s: only once tokenizing starts

    # One line on the terminal, refreshed; in a log file a line every 5 s at most.
    interval = 0.1 if sys.stderr.isatty() else 5.0
    return tqdm(total=total, desc=label, unit=" docs", unit_scale=True, mininterval=interval, file=sys.stderr)


@contextmanager
def _pool(spec: EncoderSpec, workers: int):
    # Fork: a worker needs only this module's code, already loaded; spawn would import the command's __main__.
    context = multiprocessing.get_context("fork")
    # Each worker encodes on one thread (the tokenizers library would spread each batch over all cores, so
    # `workers` would not mean processes). Set before the fork so that a parent that used the library's threads
    # (a BPE trained here) does not make every child print the library's fork warning.
    with _environment("TOKENIZERS_PARALLELISM", "false"):
        pool = context.Pool(workers, initializer=init_worker, initargs=(spec,))
    try:
        yield pool
        pool.close()
    except BaseException:
        pool.terminate()  # a bad chunk or an interrupt: the chunks in flight are of no use
        raise
    finally:
        pool.join()


@contextmanager
def _environment(name: str, value: str):
    before = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if before is None:
            del os.environ[name]
        else:
            os.environ[name] = before


def default_workers() -> int:
    """The cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
