"""Train a byte-level BPE on a corpus, once, into a cached ``tokenizer.json``.

Byte-level (GPT-2's scheme): text is split by GPT-2's regex, each piece's UTF-8 bytes are mapped to 256 visible
characters, and merges are learnt over those, so any text encodes and decoding gives back its exact bytes.
Training is deterministic (checked across processes): the same corpus and size give the same file bytes.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterator

import tokenizers
from tokenizers import decoders, models, pre_tokenizers, trainers

from data.cache import ensure_file
from data.corpus import CorpusFiles, iter_texts

log = logging.getLogger(__name__)

# Bump when the training recipe below changes, so tokenizers (and the token caches built with them) trained
# the old way are not reused.
BPE_FORMAT = "bpe-v2"
# The BPE's last id: it ends every file of the corpus in the token cache (GPT-2's end-of-text token, and id).
BPE_EOS_TOKEN = "<|endoftext|>"
# The BPE learns from at most the first this many bytes of the corpus (whole files, in corpus order): the
# embedded 12 MB corpus trains whole in about 5 s here, while a many-GB corpus would not fit in memory.
BPE_TRAIN_BYTES = 256 * 2**20


def bpe_cache_path(cache_dir: str, corpus_fingerprint: str, vocab_size: int) -> str:
    """Where the BPE of this corpus version and size lives."""
    return os.path.join(os.path.abspath(cache_dir), f"{BPE_FORMAT}-{vocab_size}-{corpus_fingerprint[:20]}.json")


def ensure_bpe(files: CorpusFiles, path: str, vocab_size: int) -> tokenizers.Tokenizer:
    """The BPE at ``path``, trained on ``files`` first if no process has (one trains, the others wait)."""

    def build(tmp: str) -> None:
        start = time.perf_counter()
        trained = train_bpe(files, vocab_size)
        with open(tmp, "w", encoding="utf-8") as handle:
            handle.write(trained.to_str())
            handle.flush()
            os.fsync(handle.fileno())  # durable before the rename publishes it
        log.info(
            "trained BPE %s: %d ids from %s in %.1f s",
            path,
            trained.get_vocab_size(),
            files.origin,
            time.perf_counter() - start,
        )

    ensure_file(path, build)
    return tokenizers.Tokenizer.from_file(path)


def train_bpe(files: CorpusFiles, vocab_size: int) -> tokenizers.Tokenizer:
    """A byte-level BPE of at most ``vocab_size`` ids (256 byte symbols first, then merges in order, then the
    end-of-sequence token)."""
    tokenizer = tokenizers.Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - 1,  # the end-of-sequence token takes the last id
        # Every byte is a symbol from the start, so text unseen in training still encodes.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_training_texts(files), trainer)
    tokenizer.add_special_tokens([BPE_EOS_TOKEN])
    return tokenizer


def _training_texts(files: CorpusFiles) -> Iterator[str]:
    seen = 0
    for text in iter_texts(files):
        if seen >= BPE_TRAIN_BYTES:
            return
        seen += len(text.encode("utf-8"))
        yield text
