"""Config schemas for the three data sources.

These dataclasses become Hydra config-group schemas (``data=synthetic|text|memmap``), so they
hold primitive-typed fields only. Error messages name options by their full dotted path
(``data.path``) because that is what a user types on the command line to fix them.
"""

from __future__ import annotations

import os
import sysconfig
from dataclasses import dataclass

from data.tokenizer_file import MAX_UINT16_VOCAB_SIZE, read_tokenizer_file

# The bytes tokenizer's vocabulary: one id per byte value.
BYTE_VOCAB_SIZE = 256
TOKENIZERS = ("bytes", "bpe")


@dataclass
class SyntheticDataConfig:
    """Seeded uniform random tokens over the model's whole vocabulary; needs no storage."""

    name: str = "synthetic"
    """Option of the `data` config group; must stay "synthetic"."""

    def validate(self) -> None:
        _check_name(self.name, "synthetic")


@dataclass
class TextDataConfig:
    """Tokens of a text corpus (bytes, or a byte-level BPE), cached once as a uint16 memmap, with the last
    data.val_fraction held out for validation."""

    name: str = "text"
    """Option of the `data` config group; must stay "text"."""
    path: str | None = None
    """A text file (used byte for byte), or a folder whose non-hidden UTF-8 files, recursively,
    are concatenated in sorted path order. None: the embedded corpus, this Python's
    standard-library .py sources (no tests, no site-packages)."""
    cache_dir: str = ".cache/stagecheck"
    """Folder of the token cache file (and of the trained BPE); a relative path is taken from the working
    directory at the time the source is opened. Ranks that share it share one build."""
    val_fraction: float = 0.05
    """Fraction of the corpus's tokens held out for validation, in (0, 0.5]: the last ones, never sampled for
    training."""
    tokenizer: str = "bytes"
    """How text becomes tokens: "bytes" (one id per byte, vocabulary 256) or "bpe" (a byte-level BPE of the
    Hugging Face tokenizers library, trained once on the corpus and cached, or data.tokenizer_file)."""
    bpe_vocab_size: int = 4096
    """Vocabulary size, in token ids, of the BPE trained for data.tokenizer=bpe: in (256, 65536] (tokens are
    stored as uint16); model.vocab_size must be at least this. A small corpus may end with fewer merges."""
    tokenizer_file: str | None = None
    """A tokenizer.json of the Hugging Face tokenizers library (e.g. GPT-2's own) used for data.tokenizer=bpe
    instead of training one; model.vocab_size must cover its vocabulary. None: train one."""

    def validate(self) -> None:
        _check_name(self.name, "text")
        if not 0 < self.val_fraction <= 0.5:
            raise ValueError(
                f"data.val_fraction={self.val_fraction} is out of range: set data.val_fraction to a fraction in "
                f"(0, 0.5], e.g. 0.05 (the held-out share of the corpus's tokens)"
            )
        self._validate_tokenizer()
        if self.path is None:
            stdlib = sysconfig.get_paths()["stdlib"]
            if not os.path.isdir(stdlib):
                raise ValueError(
                    f"data.path=null selects the embedded corpus, but this Python's standard "
                    f"library folder {stdlib!r} does not exist: set data.path to a text file or "
                    f"a folder of text files"
                )
        else:
            if not self.path:
                raise ValueError(
                    "data.path='' is empty: set data.path to a text file or a folder of text "
                    "files, or leave it null for the embedded corpus"
                )
            if not os.path.exists(self.path):
                raise ValueError(
                    f"data.path={self.path!r} does not exist: set data.path to a text file or a "
                    f"folder of text files, or leave it null for the embedded corpus"
                )
            if not (os.path.isfile(self.path) or os.path.isdir(self.path)):
                raise ValueError(
                    f"data.path={self.path!r} is neither a regular file nor a folder: set "
                    f"data.path to a text file or a folder of text files, or leave it null for "
                    f"the embedded corpus"
                )
            if not os.access(self.path, os.R_OK):
                raise ValueError(
                    f"data.path={self.path!r} is not readable by this user: set data.path to a "
                    f"readable text file or folder, or leave it null for the embedded corpus"
                )
        if not self.cache_dir:
            raise ValueError(
                "data.cache_dir='' is empty: set data.cache_dir to a folder path (relative "
                "paths are taken from the working directory), e.g. '.cache/stagecheck'"
            )
        # Only refuse what can never work; the folder itself is created on first use.
        if os.path.exists(self.cache_dir) and not os.path.isdir(self.cache_dir):
            raise ValueError(
                f"data.cache_dir={self.cache_dir!r} exists but is not a folder: set "
                f"data.cache_dir to a folder path, e.g. '.cache/stagecheck'"
            )

    def _validate_tokenizer(self) -> None:
        if self.tokenizer not in TOKENIZERS:
            raise ValueError(f"data.tokenizer={self.tokenizer!r} is unknown: allowed values are bytes, bpe")
        if not BYTE_VOCAB_SIZE < self.bpe_vocab_size <= MAX_UINT16_VOCAB_SIZE:
            raise ValueError(
                f"data.bpe_vocab_size={self.bpe_vocab_size} is out of range: set data.bpe_vocab_size to an "
                f"integer in ({BYTE_VOCAB_SIZE}, {MAX_UINT16_VOCAB_SIZE}] (256 byte ids plus merges; tokens are "
                f"stored as uint16)"
            )
        if self.tokenizer_file is not None:
            if self.tokenizer != "bpe":
                raise ValueError(
                    f"data.tokenizer_file={self.tokenizer_file!r} needs data.tokenizer=bpe, not "
                    f"{self.tokenizer!r}: set data.tokenizer=bpe, or data.tokenizer_file=null for bytes"
                )
            read_tokenizer_file(self.tokenizer_file)


@dataclass
class MemmapDataConfig:
    """An existing nanoGPT-style ``.bin`` file: a flat array of uint16 token ids."""

    name: str = "memmap"
    """Option of the `data` config group; must stay "memmap"."""
    path: str = ""
    """Path of the .bin token file (required; this source has no default corpus)."""
    vocab_size: int = 50257
    """Vocabulary size, in token ids, of the tokenizer that wrote the file; must not exceed
    model.vocab_size. 50257 is GPT-2's BPE."""
    val_path: str | None = None
    """Path of the held-out .bin token file (nanoGPT's val.bin), same format as data.path; validation batches
    are drawn from it. None: no held-out data (train.eval_every must stay 0)."""
    tokenizer_file: str | None = None
    """The tokenizer.json (Hugging Face tokenizers format) that wrote the files, saved with the run so that
    generate.py can decode; training never reads it. None: the run has no tokenizer."""

    def validate(self) -> None:
        _check_name(self.name, "memmap")
        if not self.path:
            raise ValueError(
                "data.path is required when data.name='memmap': set data.path to an existing "
                "nanoGPT-style .bin file of uint16 tokens"
            )
        _check_token_file(self.path, "data.path", "train.bin")
        if self.val_path is not None:
            _check_token_file(self.val_path, "data.val_path", "val.bin")
        if self.tokenizer_file is not None:
            read_tokenizer_file(self.tokenizer_file)
        if not 1 <= self.vocab_size <= MAX_UINT16_VOCAB_SIZE:
            raise ValueError(
                f"data.vocab_size={self.vocab_size} is out of range: set data.vocab_size to the "
                f"tokenizer's vocabulary size, an integer in [1, {MAX_UINT16_VOCAB_SIZE}] "
                f"(tokens are stored as uint16)"
            )


DataConfig = SyntheticDataConfig | TextDataConfig | MemmapDataConfig


def _check_token_file(path: str, option: str, example: str) -> None:
    hint = f"set {option} to an existing nanoGPT-style .bin file of uint16 tokens (its {example})"
    if not path:
        raise ValueError(f"{option}='' is empty: {hint}")
    if not os.path.exists(path):
        raise ValueError(f"{option}={path!r} does not exist: {hint}")
    if not os.path.isfile(path):
        raise ValueError(f"{option}={path!r} is not a regular file: {hint}")
    if not os.access(path, os.R_OK):
        raise ValueError(f"{option}={path!r} is not readable by this user: {hint}")
    size = os.path.getsize(path)
    if size == 0 or size % 2 != 0:
        raise ValueError(
            f"{option}={path!r} has {size} bytes, which is not a positive whole number of uint16 tokens: {hint}"
        )


def data_has_val(config: DataConfig) -> bool:
    """Whether the source will have validation batches (cheap: reads no file)."""
    if isinstance(config, MemmapDataConfig):
        return config.val_path is not None
    return isinstance(config, (SyntheticDataConfig, TextDataConfig))


def data_vocab_size(config: DataConfig, model_vocab_size: int) -> int:
    """Number of distinct token ids the source can emit (synthetic follows the model)."""
    if isinstance(config, SyntheticDataConfig):
        return model_vocab_size
    if isinstance(config, TextDataConfig):
        if config.tokenizer == "bytes":
            return BYTE_VOCAB_SIZE
        if config.tokenizer_file is not None:
            return read_tokenizer_file(config.tokenizer_file).get_vocab_size(with_added_tokens=True)
        # The bound known before training: a small corpus may end with fewer merges, never more.
        return config.bpe_vocab_size
    if isinstance(config, MemmapDataConfig):
        return config.vocab_size
    raise TypeError(f"unknown data config type {type(config).__name__}")


def check_vocab(config: DataConfig, model_vocab_size: int) -> None:
    """Refuse data whose token ids could index past the model's embedding table."""
    if model_vocab_size < 1:
        raise ValueError(
            f"model.vocab_size={model_vocab_size} is out of range: set model.vocab_size to a positive integer"
        )
    needed = data_vocab_size(config, model_vocab_size)
    if needed > model_vocab_size:
        what = f"data.vocab_size={needed} of data.name={config.name!r}"
        if isinstance(config, TextDataConfig):
            what = {
                "bytes": "256 byte values of data.tokenizer='bytes'",
                "bpe": f"data.bpe_vocab_size={needed} of data.tokenizer='bpe'",
            }[config.tokenizer]
            if config.tokenizer_file is not None:
                what = f"{needed} token ids of data.tokenizer_file={config.tokenizer_file!r}"
        raise ValueError(
            f"model.vocab_size={model_vocab_size} is smaller than the data's vocabulary ({what}): "
            f"set model.vocab_size to at least {needed}"
        )


def _check_name(name: str, expected: str) -> None:
    if name != expected:
        raise ValueError(
            f"data.name={name!r} does not match its schema: set data.name to {expected!r} "
            f"(allowed: 'synthetic', 'text', 'memmap')"
        )
