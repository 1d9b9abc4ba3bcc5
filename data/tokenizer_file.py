"""A user's own ``tokenizer.json`` (the Hugging Face ``tokenizers`` format, e.g. GPT-2's): read and identified."""

from __future__ import annotations

import hashlib
import os

import tokenizers


def read_tokenizer_file(path: str, option: str = "data.tokenizer_file") -> tokenizers.Tokenizer:
    """Load ``path``; ValueError naming ``option`` when it is missing, unreadable or not a tokenizer.json (any
    vocabulary size: token files are uint32 when uint16 is too small)."""
    hint = f"set {option} to a tokenizer.json written by the Hugging Face tokenizers library"
    if not os.path.isfile(path):
        raise ValueError(f"{option}={path!r} is not an existing file: {hint}")
    if not os.access(path, os.R_OK):
        raise ValueError(f"{option}={path!r} is not readable by this user: {hint}")
    try:
        tokenizer = tokenizers.Tokenizer.from_file(path)
    except Exception as error:  # the Rust side raises a bare Exception for every parse error
        raise ValueError(f"{option}={path!r} is not a valid tokenizer.json ({error}): {hint}") from None
    return tokenizer


def file_digest(path: str) -> str:
    """SHA-256 of the file's bytes: the tokenizer's identity in cache names."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def document_specials(tokenizer: tokenizers.Tokenizer) -> tuple[list[int], list[int]]:
    """The ids the tokenizer's post-processor puts before and after every text it encodes with its special tokens
    (Llama 3's ``<|begin_of_text|>`` before; nothing for GPT-2's byte-level BPE). ValueError when the
    post-processor does more than add ids around the text."""
    plain = tokenizer.encode("a", add_special_tokens=False).ids
    full = tokenizer.encode("a", add_special_tokens=True).ids
    for start in range(len(full) - len(plain) + 1):
        if full[start : start + len(plain)] == plain:
            return full[:start], full[start + len(plain) :]
    raise ValueError(f"the tokenizer's post-processor turns 'a' ({plain}) into {full}, not ids added around it")
