"""Minimal reader for wandb's offline transaction log (``run-<id>.wandb``).

Format (checked against wandb 0.31.0 files, which wandb-core writes):

* A 7-byte file header: b":W&B", uint16 LE magic 0xBEE1, uint8 version (0).
* Then a LevelDB-style log: the file is cut into 32 KiB blocks, counted from
  offset 0 of the file (so the first block holds the header too). Each chunk
  has a 7-byte header ``<crc32: u32 LE><length: u16 LE><type: u8>``; types are
  1=full, 2=first, 3=middle, 4=last. A block tail shorter than 7 bytes is
  zero padding.
* The CRC is plain (unmasked) IEEE CRC-32 over the type byte followed by the
  payload, i.e. ``zlib.crc32(payload, zlib.crc32(bytes([type])))``.
* Reassembled payloads are ``wandb_internal_pb2.Record`` messages.
"""

from __future__ import annotations

import json
import os
import struct
import zlib
from pathlib import Path
from typing import Any

from wandb.proto.wandb_internal_pb2 import Record

FILE_HEADER = struct.Struct("<4sHB")
FILE_IDENT, FILE_MAGIC, FILE_VERSION = b":W&B", 0xBEE1, 0
CHUNK_HEADER = struct.Struct("<IHB")
BLOCK_SIZE = 32 * 1024
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


class CorruptWandbFile(ValueError):
    """The file is not a well-formed wandb transaction log."""


def find_run_files(root: Path) -> list[Path]:
    """All ``run-*.wandb`` files under ``root``, sorted by path.

    The ``wandb/latest-run`` symlink is skipped so each run appears once.
    """
    found: list[Path] = []
    for dirpath, _dirs, files in os.walk(root):  # does not follow symlinks
        found += [Path(dirpath, f) for f in files if f.startswith("run-") and f.endswith(".wandb")]
    return sorted(found)


def read_records(path: Path | str) -> list[Record]:
    """Every record in the file, in write order; raises CorruptWandbFile."""
    data = Path(path).read_bytes()
    if len(data) < FILE_HEADER.size:
        raise CorruptWandbFile(f"{path}: too short for a file header")
    ident, magic, version = FILE_HEADER.unpack_from(data)
    if (ident, magic, version) != (FILE_IDENT, FILE_MAGIC, FILE_VERSION):
        raise CorruptWandbFile(f"{path}: bad file header {data[:7]!r}")

    records: list[Record] = []
    pending: bytearray | None = None  # payload of a record split across chunks
    pos = FILE_HEADER.size
    while pos < len(data):
        block_left = BLOCK_SIZE - pos % BLOCK_SIZE
        if block_left < CHUNK_HEADER.size:
            # The writer zero-pads a block tail too small for a chunk header.
            if data[pos : pos + block_left].strip(b"\0"):
                raise CorruptWandbFile(f"{path}@{pos}: non-zero block padding")
            pos += block_left
            continue
        if len(data) - pos < CHUNK_HEADER.size:
            raise CorruptWandbFile(f"{path}@{pos}: truncated chunk header")
        crc, length, kind = CHUNK_HEADER.unpack_from(data, pos)
        start, end = pos + CHUNK_HEADER.size, pos + CHUNK_HEADER.size + length
        if end > len(data) or length > block_left - CHUNK_HEADER.size:
            raise CorruptWandbFile(f"{path}@{pos}: chunk overruns block/file")
        payload = data[start:end]
        if zlib.crc32(payload, zlib.crc32(bytes([kind]))) != crc:
            raise CorruptWandbFile(f"{path}@{pos}: CRC mismatch")
        pos = end

        if kind == FULL and pending is None:
            records.append(_parse(payload, path, pos))
        elif kind == FIRST and pending is None:
            pending = bytearray(payload)
        elif kind in (MIDDLE, LAST) and pending is not None:
            pending += payload
            if kind == LAST:
                records.append(_parse(bytes(pending), path, pos))
                pending = None
        else:
            raise CorruptWandbFile(f"{path}@{pos}: unexpected chunk type {kind}")
    if pending is not None:
        raise CorruptWandbFile(f"{path}: file ends inside a record")
    return records


def _parse(payload: bytes, path: Path | str, pos: int) -> Record:
    record = Record()
    try:
        record.ParseFromString(payload)
    except Exception as e:  # protobuf raises its own DecodeError
        raise CorruptWandbFile(f"{path}@{pos}: bad protobuf: {e}") from e
    return record


def _key_path(item: Any) -> list[str]:
    # wandb-core writes either `key` or `nested_key` (a path); a one-element
    # nested_key is just a top-level key.
    return list(item.nested_key) or [item.key]


def _set_path(target: dict[str, Any], path: list[str], value: Any) -> None:
    for part in path[:-1]:
        child = target.get(part)
        if not isinstance(child, dict):
            child = target[part] = {}
        target = child
    target[path[-1]] = value


def _del_path(target: dict[str, Any], path: list[str]) -> None:
    for part in path[:-1]:
        target = target.get(part)
        if not isinstance(target, dict):
            return
    target.pop(path[-1], None)


def _history_value(item: Any) -> Any:
    # HistoryItem has a typed `value` oneof besides value_json; 0.31.0 only
    # fills value_json, but honour the typed fields if a writer uses them.
    which = item.WhichOneof("value")
    if which is None:
        return json.loads(item.value_json)
    if which == "none":
        return None
    if which == "json":
        return json.loads(item.json)
    return getattr(item, which)


def history(path: Path | str) -> list[dict[str, Any]]:
    """One dict per history row (wandb.log step), including `_step`,
    `_runtime` and `_timestamp`. Nested keys become nested dicts."""
    rows = []
    for record in read_records(path):
        if record.WhichOneof("record_type") == "history":
            row: dict[str, Any] = {}
            for item in record.history.item:
                _set_path(row, _key_path(item), _history_value(item))
            rows.append(row)
    return rows


def _apply(target: dict[str, Any], update: Any, remove: Any) -> None:
    for item in update:
        _set_path(target, _key_path(item), json.loads(item.value_json))
    for item in remove:
        _del_path(target, _key_path(item))


def _merged(path: Path | str, part: str) -> dict[str, Any]:
    """The run record's `part` (config or summary), then its update/remove records, in order."""
    result: dict[str, Any] = {}
    for record in read_records(path):
        kind = record.WhichOneof("record_type")
        if kind in ("run", part):
            changes = getattr(record.run if kind == "run" else record, part)
            _apply(result, changes.update, changes.remove)
    return result


def config(path: Path | str, *, internal: bool = False) -> dict[str, Any]:
    """Run config: the run record's config, then config records, in order.

    Values are stored as plain JSON (no {"value": ...} wrapper as in the old
    config.yaml). wandb's bookkeeping key `_wandb` is dropped unless
    `internal` is set.
    """
    result = _merged(path, "config")
    if not internal:
        result.pop("_wandb", None)
    return result


def summary(path: Path | str) -> dict[str, Any]:
    """Final summary: summary updates/removes applied in order.

    wandb-core writes a summary update after every history row, so this
    holds the last logged value of each key plus explicit run.summary sets.
    """
    return _merged(path, "summary")


def run_info(path: Path | str) -> dict[str, Any]:
    """Identity fields from the (first) run record."""
    for record in read_records(path):
        if record.WhichOneof("record_type") == "run":
            run = record.run
            return {
                "id": run.run_id,
                "project": run.project,
                "entity": run.entity,
                "group": run.run_group,
                "job_type": run.job_type,
                "tags": list(run.tags),
                "name": run.display_name,
                "resumed": run.resumed,
                "starting_step": run.starting_step,
                "start_time": run.start_time.ToDatetime(),
            }
    raise CorruptWandbFile(f"{path}: no run record")
