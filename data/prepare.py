"""prepare_data.py's work: a corpus in, a folder of token files out (train.bin, val.bin, stagecheck_data.json and
the tokenizer.json), written atomically.

Everything that can be checked before tokenizing is checked first, before any file is written (`plan_prepare`). The
output is built in a hidden folder beside `out` and renamed into place once complete, so an interrupted run leaves
no `out` for a training run to read; a rerun with the same inputs and options finds `out` finished and reuses it.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import socket
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from data.documents import (
    Chunk,
    check_parquet_files,
    count_jsonl_documents,
    dataset_chunks,
    jsonl_chunks,
    list_input_files,
    load_dataset_from_disk,
    parquet_chunks,
    text_chunks,
)
from data.encode_worker import EncoderSpec
from data.eos import find_eos
from data.prepare_config import SUFFIXES, PrepareDataConfig
from data.token_files import META_FILE, TOKENIZER_FILE, TOKENS_FORMAT, TRAIN_FILE, VAL_FILE, token_dtype
from data.tokenize_pool import TokenCounts, default_workers, tokenize_chunks
from data.tokenizer import Tokenizer
from data.tokenizer_file import file_digest, read_tokenizer_file

# The options that decide the output (workers do not: every count gives the same bytes).
_OUTPUT_OPTIONS = ("format", "text_field", "split", "eos_token", "val_fraction", "val_count", "seed")


@dataclass
class PreparePlan:
    """What a prepare will read and write, settled before any file is written."""

    config: PrepareDataConfig
    format: str
    files: tuple[str, ...]
    documents: int
    tokenizer: Tokenizer
    tokenizer_path: str | None
    eos_token: str
    val_documents: np.ndarray  # (K,) sorted document indices held out for validation
    key: str
    dataset: object = None  # the loaded `datasets` dataset, for format=dataset

    @property
    def spec(self) -> EncoderSpec:
        tokenizer_json = None if self.tokenizer.hf is None else self.tokenizer.hf.to_str()
        dtype = token_dtype(self.tokenizer.vocab_size).name
        return EncoderSpec(tokenizer_json, self.tokenizer.eos_id, dtype, self.config.text_field, "strict")


def plan_prepare(config: PrepareDataConfig) -> PreparePlan:
    """Check every option and the corpus's layout; ValueError naming what to change. Writes nothing."""
    config.validate()
    input_format = config.input_format()
    tokenizer, tokenizer_path, eos_token = _open_tokenizer(config)
    dataset = None
    if input_format == "dataset":
        dataset = load_dataset_from_disk(config.input, config.split, config.text_field)
        files = list_input_files(config.input, None)
        documents = len(dataset)
    else:
        files = list_input_files(config.input, SUFFIXES[input_format])
        if not files:
            raise ValueError(f"input={config.input!r} holds no {input_format} files: give a corpus file or folder")
        documents = _count_documents(input_format, files, config.text_field)
    if documents == 0:
        raise ValueError(f"input={config.input!r} is empty: it holds no {input_format} documents")
    val_documents = _choose_val_documents(config, documents)
    key = _output_key(config, input_format, files, tokenizer, tokenizer_path, eos_token)
    return PreparePlan(
        config, input_format, files, documents, tokenizer, tokenizer_path, eos_token, val_documents, key, dataset
    )


def prepare(config: PrepareDataConfig) -> str:
    """Prepare the corpus of ``config`` (or find it prepared); returns the summary to print."""
    config.validate()
    out = os.path.abspath(config.out)
    if not os.path.exists(os.path.join(out, META_FILE)):
        _check_out_is_free(out)  # before the corpus is read: only a finished prepare might be reused
    plan = plan_prepare(config)
    if _finished(out, plan.key):
        return f"{out} already holds this corpus prepared with these options: reusing it\n{_describe(out)}"
    _check_out_is_free(out)
    _remove_stale_builds(out)
    tmp = os.path.join(
        os.path.dirname(out), f"{_build_prefix(out)}{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    )
    os.makedirs(tmp)
    try:
        counts = _write(plan, tmp)
        if counts.train_documents == 0:
            raise ValueError(f"input={config.input!r} holds only empty documents ({counts.empty_documents})")
        _write_meta(plan, counts, tmp)
        os.replace(tmp, out)  # an empty `out` is replaced whole; a non-empty one was refused above
    finally:
        if os.path.exists(tmp):
            shutil.rmtree(tmp)
    return _describe(out) + f"\n{_speed(counts)}"


def _open_tokenizer(config: PrepareDataConfig) -> tuple[Tokenizer, str | None, str]:
    if config.tokenizer == "bytes":
        if config.eos_token is not None:
            raise ValueError(f"eos_token={config.eos_token!r} needs a tokenizer.json: the bytes tokenizer's is id 256")
        return Tokenizer(eos_id=256), None, "<|endoftext|>"
    path = config.tokenizer
    if os.path.isdir(path):
        path = os.path.join(path, TOKENIZER_FILE)
    hf = read_tokenizer_file(path, option="tokenizer")
    eos = find_eos(hf, path, config.eos_token)
    if eos is None:
        raise ValueError(
            f"tokenizer={config.tokenizer!r} names no end-of-sequence token (no tokenizer_config.json beside it, and "
            f"none of the usual names): set eos_token to the token that ends a document"
        )
    return Tokenizer(hf, eos_id=eos[1]), os.path.abspath(path), eos[0]


def _count_documents(input_format: str, files: tuple[str, ...], field: str) -> int:
    if input_format == "jsonl":
        return count_jsonl_documents(files)
    if input_format == "parquet":
        return check_parquet_files(files, field)
    return len(files)


def _choose_val_documents(config: PrepareDataConfig, documents: int) -> np.ndarray:
    count = config.val_count if config.val_count is not None else round(config.val_fraction * documents)
    if count >= documents:
        option = (
            f"val_count={config.val_count}" if config.val_count is not None else f"val_fraction={config.val_fraction}"
        )
        raise ValueError(
            f"{option} holds out {count} of the input's {documents} documents, leaving none to train on: hold out fewer"
        )
    rng = np.random.default_rng(config.seed)
    return np.sort(rng.choice(documents, size=count, replace=False))  # (K,)


def _chunks(plan: PreparePlan) -> Iterator[Chunk]:
    if plan.format == "jsonl":
        return jsonl_chunks(plan.files)
    if plan.format == "parquet":
        return parquet_chunks(plan.files, plan.config.text_field)
    if plan.format == "dataset":
        return dataset_chunks(plan.dataset, os.path.abspath(plan.config.input), plan.config.text_field)
    return text_chunks(plan.files)


def _val_of(val_documents: np.ndarray):
    def of(chunk: Chunk) -> frozenset[int]:
        end = chunk.first_document + max(chunk.documents, 1)
        lo, hi = np.searchsorted(val_documents, [chunk.first_document, end])
        return frozenset(int(d) for d in val_documents[lo:hi])

    return of


def _write(plan: PreparePlan, tmp: str) -> TokenCounts:
    workers = plan.config.workers or default_workers()
    with open(os.path.join(tmp, TRAIN_FILE), "wb") as train, open(os.path.join(tmp, VAL_FILE), "wb") as val:
        counts = tokenize_chunks(
            _chunks(plan), plan.spec, workers, train, val, _val_of(plan.val_documents), plan.documents, "prepare"
        )
        for handle in (train, val):
            handle.flush()
            os.fsync(handle.fileno())  # durable before the rename publishes them
    if plan.tokenizer_path is not None:
        shutil.copyfile(plan.tokenizer_path, os.path.join(tmp, TOKENIZER_FILE))
    return counts


def _write_meta(plan: PreparePlan, counts: TokenCounts, tmp: str) -> None:
    tokenizer = plan.tokenizer
    meta = {
        "format": TOKENS_FORMAT,
        "dtype": token_dtype(tokenizer.vocab_size).name,
        "tokenizer": {
            "kind": tokenizer.kind,
            "vocab_size": tokenizer.vocab_size,
            "eos_id": tokenizer.eos_id,
            "eos_token": plan.eos_token,
            # The tokenizer's post-processor decides what surrounds a document (tokenizer.encode(document)).
            "before_document": tokenizer.before_document,
            "after_document": tokenizer.after_document,
            "eos_appended": tokenizer.eos_appended,
            "file": TOKENIZER_FILE if plan.tokenizer_path is not None else None,
            "sha256": file_digest(plan.tokenizer_path) if plan.tokenizer_path is not None else None,
            "source": plan.tokenizer_path,
        },
        "train": {"file": TRAIN_FILE, "tokens": counts.train_tokens, "documents": counts.train_documents},
        "val": {"file": VAL_FILE, "tokens": counts.val_tokens, "documents": counts.val_documents},
        "empty_documents": counts.empty_documents,
        "input_bytes": counts.input_bytes,
        "source": {
            "input": os.path.abspath(plan.config.input),
            "files": len(plan.files),
            "documents": plan.documents,
            "fingerprint": source_fingerprint(plan.files),
        },
        "options": {name: getattr(plan.config, name) for name in _OUTPUT_OPTIONS} | {"format": plan.format},
        "key": plan.key,
    }
    with open(os.path.join(tmp, META_FILE), "w", encoding="utf-8") as handle:
        json.dump(meta, handle, indent=2)
        handle.write("\n")
        handle.flush()
        os.fsync(handle.fileno())


def _output_key(config, input_format, files, tokenizer: Tokenizer, tokenizer_path, eos_token) -> str:
    """Changes when anything the output depends on changes: the files (paths, sizes, mtimes), the tokenizer's
    bytes, the options (not `workers`) and the format of the files."""
    identity = {
        "format": TOKENS_FORMAT,
        "source": source_fingerprint(files),
        "tokenizer": file_digest(tokenizer_path) if tokenizer_path else tokenizer.kind,
        "eos": [eos_token, tokenizer.eos_id],
        "options": {name: getattr(config, name) for name in _OUTPUT_OPTIONS} | {"format": input_format},
    }
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()


def source_fingerprint(files: tuple[str, ...]) -> str:
    """SHA-256 of the input files' paths, sizes and modification times: cheap, and changes when any file does."""
    entries = [[path, os.stat(path).st_size, os.stat(path).st_mtime_ns] for path in files]
    return hashlib.sha256(json.dumps(entries).encode()).hexdigest()


def _finished(out: str, key: str) -> bool:
    try:
        with open(os.path.join(out, META_FILE), encoding="utf-8") as handle:
            return json.load(handle).get("key") == key
    except (OSError, ValueError, AttributeError):
        return False


def _build_prefix(out: str) -> str:
    return f".{os.path.basename(out)}.tmp-"


def _remove_stale_builds(out: str) -> None:
    """Remove what a killed prepare of ``out`` on this host left (SIGKILL runs no clean-up): a build folder whose
    process is gone."""
    parent, prefix = os.path.dirname(out), _build_prefix(out)
    for entry in os.listdir(parent) if os.path.isdir(parent) else []:
        if not entry.startswith(prefix):
            continue
        host, pid, _ = entry[len(prefix) :].rsplit("-", 2)
        if host == socket.gethostname() and pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(os.path.join(parent, entry), ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's live process
    return True


def _check_out_is_free(out: str) -> None:
    if os.path.isdir(out) and os.listdir(out):
        held = ", ".join(sorted(os.listdir(out))[:5])
        raise ValueError(
            f"out={out!r} holds other files ({held}): give a new or empty folder (prepare_data.py never overwrites)"
        )


def _describe(out: str) -> str:
    with open(os.path.join(out, META_FILE), encoding="utf-8") as handle:
        meta = json.load(handle)
    train, val, tokenizer = meta["train"], meta["val"], meta["tokenizer"]
    return (
        f"prepared {out}: train {train['tokens']:,} tokens ({train['documents']:,} documents), validation "
        f"{val['tokens']:,} tokens ({val['documents']:,} documents), {meta['empty_documents']:,} empty documents "
        f"skipped; {meta['dtype']}, {tokenizer['kind']} tokenizer of {tokenizer['vocab_size']:,} ids, "
        f"{_document_frame(tokenizer)}"
    )


def _document_frame(tokenizer: dict) -> str:
    before = f"ids {tokenizer['before_document']} before and " if tokenizer["before_document"] else ""
    return f"{before}{tokenizer['eos_token']} (id {tokenizer['eos_id']}) after every document"


def _speed(counts: TokenCounts) -> str:
    seconds = max(counts.seconds, 1e-9)
    tokens = counts.train_tokens + counts.val_tokens
    return (
        f"tokenized {counts.input_bytes / 1e6:,.1f} MB in {counts.seconds:.1f} s with {counts.workers} workers: "
        f"{counts.input_bytes / 1e6 / seconds:,.2f} MB/s, {tokens / seconds:,.0f} tokens/s"
    )
