"""Tests of the data package: configs, deterministic sampling, and the shared text cache."""

from __future__ import annotations

import glob
import json
import multiprocessing as mp
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from data import (
    MemmapDataConfig,
    SyntheticDataConfig,
    TextDataConfig,
    check_data_files,
    check_vocab,
    data_has_val,
    open_token_source,
    text_cache_path,
)
from data.array_source import ArrayTokenSource
from data.cache import ensure_file, host_id
from data.corpus import list_corpus_files
from data.preflight import ID_SAMPLE_BLOCK_TOKENS, ID_SAMPLE_BLOCKS, ID_SAMPLE_END_TOKENS, min_corpus_tokens
from data.sampling import split_sizes
from tests.runs import python_run

TEXT = "the quick brown fox jumps over the lazy dog. " * 40


def _text_config(tmp_path: Path, path: Path | None) -> TextDataConfig:
    return TextDataConfig(path=None if path is None else str(path), cache_dir=str(tmp_path / "cache"))


def _all_tokens(source) -> np.ndarray:
    return np.asarray(source.tokens)


def _cache_files(cache_dir: Path) -> list[str]:
    return sorted(os.listdir(cache_dir))


# --- determinism and shapes -------------------------------------------------------------


@pytest.fixture
def text_source(tmp_path: Path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(TEXT)
    return open_token_source(_text_config(tmp_path, corpus), model_vocab_size=256)


@pytest.fixture(params=["synthetic", "text"])
def any_source(request, text_source):
    if request.param == "synthetic":
        return open_token_source(SyntheticDataConfig(), model_vocab_size=97)
    return text_source


def test_same_arguments_same_batch(any_source):
    a = any_source.batch(seed=1, step=2, dp_rank=3, micro=4, micro_batch_size=5, seq_len=16)
    # Sampling something else in between must not matter.
    any_source.batch(seed=9, step=9, dp_rank=9, micro=9, micro_batch_size=3, seq_len=8)
    b = any_source.batch(seed=1, step=2, dp_rank=3, micro=4, micro_batch_size=5, seq_len=16)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


@pytest.mark.parametrize("field", ["seed", "step", "dp_rank", "micro"])
def test_each_coordinate_changes_the_batch(any_source, field):
    base = dict(seed=1, step=2, dp_rank=3, micro=4, micro_batch_size=8, seq_len=32)
    other = dict(base, **{field: base[field] + 1})
    a, _ = any_source.batch(**base)
    b, _ = any_source.batch(**other)
    assert not torch.equal(a, b)


def test_shapes_dtype_and_label_shift(any_source):
    inputs, labels = any_source.batch(seed=0, step=0, dp_rank=0, micro=0, micro_batch_size=4, seq_len=12)
    assert inputs.shape == labels.shape == (4, 12)
    assert inputs.dtype == labels.dtype == torch.int64
    assert inputs.is_contiguous() and labels.is_contiguous()
    assert torch.equal(inputs[:, 1:], labels[:, :-1])
    assert int(inputs.min()) >= 0 and int(inputs.max()) < any_source.vocab_size


def test_text_windows_are_real_corpus_slices(text_source):
    inputs, labels = text_source.batch(seed=5, step=0, dp_rank=0, micro=0, micro_batch_size=6, seq_len=20)
    data = TEXT.encode()
    for row_in, row_lab in zip(inputs.tolist(), labels.tolist()):
        window = bytes(row_in + row_lab[-1:])
        assert window in data


def test_synthetic_uses_the_model_vocabulary():
    source = open_token_source(SyntheticDataConfig(), model_vocab_size=7)
    inputs, _ = source.batch(seed=0, step=0, dp_rank=0, micro=0, micro_batch_size=64, seq_len=64)
    assert source.vocab_size == 7 and source.num_tokens is None
    assert set(inputs.unique().tolist()) == set(range(7))


def test_split_shorter_than_window_is_a_clear_error(tmp_path: Path):
    corpus = tmp_path / "tiny.txt"
    corpus.write_text("abcdefghijklmnopqrst")  # 20 tokens: 15 for training, the last 5 held out
    config = TextDataConfig(path=str(corpus), cache_dir=str(tmp_path / "cache"), val_fraction=0.25)
    source = open_token_source(config, 256)
    source.batch(seed=0, step=0, dp_rank=0, micro=0, micro_batch_size=2, seq_len=14)  # 15 needed: ok
    with pytest.raises(ValueError, match="training split has 15 tokens, fewer than seq_len \\+ 1 = 16"):
        source.batch(seed=0, step=0, dp_rank=0, micro=0, micro_batch_size=2, seq_len=15)
    source.val_batch(seed=0, index=0, micro_batch_size=2, seq_len=4)
    with pytest.raises(ValueError, match="validation split has 5 tokens, fewer than seq_len \\+ 1 = 6"):
        source.val_batch(seed=0, index=0, micro_batch_size=2, seq_len=5)


def test_negative_coordinates_are_refused(any_source):
    with pytest.raises(ValueError, match="step=-1"):
        any_source.batch(seed=0, step=-1, dp_rank=0, micro=0, micro_batch_size=1, seq_len=4)


# --- held-out split and validation batches ----------------------------------------------


def test_val_batch_is_a_pure_function_of_seed_and_index(any_source):
    a = any_source.val_batch(seed=1, index=2, micro_batch_size=4, seq_len=16)
    any_source.val_batch(seed=7, index=0, micro_batch_size=2, seq_len=8)
    any_source.batch(seed=1, step=2, dp_rank=0, micro=0, micro_batch_size=4, seq_len=16)
    b = any_source.val_batch(seed=1, index=2, micro_batch_size=4, seq_len=16)
    assert any_source.has_val
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert a[0].shape == a[1].shape == (4, 16) and a[0].dtype == torch.int64
    assert torch.equal(a[0][:, 1:], a[1][:, :-1])
    assert not torch.equal(a[0], any_source.val_batch(seed=1, index=3, micro_batch_size=4, seq_len=16)[0])
    assert not torch.equal(a[0], any_source.val_batch(seed=2, index=2, micro_batch_size=4, seq_len=16)[0])


def test_synthetic_val_stream_differs_from_the_training_stream():
    source = open_token_source(SyntheticDataConfig(), model_vocab_size=50000)
    for i in range(5):
        val = source.val_batch(seed=0, index=i, micro_batch_size=2, seq_len=8)[0]
        train = source.batch(seed=0, step=i, dp_rank=0, micro=0, micro_batch_size=2, seq_len=8)[0]
        assert not torch.equal(val, train)


def test_text_training_never_samples_the_held_out_tail(tmp_path: Path):
    # 950 training bytes of "a".."y", then the last 5% held out, all "z": any training window touching the tail
    # would show a "z".
    head = ("abcdefghijklmnopqrstuvwxy" * 38).encode()
    corpus = tmp_path / "corpus.txt"
    corpus.write_bytes(head + b"z" * 50)
    source = open_token_source(_text_config(tmp_path, corpus), 256)
    assert (len(source.train_tokens), len(source.val_tokens)) == (950, 50)
    z = ord("z")
    for seq_len in (1, 16, 949):
        for step in range(50):
            inputs, labels = source.batch(seed=3, step=step, dp_rank=0, micro=0, micro_batch_size=8, seq_len=seq_len)
            assert int(inputs.max()) < z and int(labels.max()) < z
    for index in range(20):
        inputs, labels = source.val_batch(seed=3, index=index, micro_batch_size=8, seq_len=49)
        assert bool((inputs == z).all()) and bool((labels == z).all())


def test_the_split_reaches_both_ends_of_the_training_part(tmp_path: Path):
    # Token i at position i: windows must reach the last training token and never the first held-out one.
    path = tmp_path / "positions.bin"
    np.arange(1000, dtype=np.uint16).tofile(path)
    source = ArrayTokenSource(str(path), vocab_size=1000, val_fraction=0.1)
    seen = set()
    for step in range(400):
        inputs, labels = source.batch(seed=0, step=step, dp_rank=0, micro=0, micro_batch_size=8, seq_len=4)
        seen.update(inputs.flatten().tolist() + labels.flatten().tolist())
    assert min(seen) == 0 and max(seen) == 899
    val = set()
    for index in range(200):
        inputs, labels = source.val_batch(seed=0, index=index, micro_batch_size=8, seq_len=4)
        val.update(inputs.flatten().tolist() + labels.flatten().tolist())
    assert min(val) == 900 and max(val) == 999


def test_memmap_val_path_is_the_held_out_file(tmp_path: Path):
    train, val = tmp_path / "train.bin", tmp_path / "val.bin"
    np.arange(1000, dtype=np.uint16).tofile(train)
    np.arange(5000, 5100, dtype=np.uint16).tofile(val)
    config = MemmapDataConfig(path=str(train), val_path=str(val), vocab_size=6000)
    assert data_has_val(config)
    source = open_token_source(config, model_vocab_size=6000)
    inputs, labels = source.val_batch(seed=0, index=0, micro_batch_size=4, seq_len=10)
    assert int(inputs.min()) >= 5000 and int(labels.max()) < 5100
    assert torch.equal(inputs[:, 1:] - inputs[:, :-1], torch.ones(4, 9, dtype=torch.int64))  # consecutive tokens
    assert int(source.batch(0, 0, 0, 0, 4, 10)[0].max()) < 1000  # training reads only train.bin
    no_val = MemmapDataConfig(path=str(train), vocab_size=6000)
    assert not data_has_val(no_val)
    source = open_token_source(no_val, model_vocab_size=6000)
    assert not source.has_val
    with pytest.raises(ValueError, match="no validation tokens: set data.val_path"):
        source.val_batch(seed=0, index=0, micro_batch_size=1, seq_len=4)


def test_memmap_val_file_ids_are_checked_per_batch(tmp_path: Path):
    train, val = tmp_path / "train.bin", tmp_path / "val.bin"
    np.zeros(100, dtype=np.uint16).tofile(train)
    np.full(100, 300, dtype=np.uint16).tofile(val)
    source = open_token_source(MemmapDataConfig(path=str(train), val_path=str(val), vocab_size=256), 256)
    with pytest.raises(ValueError, match="data.val_path=.* holds token id 300, outside data.vocab_size=256"):
        source.val_batch(seed=0, index=0, micro_batch_size=1, seq_len=8)


def test_val_fraction_out_of_range_is_refused(tmp_path: Path):
    for bad in (0.0, -0.1, 0.51, 1.0):
        with pytest.raises(ValueError, match=r"data.val_fraction=.* is out of range.*\(0, 0.5\]"):
            TextDataConfig(val_fraction=bad).validate()
    TextDataConfig(val_fraction=0.5).validate()


# --- text corpus and cache ---------------------------------------------------------------


def test_single_file_bytes_round_trip(tmp_path: Path):
    # Every byte value, including ones that are not valid UTF-8: an explicit file is used as-is.
    payload = bytes(range(256)) * 3
    corpus = tmp_path / "all_bytes.dat"
    corpus.write_bytes(payload)
    source = open_token_source(_text_config(tmp_path, corpus), 256)
    tokens = _all_tokens(source)
    assert tokens.dtype == np.uint16
    assert bytes(tokens.astype(np.uint8).tolist()) == payload
    assert source.vocab_size == 256 and source.num_tokens == len(payload)


def test_folder_is_sorted_concatenation_of_utf8_files(tmp_path: Path):
    root = tmp_path / "docs"
    (root / "b" / "nested").mkdir(parents=True)
    (root / "a.txt").write_text("alpha é\n")
    (root / "b" / "nested" / "c.md").write_text("gamma\n")
    (root / "b" / "beta.txt").write_text("beta\n")
    (root / "image.bin").write_bytes(b"\xff\xfe\x00binary")  # not UTF-8: skipped
    (root / ".hidden.txt").write_text("hidden\n")  # hidden: skipped
    (root / ".git").mkdir()
    (root / ".git" / "HEAD").write_text("ref: refs/heads/main\n")  # hidden folder: skipped
    source = open_token_source(_text_config(tmp_path, root), 256)
    expected = "alpha é\n" + "beta\n" + "gamma\n"  # sorted by full path: a.txt, b/beta, b/nested/c
    assert bytes(_all_tokens(source).astype(np.uint8).tolist()) == expected.encode()


def test_cache_built_once_and_reused(tmp_path: Path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(TEXT)
    config = _text_config(tmp_path, corpus)
    first = open_token_source(config, 256)
    cache = Path(first.path)
    before = cache.stat()
    time.sleep(0.01)
    second = open_token_source(config, 256)
    after = cache.stat()
    assert second.path == first.path
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)
    assert _cache_files(tmp_path / "cache") == [cache.name]
    assert cache.name.startswith("text-") and cache.name.endswith(".bin")


def test_changed_source_gets_a_new_cache(tmp_path: Path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(TEXT)
    config = _text_config(tmp_path, corpus)
    old = open_token_source(config, 256)
    corpus.write_text(TEXT + "more")
    new = open_token_source(config, 256)
    assert new.path != old.path
    assert new.num_tokens == old.num_tokens + 4


def test_cache_inside_the_corpus_folder_is_not_part_of_it(tmp_path: Path):
    # data.path='.' with the default relative cache_dir puts the cache inside the corpus; the
    # cache must not feed back into the key, or every open would build a new one.
    root = tmp_path / "docs"
    root.mkdir()
    (root / "a.txt").write_text(TEXT)
    config = TextDataConfig(path=str(root), cache_dir=str(root / "cache"))
    first = open_token_source(config, 256)
    second = open_token_source(config, 256)
    assert first.path == second.path
    assert first.num_tokens == len(TEXT)
    assert _cache_files(root / "cache") == [Path(first.path).name]


def test_empty_folder_is_a_clear_error(tmp_path: Path):
    root = tmp_path / "empty"
    root.mkdir()
    (root / "blob").write_bytes(b"\xff\xff")
    with pytest.raises(ValueError, match="selects no text"):
        open_token_source(_text_config(tmp_path, root), 256)
    assert not glob.glob(str(tmp_path / "cache" / "*"))  # no lock or temp file left behind


def test_relative_cache_dir_is_under_the_working_directory(tmp_path: Path, monkeypatch):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(TEXT)
    monkeypatch.chdir(tmp_path)
    config = TextDataConfig(path=str(corpus))
    path = text_cache_path(config)
    assert path.startswith(str(tmp_path / ".cache" / "stagecheck") + os.sep)
    assert not os.path.exists(path)  # computing the path creates nothing
    assert open_token_source(config, 256).path == path


def test_embedded_stdlib_corpus(tmp_path: Path):
    config = _text_config(tmp_path, None)
    files = list_corpus_files(None)
    assert all(f.endswith(".py") for f in files.paths)
    assert not any(f"{os.sep}{skip}{os.sep}" in f for f in files.paths for skip in ("site-packages", "test", "tests"))
    start = time.perf_counter()
    source = open_token_source(config, 256)
    built = time.perf_counter() - start
    print(f"\nstdlib corpus: {len(files.paths)} files, {source.num_tokens} tokens, built in {built:.2f} s")
    assert source.num_tokens > 1_000_000
    # Real Python source: lots of "def " and "import ".
    sample = bytes(_all_tokens(source)[:2_000_000].astype(np.uint8).tolist())
    assert sample.count(b"def ") > 1000 and sample.count(b"import ") > 100


# --- concurrency and locking -------------------------------------------------------------


def _open_and_digest(config: TextDataConfig, barrier, results) -> None:
    barrier.wait()  # maximise the chance that all processes race for the build
    source = open_token_source(config, 256)
    tokens = _all_tokens(source)
    results.put((source.path, tokens.tobytes()))


def test_concurrent_openers_share_one_build(tmp_path: Path):
    root = tmp_path / "docs"
    root.mkdir()
    for i in range(50):
        (root / f"{i:03d}.txt").write_text(f"file {i}\n" + TEXT * 20)
    config = _text_config(tmp_path, root)
    ctx = mp.get_context("spawn")
    barrier, results = ctx.Barrier(3), ctx.Queue()
    procs = [ctx.Process(target=_open_and_digest, args=(config, barrier, results)) for _ in range(3)]
    for p in procs:
        p.start()
    outputs = [results.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    assert len({path for path, _ in outputs}) == 1
    assert len({blob for _, blob in outputs}) == 1
    assert _cache_files(tmp_path / "cache") == [os.path.basename(outputs[0][0])]


def _slow_build_worker(target: str, log_dir: str, barrier) -> None:
    def build(tmp: str) -> None:
        Path(log_dir, f"built-by-{os.getpid()}").touch()
        time.sleep(1.0)  # long enough that the others must wait on the lock
        Path(tmp).write_bytes(b"\x01\x00" * 10)

    barrier.wait()
    ensure_file(target, build, poll_s=0.05)


def test_lock_lets_exactly_one_process_build(tmp_path: Path):
    target = tmp_path / "cache" / "thing.bin"
    log_dir = tmp_path / "log"
    log_dir.mkdir()
    ctx = mp.get_context("spawn")
    barrier = ctx.Barrier(3)
    procs = [ctx.Process(target=_slow_build_worker, args=(str(target), str(log_dir), barrier)) for _ in range(3)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    assert len(os.listdir(log_dir)) == 1
    assert os.listdir(target.parent) == ["thing.bin"]  # no lock or temp files left


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()  # reaped, so the pid is gone (and not a zombie)
    return child.pid


def _write_lock(path: Path, host: str, pid: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"host": host, "pid": pid, "token": "old", "started": 0}))


def test_stale_lock_of_dead_local_pid_is_taken_over(tmp_path: Path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(TEXT)
    config = _text_config(tmp_path, corpus)
    cache = Path(text_cache_path(config))
    dead = _dead_pid()
    _write_lock(Path(f"{cache}.lock"), host_id(), dead)
    leftover = Path(f"{cache}.tmp.{os.uname().nodename}.{dead}.deadbeef")
    leftover.write_bytes(b"partial")
    start = time.perf_counter()
    source = open_token_source(config, 256)  # default stale_after_s is minutes: pid rule must fire
    assert time.perf_counter() - start < 10
    assert source.num_tokens == len(TEXT)
    assert _cache_files(cache.parent) == [cache.name]  # lock and the dead builder's temp file gone


def test_stale_lock_from_another_host_expires(tmp_path: Path):
    target = tmp_path / "cache" / "thing.bin"
    _write_lock(Path(f"{target}.lock"), "some-other-node/boot", 12345)
    start = time.perf_counter()
    built = ensure_file(target, lambda tmp: Path(tmp).write_bytes(b"\x00\x00"), stale_after_s=0.5, poll_s=0.05)
    assert built and 0.5 <= time.perf_counter() - start < 10
    assert os.listdir(target.parent) == ["thing.bin"]


def test_live_lock_times_out_with_clear_error(tmp_path: Path):
    target = tmp_path / "cache" / "thing.bin"
    lock = Path(f"{target}.lock")
    _write_lock(lock, host_id(), os.getpid())  # alive, on this host
    with pytest.raises(TimeoutError, match="thing.bin.lock.*held by pid"):
        ensure_file(target, lambda tmp: None, timeout_s=0.3, stale_after_s=60, poll_s=0.05)
    assert lock.exists() and not target.exists()


def test_failed_build_releases_lock_and_removes_temp(tmp_path: Path):
    target = tmp_path / "cache" / "thing.bin"

    def build(tmp: str) -> None:
        Path(tmp).write_bytes(b"half")
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError, match="disk full"):
        ensure_file(target, build)
    assert os.listdir(target.parent) == []


# --- memmap source -----------------------------------------------------------------------


def test_memmap_source_reads_a_nanogpt_bin(tmp_path: Path):
    tokens = (np.arange(1000) * 37 % 50257).astype(np.uint16)
    path = tmp_path / "train.bin"
    tokens.tofile(path)
    source = open_token_source(MemmapDataConfig(path=str(path)), model_vocab_size=50304)
    assert source.num_tokens == 1000 and source.vocab_size == 50257
    inputs, labels = source.batch(seed=0, step=3, dp_rank=1, micro=2, micro_batch_size=4, seq_len=10)
    for row_in, row_lab in zip(inputs.numpy(), labels.numpy()):
        start = int(np.flatnonzero(tokens == row_in[0])[0])
        assert np.array_equal(row_in, tokens[start : start + 10])
        assert np.array_equal(row_lab, tokens[start + 1 : start + 11])


def test_memmap_token_past_vocab_is_reported(tmp_path: Path):
    path = tmp_path / "bad.bin"
    np.full(100, 300, dtype=np.uint16).tofile(path)
    source = open_token_source(MemmapDataConfig(path=str(path), vocab_size=256), model_vocab_size=256)
    with pytest.raises(ValueError, match="token id 300, outside data.vocab_size=256"):
        source.batch(seed=0, step=0, dp_rank=0, micro=0, micro_batch_size=1, seq_len=8)


# --- validate() and vocabulary check -----------------------------------------------------


def test_text_validate_missing_path(tmp_path: Path):
    missing = str(tmp_path / "nope")
    config = TextDataConfig(path=missing, cache_dir=str(tmp_path / "cache"))
    with pytest.raises(ValueError) as err:
        config.validate()
    assert str(err.value) == (
        f"data.path={missing!r} does not exist: set data.path to a text file or a folder of text "
        f"files, or leave it null for the embedded corpus"
    )
    assert not (tmp_path / "cache").exists()  # validate() creates nothing


def test_text_validate_accepts_defaults_and_creates_nothing(tmp_path: Path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    TextDataConfig().validate()
    SyntheticDataConfig().validate()
    assert os.listdir(tmp_path) == []


def test_text_validate_cache_dir_that_is_a_file(tmp_path: Path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(ValueError, match="data.cache_dir=.* exists but is not a folder"):
        TextDataConfig(cache_dir=str(blocker)).validate()


def test_memmap_validate_requires_path():
    with pytest.raises(ValueError) as err:
        MemmapDataConfig().validate()
    assert str(err.value) == (
        "data.path is required when data.name='memmap': set data.path to a folder prepare_data.py wrote or an "
        "existing nanoGPT-style .bin file of uint16 tokens"
    )


def test_memmap_validate_odd_size_and_vocab_range(tmp_path: Path):
    odd = tmp_path / "odd.bin"
    odd.write_bytes(b"abc")
    with pytest.raises(ValueError, match="has 3 bytes"):
        MemmapDataConfig(path=str(odd)).validate()
    good = tmp_path / "good.bin"
    good.write_bytes(b"ab")
    with pytest.raises(ValueError, match=r"data.vocab_size=70000 is out of range.*\[1, 65536\]"):
        MemmapDataConfig(path=str(good), vocab_size=70000).validate()


def test_a_prepared_folder_is_never_read_as_text(tmp_path: Path):
    """data=text on a folder prepare_data.py wrote would tokenize its metadata and binary files as text: refused,
    naming data=memmap, for the folder and for its token files."""
    from data.prepare import prepare
    from data.prepare_config import PrepareDataConfig

    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": f"document {i} " * 20}) + "\n" for i in range(20)))
    out = tmp_path / "prepared"
    prepare(PrepareDataConfig(input=str(corpus), out=str(out)))
    for path in (out, out / "train.bin"):
        with pytest.raises(ValueError) as err:
            TextDataConfig(path=str(path), cache_dir=str(tmp_path / "cache")).validate()
        assert str(err.value) == (
            f"data.path={str(path)!r} is token files that prepare_data.py wrote (stagecheck_data.json is in "
            f"{str(out)!r}), not text: read them with data=memmap data.path={out}"
        )
    MemmapDataConfig(path=str(out)).validate()  # what the message asks for
    with pytest.raises(ValueError) as err:
        MemmapDataConfig(path=str(corpus)).validate()
    assert str(err.value) == (
        f"data.path={str(corpus)!r} is a corpus, not token ids: tokenize it first with "
        f"`python prepare_data.py input={corpus} out=DIR`, then train with data=memmap data.path=DIR"
    )


def test_validate_wrong_name():
    with pytest.raises(ValueError, match="data.name='memmap' does not match.*set data.name to 'text'"):
        TextDataConfig(name="memmap").validate()


def test_vocab_check():
    check_vocab(TextDataConfig(), 256)
    check_vocab(MemmapDataConfig(vocab_size=50257), 50304)
    check_vocab(SyntheticDataConfig(), 11)
    with pytest.raises(ValueError) as err:
        check_vocab(TextDataConfig(), 100)
    assert "model.vocab_size=100" in str(err.value) and "at least 256" in str(err.value)
    with pytest.raises(ValueError, match=r"model.vocab_size=50000 .*data.vocab_size=50257.*at least 50257"):
        check_vocab(MemmapDataConfig(vocab_size=50257), 50000)


def test_open_refuses_model_vocab_too_small(tmp_path: Path):
    with pytest.raises(ValueError, match="model.vocab_size=128"):
        open_token_source(_text_config(tmp_path, None), model_vocab_size=128)
    assert not (tmp_path / "cache").exists()  # refused before any build


# --- data problems refused at start-up ---------------------------------------------------


def _start_up_case(tmp_path: Path, case: str) -> tuple[list[str], str]:
    """(overrides, the message expected) of one bad-data case, its files made under tmp_path."""
    corpus_dir = tmp_path / "corpus"
    corpus_dir.mkdir()
    text = ["data=text", f"data.cache_dir={tmp_path / 'cache'}"]
    if case == "val_fraction":
        return [*text, "data.val_fraction=0.7"], "data.val_fraction=0.7 is out of range"
    if case == "empty_folder":
        return [*text, f"data.path={corpus_dir}"], f"data.path='{corpus_dir}' holds no files"
    if case == "short_corpus":
        (corpus_dir / "a.txt").write_text("x" * 1000)  # 50 held out < 65
        return [*text, f"data.path={corpus_dir}", "model.seq_len=64"], "each split needs model.seq_len + 1 = 65"
    train = tmp_path / "train.bin"
    if case == "memmap_ids":
        np.full(5000, 300, dtype=np.uint16).tofile(train)
        return ["data=memmap", f"data.path={train}", "data.vocab_size=256"], "data.path=" + repr(
            str(train)
        ) + " holds token id 300 at position 0, outside data.vocab_size=256"
    raise AssertionError(case)


@pytest.mark.parametrize("case", ["val_fraction", "empty_folder", "short_corpus", "memmap_ids"])
def test_data_problems_are_refused_at_start_up(tmp_path: Path, case: str):
    overrides, message = _start_up_case(tmp_path, case)
    run_dir = tmp_path / "run"
    result = python_run(run_dir, "model=tiny", "train.device=cpu", *overrides, check=False, timeout=120)
    assert result.returncode == 2, result.stderr
    assert message in result.stderr, result.stderr
    assert "Traceback" not in result.stderr + result.stdout
    assert not run_dir.exists() and not (tmp_path / "cache").exists()  # nothing built, no run directory


def test_text_length_is_bounded_by_bytes_then_known_from_the_cache(tmp_path: Path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("ab " * 400)  # 1200 bytes; as bytes, 60 held out >= 33
    config = TextDataConfig(path=str(corpus), cache_dir=str(tmp_path / "cache"), tokenizer="bpe", bpe_vocab_size=300)
    check_data_files(config, seq_len=32)  # no cache yet: 1200 bytes could be 1200 tokens
    open_token_source(config, 300)  # GPT-2's split and one merge: "ab", 399 x " ab", " "
    with pytest.raises(ValueError, match=r"has 402 bpe tokens: .* 381 for training and 21 held out.*= 33"):
        check_data_files(config, seq_len=32)
    check_data_files(config, seq_len=20)


def test_a_folder_of_binary_files_is_refused_reading_only_what_it_needs(tmp_path: Path):
    root = tmp_path / "docs"
    root.mkdir()
    (root / "blob.bin").write_bytes(b"\xff\xfe" * 100)
    config = TextDataConfig(path=str(root), cache_dir=str(tmp_path / "cache"))
    with pytest.raises(ValueError, match="selects no text"):
        check_data_files(config, seq_len=8)
    (root / "text.txt").write_text("y" * 100_000)
    check_data_files(config, seq_len=8)
    assert min_corpus_tokens(8, 0.05) == 161  # the 161st token makes the held-out part 9 long
    assert split_sizes(161, 0.05) == (152, 9) and split_sizes(160, 0.05) == (152, 8)


def test_memmap_files_too_short_for_a_window_are_refused(tmp_path: Path):
    train, val = tmp_path / "train.bin", tmp_path / "val.bin"
    np.zeros(65, dtype=np.uint16).tofile(train)
    np.zeros(10, dtype=np.uint16).tofile(val)
    check_data_files(MemmapDataConfig(path=str(train), vocab_size=256), seq_len=64)
    with pytest.raises(ValueError, match=r"data.path=.* holds 65 tokens, fewer than model.seq_len \+ 1 = 66"):
        check_data_files(MemmapDataConfig(path=str(train), vocab_size=256), seq_len=65)
    with pytest.raises(ValueError, match=r"data.val_path=.* holds 10 tokens, fewer than model.seq_len \+ 1 = 65"):
        check_data_files(MemmapDataConfig(path=str(train), val_path=str(val), vocab_size=256), seq_len=64)
    with pytest.raises(ValueError, match=r"data.val_path=.* does not exist"):
        MemmapDataConfig(path=str(train), val_path=str(tmp_path / "nope.bin")).validate()


def test_memmap_ids_are_checked_on_a_sample_at_start_up(tmp_path: Path):
    n = 4 * ID_SAMPLE_END_TOKENS
    tokens = np.zeros(n, dtype=np.uint16)
    tokens[n - 1] = 999  # in the last ids: found
    path = tmp_path / "train.bin"
    tokens.tofile(path)
    config = MemmapDataConfig(path=str(path), vocab_size=256)
    with pytest.raises(ValueError, match=f"token id 999 at position {n - 1}, outside data.vocab_size=256"):
        check_data_files(config, seq_len=8)
    # An id between the sampled blocks passes start-up; the per-batch check still refuses it.
    tokens[n - 1] = 0
    middle = np.zeros(n, dtype=bool)
    middle[ID_SAMPLE_END_TOKENS : n - ID_SAMPLE_END_TOKENS] = True
    rng = np.random.default_rng(0)
    for start in rng.integers(0, n - ID_SAMPLE_BLOCK_TOKENS, size=ID_SAMPLE_BLOCKS):
        middle[start : start + ID_SAMPLE_BLOCK_TOKENS] = False
    hidden = int(np.flatnonzero(middle)[0])
    tokens[hidden] = 999
    tokens.tofile(path)
    check_data_files(config, seq_len=8)
    source = open_token_source(config, model_vocab_size=256)
    with pytest.raises(ValueError, match="token id 999"):
        for step in range(2000):
            source.batch(seed=0, step=step, dp_rank=0, micro=0, micro_batch_size=64, seq_len=256)
