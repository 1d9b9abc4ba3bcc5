"""Config schemas for the three data sources.

These dataclasses become Hydra config-group schemas (``data=synthetic|text|memmap``), so they
hold primitive-typed fields only. Error messages name options by their full dotted path
(``data.path``) because that is what a user types on the command line to fix them.
"""

from __future__ import annotations

import os
import sysconfig
from dataclasses import dataclass

# Text is tokenised as raw bytes, so its vocabulary is fixed.
BYTE_VOCAB_SIZE = 256
# Token files store uint16, so no tokenizer with a bigger vocabulary fits.
MAX_UINT16_VOCAB_SIZE = 65536


@dataclass
class SyntheticDataConfig:
    """Seeded uniform random tokens over the model's whole vocabulary; needs no storage."""

    name: str = "synthetic"
    """Option of the `data` config group; must stay "synthetic"."""

    def validate(self) -> None:
        _check_name(self.name, "synthetic")


@dataclass
class TextDataConfig:
    """Byte-level tokens (vocabulary 256) of a text corpus, cached once as a uint16 memmap."""

    name: str = "text"
    """Option of the `data` config group; must stay "text"."""
    path: str | None = None
    """A text file (used byte for byte), or a folder whose non-hidden UTF-8 files, recursively,
    are concatenated in sorted path order. None: the embedded corpus, this Python's
    standard-library .py sources (no tests, no site-packages)."""
    cache_dir: str = ".cache/stagecheck"
    """Folder of the token cache file; a relative path is taken from the working directory at
    the time the source is opened. Ranks that share it share one build."""

    def validate(self) -> None:
        _check_name(self.name, "text")
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

    def validate(self) -> None:
        _check_name(self.name, "memmap")
        hint = "set data.path to an existing nanoGPT-style .bin file of uint16 tokens"
        if not self.path:
            raise ValueError(f"data.path is required when data.name='memmap': {hint}")
        if not os.path.exists(self.path):
            raise ValueError(f"data.path={self.path!r} does not exist: {hint}")
        if not os.path.isfile(self.path):
            raise ValueError(f"data.path={self.path!r} is not a regular file: {hint}")
        if not os.access(self.path, os.R_OK):
            raise ValueError(f"data.path={self.path!r} is not readable by this user: {hint}")
        size = os.path.getsize(self.path)
        if size == 0 or size % 2 != 0:
            raise ValueError(
                f"data.path={self.path!r} has {size} bytes, which is not a positive whole number "
                f"of uint16 tokens: {hint}"
            )
        if not 1 <= self.vocab_size <= MAX_UINT16_VOCAB_SIZE:
            raise ValueError(
                f"data.vocab_size={self.vocab_size} is out of range: set data.vocab_size to the "
                f"tokenizer's vocabulary size, an integer in [1, {MAX_UINT16_VOCAB_SIZE}] "
                f"(tokens are stored as uint16)"
            )


DataConfig = SyntheticDataConfig | TextDataConfig | MemmapDataConfig


def data_vocab_size(config: DataConfig, model_vocab_size: int) -> int:
    """Number of distinct token ids the source can emit (synthetic follows the model)."""
    if isinstance(config, SyntheticDataConfig):
        return model_vocab_size
    if isinstance(config, TextDataConfig):
        return BYTE_VOCAB_SIZE
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
        what = (
            "256 byte values of data.name='text'"
            if isinstance(config, TextDataConfig)
            else f"data.vocab_size={needed} of data.name={config.name!r}"
        )
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
