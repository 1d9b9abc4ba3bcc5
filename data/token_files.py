"""Token files and the metadata beside them: the dtype a vocabulary needs, and a prepared folder's description.

A prepared folder (prepare_data.py) holds ``train.bin``, ``val.bin`` (flat arrays of token ids, native byte order,
uint16 or uint32) and ``stagecheck_data.json``, which says how to read them and which tokenizer wrote them. A bare
``.bin`` with no such file beside it is nanoGPT's layout: uint16, its tokenizer unknown.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

import numpy as np

META_FILE = "stagecheck_data.json"
TRAIN_FILE = "train.bin"
VAL_FILE = "val.bin"
# The tokenizer.json that wrote the files, copied into the folder so a run can save it with itself.
TOKENIZER_FILE = "tokenizer.json"
# Bump when the layout of the files or the meaning of a metadata field changes.
# v2: documents are encoded whole, with the special tokens of the tokenizer's post-processor.
TOKENS_FORMAT = "stagecheck-tokens-v2"
MAX_UINT16_VOCAB_SIZE = 1 << 16
MAX_UINT32_VOCAB_SIZE = 1 << 32
DTYPES = ("uint16", "uint32")


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 when every id of a ``vocab_size`` vocabulary fits, uint32 otherwise (Llama 3: 128,256 ids)."""
    if not 1 <= vocab_size <= MAX_UINT32_VOCAB_SIZE:
        raise ValueError(f"a vocabulary of {vocab_size} ids does not fit a uint32 token file")
    return np.dtype(np.uint16 if vocab_size <= MAX_UINT16_VOCAB_SIZE else np.uint32)


@dataclass(frozen=True)
class TokenFiles:
    """How to read a token file: its dtype, the vocabulary its ids come from, and the tokenizer that wrote it
    (``tokenizer_file`` and its SHA-256; None for bytes or a bare .bin). ``meta_path`` is None for a bare .bin."""

    dtype: np.dtype
    vocab_size: int | None
    tokenizer_kind: str | None
    tokenizer_file: str | None
    tokenizer_sha256: str | None
    eos_id: int | None
    val_path: str | None
    meta_path: str | None
    key: str | None = None
    """prepare_data.py's key of the folder: it changes with the corpus files, the tokenizer's bytes and the options."""


BARE_BIN = TokenFiles(np.dtype(np.uint16), None, None, None, None, None, None, None)


def meta_path_of(folder: str) -> str:
    return os.path.join(folder, META_FILE)


def read_token_files(path: str, option: str = "data.path") -> TokenFiles:
    """What ``stagecheck_data.json`` beside the token file ``path`` says about it (BARE_BIN when there is none);
    ValueError naming ``option`` when the metadata is damaged or not of this format."""
    folder = os.path.dirname(os.path.abspath(path))
    meta_path = meta_path_of(folder)
    if not os.path.exists(meta_path):
        return BARE_BIN
    hint = f"prepare the folder again with prepare_data.py, or point {option} at a bare nanoGPT .bin"
    try:
        with open(meta_path, encoding="utf-8") as handle:
            meta = json.load(handle)
        if meta["format"] != TOKENS_FORMAT:
            raise ValueError(f"format {meta['format']!r}, not {TOKENS_FORMAT!r}")
        dtype = meta["dtype"]
        if dtype not in DTYPES:
            raise ValueError(f"dtype {dtype!r} is not one of {', '.join(DTYPES)}")
        tokenizer = meta["tokenizer"]
        val = meta["val"]
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise ValueError(
            f"{option}={path!r}: {meta_path} is not a stagecheck token description ({error}): {hint}"
        ) from None
    tokenizer_file = os.path.join(folder, TOKENIZER_FILE) if tokenizer.get("file") else None
    val_path = os.path.join(folder, val["file"]) if val.get("tokens") else None
    return TokenFiles(
        dtype=np.dtype(dtype),
        vocab_size=int(tokenizer["vocab_size"]),
        tokenizer_kind=tokenizer["kind"],
        tokenizer_file=tokenizer_file,
        tokenizer_sha256=tokenizer.get("sha256"),
        eos_id=tokenizer.get("eos_id"),
        val_path=val_path,
        meta_path=meta_path,
        key=meta.get("key"),
    )
