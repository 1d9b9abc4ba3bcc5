"""Documents of a corpus, read as a stream of chunks: JSONL lines, Parquet rows, rows of a dataset saved with
`datasets`, or text files. The main process only reads (cheap); workers parse and tokenize (data/encode_worker.py).

Every document has an index (its line, row or file, counted over the whole input in order), which the validation
split draws from, and a place (file and line or row) that error messages name. Chunks of JSONL and rows hold about
CHUNK_BYTES of input, so memory stays flat however big the corpus is; a chunk never cuts a document, and a text file
(one document) is one chunk, whole.

Why whole documents: a tokenizer encodes a cut text as the whole text only for some tokenizers and some cuts.
Metaspace tokenizers (Llama 2, Mistral) prepend `▁` to every string they encode; a byte-level BPE with GPT-2's
pattern tokenizes "x\n\ndef" as "\n", "\n", "def" but a piece ending in "x\n\n" as one "\n\n"; a BPE without a
pre-tokenizer, or a normalizer, may join anything across a cut. Proving a cut safe needs the tokenizer's whole
pipeline, and checking it needs the text across the cut encoded anyway; so nothing is cut. The price is memory: a
worker holds one text file and its ids at a time (docs/data.md).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass

# Input read per chunk (bytes of JSONL; Parquet and dataset rows go by ROWS_PER_CHUNK; a text file is one chunk).
CHUNK_BYTES = 1 << 20
ROWS_PER_CHUNK = 1024


@dataclass(frozen=True)
class Chunk:
    """Consecutive documents of one file.

    kind "jsonl": ``payload`` is whole lines of JSON (bytes), ``start`` the 1-based number of the first line;
    kind "rows": ``payload`` is a list of texts (None: no value), ``start`` the 0-based number of the first row;
    kind "text": ``payload`` is one text file's bytes (one document), ``start`` 1.
    """

    kind: str
    path: str
    start: int
    first_document: int
    payload: bytes | list

    @property
    def documents(self) -> int:
        """How many documents the chunk holds."""
        if self.kind == "jsonl":
            return _line_count(self.payload)
        if self.kind == "rows":
            return len(self.payload)
        return 1

    @property
    def size(self) -> int:
        """Its input's size in bytes (for rows, the characters of its texts): what holding it in flight costs."""
        if self.kind == "rows":
            return sum(len(text or "") for text in self.payload)
        return len(self.payload)


def _line_count(raw: bytes) -> int:
    return raw.count(b"\n") + (1 if raw and not raw.endswith(b"\n") else 0)


def jsonl_chunks(paths: tuple[str, ...]) -> Iterator[Chunk]:
    document = 0
    for path in paths:
        line = 1
        for block in _line_blocks(path):
            chunk = Chunk("jsonl", path, line, document, block)
            yield chunk
            line += chunk.documents
            document += chunk.documents


def count_jsonl_documents(paths: tuple[str, ...]) -> int:
    return sum(_line_count(block) for path in paths for block in _line_blocks(path))


def _line_blocks(path: str) -> Iterator[bytes]:
    """The file in blocks of about CHUNK_BYTES that end after a newline (the last may end without one)."""
    rest = b""
    with open(path, "rb") as handle:
        while block := handle.read(CHUNK_BYTES):
            block = rest + block
            cut = block.rfind(b"\n") + 1
            if cut == 0:
                rest = block  # one line longer than a block: keep reading it
                continue
            rest = block[cut:]
            yield block[:cut]
    if rest:
        yield rest


def parquet_chunks(paths: tuple[str, ...], field: str) -> Iterator[Chunk]:
    import pyarrow.parquet as pq  # pyarrow loads in about 0.3 s: only for Parquet input

    document = 0
    for path in paths:
        parquet = pq.ParquetFile(path)
        row = 0
        for batch in parquet.iter_batches(batch_size=ROWS_PER_CHUNK, columns=[field]):
            texts = batch.column(0).to_pylist()
            yield Chunk("rows", path, row, document, texts)
            row += len(texts)
            document += len(texts)


def check_parquet_files(paths: tuple[str, ...], field: str) -> int:
    """The row count of the files; ValueError naming the file without a string column ``field``."""
    import pyarrow as pa  # see parquet_chunks
    import pyarrow.parquet as pq

    rows = 0
    for path in paths:
        try:
            schema = pq.read_schema(path)
            rows += pq.read_metadata(path).num_rows
        except (OSError, pa.ArrowException) as error:
            raise ValueError(f"input file {path} is not a readable Parquet file ({error})") from None
        _check_column(path, schema.names, field, schema.field(field).type if field in schema.names else None, pa)
    return rows


def dataset_chunks(dataset, path: str, field: str) -> Iterator[Chunk]:
    row = 0
    for batch in dataset.select_columns([field]).iter(batch_size=ROWS_PER_CHUNK):
        texts = batch[field]
        yield Chunk("rows", path, row, row, texts)
        row += len(texts)


def load_dataset_from_disk(path: str, split: str, field: str):
    """The dataset `datasets.save_to_disk` wrote at ``path`` (for a DatasetDict, its ``split``); ValueError naming
    the option to change."""
    import datasets  # datasets loads in about 2 s: only for its own input
    import pyarrow as pa

    try:
        loaded = datasets.load_from_disk(path)
    except (FileNotFoundError, ValueError, OSError) as error:
        raise ValueError(f"input={path!r} is not a dataset saved by datasets' save_to_disk ({error})") from None
    if isinstance(loaded, datasets.DatasetDict):
        if split not in loaded:
            raise ValueError(f"split={split!r} is not a split of the dataset at {path}: allowed are {sorted(loaded)}")
        loaded = loaded[split]
    names = loaded.column_names
    _check_column(path, names, field, loaded.data.schema.field(field).type if field in names else None, pa)
    return loaded


def _check_column(path: str, names: list[str], field: str, field_type, pa) -> None:
    if field not in names:
        raise ValueError(
            f"{path} has no column {field!r} (columns: {', '.join(names)}): set text_field to the column of the text"
        )
    if not (pa.types.is_string(field_type) or pa.types.is_large_string(field_type)):
        raise ValueError(
            f"{path}: column {field!r} holds {field_type}, not text: set text_field to a column of strings"
        )


def text_chunks(paths: tuple[str, ...]) -> Iterator[Chunk]:
    """Each file is one document, read whole (see the module's docstring for why it is never cut)."""
    for document, path in enumerate(paths):
        with open(path, "rb") as handle:
            yield Chunk("text", path, 1, document, handle.read())


def list_input_files(path: str, suffixes: tuple[str, ...] | None) -> tuple[str, ...]:
    """``path`` itself, or the non-hidden files under the folder ``path`` (those ending in one of ``suffixes``
    when given), in sorted path order."""
    absolute = os.path.abspath(path)
    if os.path.isfile(absolute):
        return (absolute,)
    found = []
    for folder, dirnames, filenames in os.walk(absolute):
        dirnames[:] = [d for d in dirnames if not d.startswith(".")]
        for name in filenames:
            if name.startswith(".") or (suffixes is not None and not name.endswith(suffixes)):
                continue
            if os.path.isfile(os.path.join(folder, name)):
                found.append(os.path.join(folder, name))
    return tuple(sorted(found))
