"""Files a kill at any moment cannot leave half-written: readers see the old content or the new, never a mix
or nothing (write a temporary file, fsync it, rename it over the target, fsync the directory)."""

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any


def fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _written_beside(path: Path, write: Callable[[IO], Any], binary: bool = False) -> Path:
    """A temporary file beside `path`, written by `write` and on disk."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "wb" if binary else "w") as handle:
        write(handle)
        handle.flush()
        os.fsync(handle.fileno())
    return tmp


def atomic_write(path: Path, write: Callable[[IO], Any], binary: bool = False) -> None:
    os.replace(_written_beside(path, write, binary), path)
    fsync_path(path.parent)


def atomic_write_text(path: Path, text: str) -> None:
    atomic_write(path, lambda handle: handle.write(text))


def atomic_write_json(path: Path, data: Any) -> None:
    atomic_write_text(path, json.dumps(data, indent=2) + "\n")


def write_json_once(path: Path, data: Any) -> bool:
    """Write `path` complete unless it exists: False when another process wrote it first (its content stands, so
    every reader of the path, at any moment, reads the same bytes)."""
    text = json.dumps(data, indent=2) + "\n"
    tmp = _written_beside(path, lambda handle: handle.write(text))
    try:
        os.link(tmp, path)  # fails where the target exists, unlike a rename
    except FileExistsError:
        return False
    finally:
        tmp.unlink()
    fsync_path(path.parent)
    return True
