"""The tokenizer of a run: bytes, a BPE trained on the corpus, or a user's tokenizer.json; saved with the run.

A run directory holds ``stagecheck_tokenizer.json`` ({"kind", "vocab_size"}) and, for kind "bpe", the Hugging
Face ``tokenizer.json`` itself, so generate.py and export_hf.py decode with the tokenizer that trained the model.
Kind "none" marks data with no text behind it (synthetic, or a memmap without data.tokenizer_file). A run
directory without the files predates them: its data was bytes.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from pathlib import Path

import tokenizers

from data.bpe import BPE_EOS_TOKEN, BPE_FORMAT, bpe_cache_path, ensure_bpe
from data.config import BYTE_VOCAB_SIZE, DataConfig, MemmapDataConfig, SyntheticDataConfig, TextDataConfig
from data.corpus import resolve_corpus
from data.eos import find_eos
from data.tokenizer_file import document_specials, file_digest, read_tokenizer_file

TOKENIZER_FILE = "tokenizer.json"
META_FILE = "stagecheck_tokenizer.json"
# How the bytes tokenizer's end-of-sequence id decodes (GPT-2's end-of-text token reads so too).
BYTES_EOS_TEXT = "<|endoftext|>"


class Tokenizer:
    """Text to token ids and back: one id per UTF-8 byte (kind "bytes"), or a Hugging Face tokenizer
    (kind "bpe": the BPE trained on the corpus, or data.tokenizer_file)."""

    def __init__(self, hf: tokenizers.Tokenizer | None = None, eos_id: int | None = None) -> None:
        self.hf = hf
        self.kind = "bytes" if hf is None else "bpe"
        # The bytes tokenizer of prepared data (prepare_data.py) ends documents with id 256, past the byte values;
        # data=text's has no such id, so model.vocab_size=256 presets keep fitting it.
        self.eos_id = eos_id
        if hf is None:
            self.vocab_size = BYTE_VOCAB_SIZE + (eos_id is not None)
            if eos_id not in (None, BYTE_VOCAB_SIZE):
                raise ValueError(f"the bytes tokenizer's end-of-sequence id is {BYTE_VOCAB_SIZE}, not {eos_id}")
        else:
            self.vocab_size = hf.get_vocab_size(with_added_tokens=True)
        # What the post-processor adds around a document (a BOS, or nothing): token files hold it, prompts start so.
        self.before_document, self.after_document = ([], []) if hf is None else document_specials(hf)
        self.eos_appended = eos_id is not None and self.after_document[-1:] != [eos_id]

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``; ValueError naming the characters this tokenizer cannot encode (bytes never
        fails: a lone surrogate becomes its three UTF-8-style bytes)."""
        if self.hf is None:
            return list(text.encode("utf-8", errors="surrogatepass"))
        try:
            encoding = self.hf.encode(text, add_special_tokens=False)
        except TypeError:  # the Rust side cannot take a str that is not valid Unicode
            raise ValueError(f"the text holds a lone surrogate, which the {self} cannot encode") from None
        unknown = _unencoded_characters(text, encoding, _unknown_id(self.hf))
        if unknown:
            raise ValueError(f"the {self} cannot encode the characters {''.join(unknown)!r} of the text")
        return encoding.ids

    def decode(self, ids: Iterable[int]) -> str:
        """The text of ``ids``; a byte sequence that is not UTF-8 decodes with U+FFFD in its place. ValueError
        for an id outside the vocabulary (a model with a bigger vocabulary may sample one: mask those logits)."""
        ids = list(ids)
        outside = [i for i in ids if not 0 <= i < self.vocab_size]
        if outside:
            raise ValueError(f"token id {outside[0]} is outside the {self}'s vocabulary [0, {self.vocab_size})")
        if self.hf is None:
            documents = _split_at(ids, self.eos_id)
            return BYTES_EOS_TEXT.join(bytes(d).decode("utf-8", errors="replace") for d in documents)
        return self.hf.decode(ids, skip_special_tokens=False)

    def __repr__(self) -> str:
        return f"{self.kind} tokenizer of {self.vocab_size} ids"


def _split_at(ids: list[int], separator: int | None) -> list[list[int]]:
    documents: list[list[int]] = [[]]
    for i in ids:
        if i == separator:
            documents.append([])
        else:
            documents[-1].append(i)
    return documents


def _unknown_id(hf: tokenizers.Tokenizer) -> int | None:
    token = getattr(hf.model, "unk_token", None)  # BPE, WordPiece, WordLevel; byte-level BPE has none
    return None if token is None else hf.token_to_id(token)


def _unencoded_characters(text: str, encoding: tokenizers.Encoding, unk_id: int | None) -> list[str]:
    """Characters that map to the unknown token or to no token at all (a tokenizer without byte fallback
    drops what its vocabulary lacks); whitespace may vanish by design."""
    covered = [False] * len(text)
    unknown = []
    for token_id, (start, end) in zip(encoding.ids, encoding.offsets):
        if unk_id is not None and token_id == unk_id:
            unknown.extend(text[start:end])
        for i in range(start, end):
            covered[i] = True
    unknown.extend(c for c, hit in zip(text, covered) if not hit and not c.isspace())
    return sorted(set(unknown))


def tokenizer_tag(config: TextDataConfig) -> str:
    """The tokenizer's identity in token cache names, so caches of different tokenizers never mix (a trained
    BPE is a function of the corpus, whose fingerprint the name holds too, its size and the recipe)."""
    if config.tokenizer == "bytes":
        return "bytes"
    if config.tokenizer_file is not None:
        return f"file-eos-{file_digest(config.tokenizer_file)[:16]}"  # "eos": files ended by its end-of-sequence id
    return f"{BPE_FORMAT}-{config.bpe_vocab_size}"


def open_tokenizer(config: DataConfig) -> Tokenizer:
    """The tokenizer the data is tokenized with, training the corpus's BPE first if no process has yet (safe to
    call on many ranks at once). ValueError for data that has none."""
    if isinstance(config, TextDataConfig):
        if config.tokenizer == "bytes":
            return Tokenizer()
        if config.tokenizer_file is not None:
            hf = read_tokenizer_file(config.tokenizer_file)
            eos = find_eos(hf, config.tokenizer_file)  # a tokenizer without one leaves the files unseparated
            return Tokenizer(hf, eos_id=None if eos is None else eos[1])
        files, corpus_fingerprint = resolve_corpus(config.path, config.cache_dir)
        path = bpe_cache_path(config.cache_dir, corpus_fingerprint, config.bpe_vocab_size)
        hf = ensure_bpe(files, path, config.bpe_vocab_size)
        return Tokenizer(hf, eos_id=hf.token_to_id(BPE_EOS_TOKEN))
    if isinstance(config, MemmapDataConfig):
        meta = config.files().meta
        if meta.tokenizer_kind == "bytes":
            return Tokenizer(eos_id=meta.eos_id)
        if meta.tokenizer_file is not None:
            return Tokenizer(read_tokenizer_file(meta.tokenizer_file, option=meta.meta_path), eos_id=meta.eos_id)
        if config.tokenizer_file is not None:
            return Tokenizer(read_tokenizer_file(config.tokenizer_file))
    raise ValueError(_no_tokenizer_reason(config))


def _no_tokenizer_reason(config: DataConfig) -> str:
    if isinstance(config, SyntheticDataConfig):
        return "the run trained on data=synthetic (random token ids): it has no tokenizer"
    return "the run trained on data=memmap without data.tokenizer_file: its tokenizer is unknown"


def save_tokenizer(tokenizer: Tokenizer, folder: Path) -> None:
    """Write ``folder/stagecheck_tokenizer.json`` and, for kind "bpe", ``folder/tokenizer.json``."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    if tokenizer.hf is not None:
        _write_atomic(folder / TOKENIZER_FILE, tokenizer.hf.to_str())
    else:
        (folder / TOKENIZER_FILE).unlink(missing_ok=True)  # an overwritten run's BPE must not outlive it
    meta = {"kind": tokenizer.kind, "vocab_size": tokenizer.vocab_size}
    if tokenizer.eos_id is not None:
        meta["eos_id"] = tokenizer.eos_id
    _write_atomic(folder / META_FILE, json.dumps(meta))


def save_run_tokenizer(config: DataConfig, folder: Path) -> None:
    """Save the tokenizer of ``config``'s data into the run directory ``folder`` (kind "none" when it has none)."""
    try:
        tokenizer = open_tokenizer(config)
    except ValueError as none:
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        (folder / TOKENIZER_FILE).unlink(missing_ok=True)
        _write_atomic(folder / META_FILE, json.dumps({"kind": "none", "vocab_size": None, "reason": str(none)}))
        return
    save_tokenizer(tokenizer, folder)


def load_tokenizer(folder: Path) -> Tokenizer:
    """The tokenizer saved in ``folder`` (a run directory or an exported one); bytes when it holds none of the
    files (runs older than them). ValueError when the run had no tokenizer or the files are damaged."""
    folder = Path(folder)
    meta_path = folder / META_FILE
    if not meta_path.exists():
        return Tokenizer()
    try:
        meta = json.loads(meta_path.read_text())
        kind = meta["kind"]
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise ValueError(f"{meta_path} is not a stagecheck tokenizer description ({error})") from None
    if kind == "none":
        raise ValueError(meta.get("reason", f"{folder} holds no tokenizer"))
    if kind == "bytes":
        return Tokenizer(eos_id=meta.get("eos_id"))
    if kind == "bpe":
        hf = read_tokenizer_file(str(folder / TOKENIZER_FILE), option=f"the run's {TOKENIZER_FILE}")
        return Tokenizer(hf, eos_id=meta.get("eos_id"))
    raise ValueError(f"{meta_path} names an unknown tokenizer kind {kind!r} (allowed: bytes, bpe, none)")


def _write_atomic(path: Path, text: str) -> None:
    # data/ imports nothing of harness/ (harness/files.py): a temp file renamed into place is enough here.
    tmp = path.with_name(f".{path.name}.tmp.{os.getpid()}")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)
