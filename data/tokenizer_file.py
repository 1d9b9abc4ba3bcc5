"""A user's own ``tokenizer.json`` (the Hugging Face ``tokenizers`` format, e.g. GPT-2's): read and identified."""

from __future__ import annotations

import hashlib
import os

import tokenizers

# Token files store uint16, so no tokenizer with a bigger vocabulary fits.
MAX_UINT16_VOCAB_SIZE = 65536


def read_tokenizer_file(path: str, option: str = "data.tokenizer_file") -> tokenizers.Tokenizer:
    """Load ``path``; ValueError naming ``option`` when it is missing, unreadable, not a tokenizer.json, or has
    more ids than uint16 token files hold."""
    hint = f"set {option} to a tokenizer.json written by the Hugging Face tokenizers library"
    if not os.path.isfile(path):
        raise ValueError(f"{option}={path!r} is not an existing file: {hint}")
    if not os.access(path, os.R_OK):
        raise ValueError(f"{option}={path!r} is not readable by this user: {hint}")
    try:
        tokenizer = tokenizers.Tokenizer.from_file(path)
    except Exception as error:  # the Rust side raises a bare Exception for every parse error
        raise ValueError(f"{option}={path!r} is not a valid tokenizer.json ({error}): {hint}") from None
    size = tokenizer.get_vocab_size(with_added_tokens=True)
    if size > MAX_UINT16_VOCAB_SIZE:
        raise ValueError(
            f"{option}={path!r} has {size} token ids, more than the {MAX_UINT16_VOCAB_SIZE} a uint16 token file "
            f"holds: use a tokenizer with at most {MAX_UINT16_VOCAB_SIZE} ids"
        )
    return tokenizer


def file_digest(path: str) -> str:
    """SHA-256 of the file's bytes: the tokenizer's identity in cache names."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()
