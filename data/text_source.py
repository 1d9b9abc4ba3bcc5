"""Text source: the tokens of a corpus (bytes or a BPE), built once into a shared cache file (uint16, or uint32 for
a vocabulary past 65,536 ids) by the tokenizing workers prepare_data.py uses, each file ended by the tokenizer's
end-of-sequence id when it has one."""

from __future__ import annotations

import logging
import os

from data.array_source import ArrayTokenSource
from data.cache import ensure_file
from data.config import TextDataConfig
from data.corpus import file_chunks, resolve_corpus
from data.encode_worker import EncoderSpec
from data.token_files import token_dtype
from data.tokenize_pool import default_workers, tokenize_chunks
from data.tokenizer import open_tokenizer, tokenizer_tag

log = logging.getLogger(__name__)


def text_cache_path(config: TextDataConfig) -> str:
    """Absolute path of the token cache file for the corpus as it is on disk now, and its tokenizer."""
    _, corpus_fingerprint = resolve_corpus(config.path, config.cache_dir)
    return _cache_path(config, corpus_fingerprint)


def open_text_source(config: TextDataConfig) -> ArrayTokenSource:
    files, corpus_fingerprint = resolve_corpus(config.path, config.cache_dir)
    path = _cache_path(config, corpus_fingerprint)
    tokenizer = open_tokenizer(config)  # a BPE is trained (once) before the corpus is tokenized with it
    dtype = token_dtype(tokenizer.vocab_size)

    def build(tmp: str) -> None:
        spec = EncoderSpec(
            None if tokenizer.hf is None else tokenizer.hf.to_str(),
            tokenizer.eos_id,
            dtype.name,
            # A single named file is used as it is (see CorpusFiles.require_utf8); a BPE needs characters.
            text_mode="bytes" if tokenizer.hf is None else "replace",
        )
        workers = config.workers or default_workers()
        if tokenizer.hf is None:
            workers = 0  # bytes: the encoding is a copy, done in this process (tokenize_chunks)
        with open(tmp, "wb") as out:
            counts = tokenize_chunks(
                file_chunks(files), spec, workers, out, None, total_documents=len(files.paths), label="token cache"
            )
            out.flush()
            os.fsync(out.fileno())  # durable before the rename publishes it: a reader must never map a short file
        if counts.train_tokens == 0:
            raise ValueError(
                f"data.path selects no text ({files.origin}: {len(files.paths)} files, none non-empty UTF-8): set "
                f"data.path to a text file or a folder of text files, or leave it null for the embedded corpus"
            )
        log.info(
            "built text cache %s: %d tokens (%s, %s) from %d files (%s) in %.1f s with %d worker processes",
            path,
            counts.train_tokens,
            tokenizer,
            dtype.name,
            counts.train_documents,
            files.origin,
            counts.seconds,
            workers,
        )

    ensure_file(path, build)
    return ArrayTokenSource(path, vocab_size=tokenizer.vocab_size, val_fraction=config.val_fraction, dtype=dtype)


def _cache_path(config: TextDataConfig, corpus_fingerprint: str) -> str:
    name = f"text-{tokenizer_tag(config)}-{corpus_fingerprint[:20]}.bin"
    return os.path.join(os.path.abspath(config.cache_dir), name)
