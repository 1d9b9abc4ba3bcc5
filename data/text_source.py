"""Text source: the tokens of a corpus (bytes or a BPE), built once into a shared uint16 cache file."""

from __future__ import annotations

import logging
import os
import time

from data.array_source import ArrayTokenSource
from data.cache import ensure_file
from data.config import TextDataConfig
from data.corpus import iter_file_bytes, resolve_corpus, write_tokens
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

    def build(tmp: str) -> None:
        start = time.perf_counter()
        count = write_tokens(files, tokenizer.encode_corpus(iter_file_bytes(files)), tmp)
        log.info(
            "built text cache %s: %d tokens (%s) from %d files (%s) in %.1f s",
            path,
            count,
            tokenizer,
            len(files.paths),
            files.origin,
            time.perf_counter() - start,
        )

    ensure_file(path, build)
    return ArrayTokenSource(path, vocab_size=tokenizer.vocab_size, val_fraction=config.val_fraction)


def _cache_path(config: TextDataConfig, corpus_fingerprint: str) -> str:
    name = f"text-{tokenizer_tag(config)}-{corpus_fingerprint[:20]}.bin"
    return os.path.join(os.path.abspath(config.cache_dir), name)
