"""Config schemas for the three data sources.

These dataclasses become Hydra config-group schemas (``data=synthetic|text|memmap``), so they
hold primitive-typed fields only. Error messages name options by their full dotted path
(``data.path``) because that is what a user types on the command line to fix them.
"""

from __future__ import annotations

import os
import sysconfig
from dataclasses import dataclass

from data.memmap_files import MemmapFiles, memmap_files
from data.token_files import MAX_UINT16_VOCAB_SIZE, META_FILE, meta_path_of
from data.tokenizer_file import read_tokenizer_file

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
    """Tokens of a text corpus (bytes, or a byte-level BPE), cached once as a memmap (uint16, or uint32 past 65,536
    ids), with the last data.val_fraction held out for validation."""

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
    workers: int | None = None
    """Processes that tokenize the corpus with a BPE when its token cache is built (>= 1; the cache is the same for
    any number; bytes need none: their encoding is a copy, done by the building rank). None: one per core the
    building rank may use."""

    def validate(self) -> None:
        _check_name(self.name, "text")
        if self.workers is not None and self.workers < 1:
            raise ValueError(
                f"data.workers={self.workers} is invalid: set data.workers to a process count >= 1, or null for one "
                f"per core"
            )
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
            _refuse_prepared_as_text(self.path)
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
    """Token files on disk: a folder prepare_data.py wrote (its stagecheck_data.json gives the dtype, uint16 or
    uint32, the vocabulary, the validation file and the tokenizer), or a nanoGPT-style ``.bin`` of uint16 ids."""

    name: str = "memmap"
    """Option of the `data` config group; must stay "memmap"."""
    path: str = ""
    """The folder prepare_data.py wrote (or its train.bin), or a nanoGPT-style .bin token file (required; this
    source has no default corpus)."""
    vocab_size: int | None = None
    """Vocabulary size, in token ids, of the tokenizer that wrote a bare .bin; must not exceed model.vocab_size.
    None: the prepared folder's tokenizer, or 50257 (GPT-2's BPE) for a bare .bin. Prepared data refuses a value
    that disagrees with its metadata."""
    val_path: str | None = None
    """Path of the held-out token file (nanoGPT's val.bin), same format as data.path; validation batches are drawn
    from it. None: a prepared folder's val.bin (when it holds tokens), else no held-out data (train.eval_every
    must stay 0)."""
    tokenizer_file: str | None = None
    """The tokenizer.json (Hugging Face tokenizers format) that wrote a bare .bin, saved with the run so that
    generate.py can decode; training never reads it. A prepared folder carries its own (a file given here must be
    the same). None: the prepared folder's, or no tokenizer for a bare .bin."""

    def validate(self) -> None:
        _check_name(self.name, "memmap")
        if not self.path:
            raise ValueError(
                "data.path is required when data.name='memmap': set data.path to a folder prepare_data.py wrote or "
                "an existing nanoGPT-style .bin file of uint16 tokens"
            )
        if self.tokenizer_file is not None:
            read_tokenizer_file(self.tokenizer_file)
        _check_token_file(self.path, "data.path", "train.bin", itemsize=0)
        files = self.files()
        _check_token_file(files.path, "data.path", "train.bin", files.dtype.itemsize)
        if files.val_path is not None:
            _check_token_file(files.val_path, "data.val_path", "val.bin", files.dtype.itemsize)

    def files(self) -> MemmapFiles:
        """The token files, dtype and vocabulary this config reads (from the metadata, when there is one)."""
        return memmap_files(self.path, self.val_path, self.vocab_size, self.tokenizer_file)


DataConfig = SyntheticDataConfig | TextDataConfig | MemmapDataConfig


def _refuse_prepared_as_text(path: str) -> None:
    """A folder prepare_data.py wrote, or a file in one, holds token ids, not text: read as text it would train
    on its metadata and its binary token files. Refused rather than read as data=memmap behind the user's back,
    so the config a run saves says what it read."""
    folder = path if os.path.isdir(path) else os.path.dirname(os.path.abspath(path))
    if os.path.isfile(meta_path_of(folder)):
        raise ValueError(
            f"data.path={path!r} is token files that prepare_data.py wrote ({META_FILE} is in {folder!r}), not "
            f"text: read them with data=memmap data.path={folder}"
        )


def _check_token_file(path: str, option: str, example: str, itemsize: int) -> None:
    """A readable token file of whole ``itemsize``-byte ids (0: only that the path is readable; a folder is
    allowed, memmap_files checks it)."""
    hint = f"set {option} to a folder prepare_data.py wrote or an existing nanoGPT-style .bin file (its {example})"
    if not path:
        raise ValueError(f"{option}='' is empty: {hint}")
    if not os.path.exists(path):
        raise ValueError(f"{option}={path!r} does not exist: {hint}")
    if not os.access(path, os.R_OK):
        raise ValueError(f"{option}={path!r} is not readable by this user: {hint}")
    if itemsize == 0:
        return
    if not os.path.isfile(path):
        raise ValueError(f"{option}={path!r} is not a regular file: {hint}")
    size = os.path.getsize(path)
    if size == 0 or size % itemsize != 0:
        raise ValueError(
            f"{option}={path!r} has {size} bytes, which is not a positive whole number of "
            f"{'uint16' if itemsize == 2 else 'uint32'} tokens: {hint}"
        )


def data_identity(config: DataConfig) -> dict | None:
    """What the tokens are, beyond the path that names them: a prepared folder's key and its tokenizer's SHA-256
    (stagecheck_data.json). A resume compares it with its checkpoint's, so that a relative data.path resolved in
    another directory, or a folder prepared again from another corpus, is not taken for the run's data. None where
    nothing names the tokens (synthetic, text, a bare .bin): the path options alone are compared."""
    if not isinstance(config, MemmapDataConfig):
        return None
    meta = config.files().meta
    if meta.meta_path is None:
        return None
    return {"prepared_key": meta.key, "tokenizer_sha256": meta.tokenizer_sha256}


def data_has_val(config: DataConfig) -> bool:
    """Whether the source will have validation batches (cheap: reads at most a prepared folder's metadata)."""
    if isinstance(config, MemmapDataConfig):
        return config.files().val_path is not None
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
        return config.files().vocab_size
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
        if isinstance(config, MemmapDataConfig):
            what = config.files().vocab_origin
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
