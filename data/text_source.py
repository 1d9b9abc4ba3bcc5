"""Text source: byte tokens of a corpus, built once into a shared uint16 cache file."""

from __future__ import annotations

import logging
import os
import time

from data.array_source import ArrayTokenSource
from data.cache import ensure_file
from data.config import BYTE_VOCAB_SIZE, TextDataConfig
from data.corpus import CorpusFiles, fingerprint, list_corpus_files, write_tokens

log = logging.getLogger(__name__)


def text_cache_path(config: TextDataConfig) -> str:
    """Absolute path of the cache file for the corpus as it is on disk now."""
    return _resolve(config)[1]


def open_text_source(config: TextDataConfig) -> ArrayTokenSource:
    files, path = _resolve(config)

    def build(tmp: str) -> None:
        start = time.perf_counter()
        count = write_tokens(files, tmp)
        log.info(
            "built text cache %s: %d tokens from %d files (%s) in %.1f s",
            path,
            count,
            len(files.paths),
            files.origin,
            time.perf_counter() - start,
        )

    ensure_file(path, build)
    return ArrayTokenSource(path, vocab_size=BYTE_VOCAB_SIZE)


def _resolve(config: TextDataConfig) -> tuple[CorpusFiles, str]:
    # Listing and stat-ing the sources is cheap; only their contents are expensive, and
    # those are read once per corpus version.
    cache_dir = os.path.abspath(config.cache_dir)
    files = list_corpus_files(config.path, exclude_dir=cache_dir)
    return files, os.path.join(cache_dir, f"text-{fingerprint(files)[:20]}.bin")
