"""Which files make up a text corpus, its cache key, its bytes and texts, and its files as documents."""

from __future__ import annotations

import hashlib
import json
import os
import sysconfig
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from data.documents import Chunk

# Bump when the file selection or the token layout changes, so old caches are not reused.
# v2: each file is encoded with the special tokens of the tokenizer's post-processor (a BOS, or nothing).
CACHE_FORMAT = "stagecheck-text-v2"

# Standard-library folders that are not ordinary library source: third-party packages and
# test suites (which hold deliberately odd encodings and huge generated data files).
_STDLIB_SKIP_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"})


@dataclass(frozen=True)
class CorpusFiles:
    """The files of a corpus in concatenation order, and how to filter them."""

    paths: tuple[str, ...]
    # False for one explicitly named file: the user chose it, so its bytes are used as-is.
    # True for folder walks: stray binaries there would otherwise become garbage tokens.
    require_utf8: bool
    # Human-readable origin, for messages.
    origin: str


def stdlib_root() -> str:
    return sysconfig.get_paths()["stdlib"]


def list_corpus_files(path: str | None, exclude_dir: str | None = None) -> CorpusFiles:
    """Resolve ``data.path`` (None: embedded stdlib corpus) to a sorted list of files.

    ``exclude_dir`` is pruned from folder walks: a cache folder inside the corpus would change
    the corpus (and hence the cache key) every time a cache is written.
    """
    if path is None:
        root = stdlib_root()
        files = _walk(root, exclude_dir, skip_dirs=_STDLIB_SKIP_DIRS, suffix=".py")
        return CorpusFiles(files, require_utf8=True, origin=f"stdlib sources under {root}")
    absolute = os.path.abspath(path)
    if os.path.isfile(absolute):
        return CorpusFiles((absolute,), require_utf8=False, origin=absolute)
    if os.path.isdir(absolute):
        files = _walk(absolute, exclude_dir, skip_dirs=frozenset(), suffix=None)
        return CorpusFiles(files, require_utf8=True, origin=f"files under {absolute}")
    raise ValueError(
        f"data.path={path!r} does not exist: set data.path to a text file or a folder of text "
        f"files, or leave it null for the embedded corpus"
    )


def _walk(root: str, exclude_dir: str | None, skip_dirs: frozenset[str], suffix: str | None) -> tuple[str, ...]:
    excluded = os.path.realpath(exclude_dir) if exclude_dir else None
    found: list[str] = []
    # Symlinked folders are not followed, so a link cycle cannot make the walk endless.
    for folder, dirnames, filenames in os.walk(root):
        # Hidden entries are VCS metadata (.git) or editor droppings: churn, not content.
        dirnames[:] = [
            d
            for d in dirnames
            if not d.startswith(".") and d not in skip_dirs and os.path.realpath(os.path.join(folder, d)) != excluded
        ]
        for name in filenames:
            if name.startswith(".") or (suffix is not None and not name.endswith(suffix)):
                continue
            full = os.path.join(folder, name)
            if os.path.isfile(full):  # regular file, or a link to one
                found.append(full)
    # Sorted full paths, not walk order: os.walk order depends on the filesystem.
    return tuple(sorted(found))


def resolve_corpus(path: str | None, cache_dir: str) -> tuple[CorpusFiles, str]:
    """The files of ``data.path`` (the cache folder left out) and their fingerprint. Listing and stat-ing the
    sources is cheap; only their contents are expensive, and those are read once per corpus version."""
    files = list_corpus_files(path, exclude_dir=os.path.abspath(cache_dir))
    return files, fingerprint(files)


def fingerprint(files: CorpusFiles) -> str:
    """Hex digest of (format, file paths, sizes, mtimes): changes when any source changes."""
    entries = []
    for path in files.paths:
        st = os.stat(path)
        entries.append([path, st.st_size, st.st_mtime_ns])
    blob = json.dumps([CACHE_FORMAT, files.require_utf8, entries], separators=(",", ":"))
    return hashlib.sha256(blob.encode()).hexdigest()


def iter_file_bytes(files: CorpusFiles) -> Iterable[bytes]:
    """The bytes of each accepted file, in order (folder walks skip files that are not UTF-8)."""
    for path in files.paths:
        with open(path, "rb") as handle:
            raw = handle.read()
        if files.require_utf8:
            try:
                raw.decode("utf-8")
            except UnicodeDecodeError:
                continue  # binary or legacy-encoded file; see CorpusFiles.require_utf8
        yield raw


def iter_texts(files: CorpusFiles) -> Iterable[str]:
    """Each accepted file as text: a single named file that is not UTF-8 has its invalid bytes replaced by
    U+FFFD, since a text tokenizer needs characters (the bytes tokenizer reads them as they are)."""
    for raw in iter_file_bytes(files):
        yield raw.decode("utf-8", errors="replace")


def file_chunks(files: CorpusFiles) -> Iterator[Chunk]:
    """Each accepted file whole, as one document (data=text reads files whole, as it always has)."""
    for document, raw in enumerate(iter_file_bytes(files)):
        yield Chunk("text", files.origin, 1, document, raw)
