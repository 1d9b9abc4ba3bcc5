"""What a tokenizing worker process does with one chunk: parse its documents, encode each whole with the special
tokens its tokenizer's post-processor adds (a BOS, or nothing), append the end-of-sequence id after each (unless the
post-processor already ends it so), and route each document whole to the training or the validation tokens.

A worker's result depends on the chunk alone, never on which worker ran it or on what else it ran, so the output
is the same for any number of workers.
"""

from __future__ import annotations

import json
import signal
from dataclasses import dataclass

import numpy as np
import tokenizers

from data.documents import Chunk
from data.tokenizer_file import document_specials


@dataclass(frozen=True)
class EncoderSpec:
    """What every worker needs to encode: the tokenizer (a tokenizer.json's text; None for bytes), the id
    appended after each document (None: none), the token dtype, the JSONL field of the text, and how text files
    are read ("strict": UTF-8 or an error; "replace": invalid bytes become U+FFFD; "bytes": used as they are)."""

    tokenizer_json: str | None
    eos_id: int | None
    dtype: str
    text_field: str = "text"
    text_mode: str = "strict"


@dataclass
class Encoded:
    """One chunk's tokens (training and validation, in document order) and its counts."""

    train: np.ndarray  # (N_train,)
    val: np.ndarray  # (N_val,)
    train_documents: int = 0
    val_documents: int = 0
    empty_documents: int = 0
    input_bytes: int = 0


class ChunkEncoder:
    def __init__(self, spec: EncoderSpec) -> None:
        self.spec = spec
        self.dtype = np.dtype(spec.dtype)
        self.hf = None if spec.tokenizer_json is None else tokenizers.Tokenizer.from_str(spec.tokenizer_json)
        after = [] if self.hf is None else document_specials(self.hf)[1]
        appended = spec.eos_id is not None and after[-1:] != [spec.eos_id]
        self.eos = np.array([spec.eos_id] if appended else [], dtype=self.dtype)

    def encode(self, chunk: Chunk, val_documents: frozenset[int]) -> Encoded:
        """The tokens of ``chunk``; documents whose index is in ``val_documents`` go to the validation tokens."""
        texts = self._texts(chunk)  # one per document of the chunk
        ids = self._encode_texts([t for t in texts if t])
        train, val = [], []
        out = Encoded(train=self.eos[:0], val=self.eos[:0])
        out.input_bytes = len(chunk.payload) if chunk.kind != "rows" else sum(len(_utf8(t)) for t in texts)
        tokens = iter(ids)
        for offset, text in enumerate(texts):
            to_val = chunk.first_document + offset in val_documents
            if not text:
                out.empty_documents += 1
                continue
            (val if to_val else train).extend((next(tokens), self.eos))
            if to_val:
                out.val_documents += 1
            else:
                out.train_documents += 1
        out.train = np.concatenate(train) if train else out.train
        out.val = np.concatenate(val) if val else out.val
        return out

    def _texts(self, chunk: Chunk) -> list:
        if chunk.kind == "rows":
            return [text or "" for text in chunk.payload]
        if chunk.kind == "jsonl":
            return self._jsonl_texts(chunk)
        return [self._file_text(chunk)]

    def _jsonl_texts(self, chunk: Chunk) -> list[str]:
        field = self.spec.text_field
        lines = chunk.payload.split(b"\n")
        if chunk.payload.endswith(b"\n"):
            lines.pop()
        texts = []
        for number, line in enumerate(lines, start=chunk.start):
            where = f"{chunk.path}:{number}"
            if not line.strip():
                texts.append("")
                continue
            try:
                record = json.loads(line)
            except UnicodeDecodeError as error:
                raise ValueError(f"{where}: the line is not UTF-8 ({error.reason} at byte {error.start})") from None
            except json.JSONDecodeError as error:
                raise ValueError(f"{where}: malformed JSON at column {error.colno} ({error.msg})") from None
            if not isinstance(record, dict):
                raise ValueError(f"{where}: the line holds a JSON {type(record).__name__}, not an object")
            if field not in record:
                raise ValueError(
                    f"{where}: the record has no field {field!r} (fields: {', '.join(record)}): set text_field to the "
                    f"field that holds the text"
                )
            text = record[field]
            if not isinstance(text, str) and text is not None:
                raise ValueError(f"{where}: field {field!r} holds a {type(text).__name__}, not a string")
            texts.append(text or "")
        return texts

    def _file_text(self, chunk: Chunk) -> str | bytes:
        raw = chunk.payload
        if self.spec.text_mode == "bytes" and self.hf is None:
            return raw  # the bytes tokenizer reads any file as it is
        if self.spec.text_mode != "strict":
            return raw.decode("utf-8", errors="replace")
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as error:
            line = chunk.start + raw.count(b"\n", 0, error.start)
            raise ValueError(
                f"{chunk.path}:{line}: the file is not UTF-8 text ({error.reason} at byte {error.start}): convert it "
                f"to UTF-8 or leave it out of the input"
            ) from None

    def _encode_texts(self, texts: list) -> list[np.ndarray]:
        if self.hf is None:
            return [np.frombuffer(_utf8(t), dtype=np.uint8).astype(self.dtype) for t in texts]
        # The fast variant skips the character offsets, which only a prompt's check needs. The post-processor decides
        # the special tokens around a document, as tokenizer.encode(document) adds them.
        encodings = self.hf.encode_batch_fast(texts, add_special_tokens=True)
        return [np.asarray(e.ids, dtype=self.dtype) for e in encodings]


def _utf8(text: str | bytes) -> bytes:
    return text if isinstance(text, bytes) else text.encode("utf-8", errors="surrogatepass")


# One encoder per worker process, built once by the pool's initializer.
_ENCODER: ChunkEncoder | None = None


def init_worker(spec: EncoderSpec) -> None:
    global _ENCODER
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # the pool ends its workers with SIGTERM: no clean-up to run
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group: the parent ends the pool
    _ENCODER = ChunkEncoder(spec)


def encode_in_worker(chunk: Chunk, val_documents: frozenset[int]) -> Encoded:
    return _ENCODER.encode(chunk, val_documents)
