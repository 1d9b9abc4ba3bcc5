"""Tests of the tokenizers: the trained byte-level BPE (deterministic, cached once, lossless), a user's
tokenizer.json, cache identity per tokenizer, and the tokenizer saved with a run."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import tokenizers
import yaml
from tokenizers import models, pre_tokenizers

from data import (
    MemmapDataConfig,
    SyntheticDataConfig,
    TextDataConfig,
    Tokenizer,
    check_vocab,
    data_vocab_size,
    load_tokenizer,
    open_token_source,
    open_tokenizer,
    save_run_tokenizer,
    save_tokenizer,
    text_cache_path,
)
from tests.runs import REPO
from tests.shared_runs import case

# Enough repeated words for a few hundred merges, small enough to train in milliseconds.
CORPUS = "".join(
    f"def function_{i % 17}(value):\n    return value * {i % 5} + len('word{i % 11}')\n" for i in range(400)
)
# Text the BPE never saw: other scripts, emoji (4-byte UTF-8), combining marks, control characters, CRLF.
UNICODE = "naïve café 日本語 ελληνικά русский 🎉👩‍💻 e\u0301 \t\x00\x7f\r\n∑∫ \ufeff end"
# The end-of-sequence token the trained BPE appends after every file of the corpus.
EOS = "<|endoftext|>"


def _write_corpus(tmp_path: Path, text: str = CORPUS) -> Path:
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(text, encoding="utf-8")
    return corpus


def _bpe_config(tmp_path: Path, corpus: Path, vocab_size: int = 300, **extra) -> TextDataConfig:
    return TextDataConfig(
        path=str(corpus), cache_dir=str(tmp_path / "cache"), tokenizer="bpe", bpe_vocab_size=vocab_size, **extra
    )


def _bpe_json(tmp_path: Path) -> list[Path]:
    return sorted((tmp_path / "cache").glob("bpe-*.json"))


# --- the trained BPE -----------------------------------------------------------------------


def test_bpe_training_is_deterministic_across_processes(tmp_path: Path):
    corpus = _write_corpus(tmp_path)
    here = _bpe_config(tmp_path / "a", corpus)
    open_tokenizer(here)
    there = _bpe_config(tmp_path / "b", corpus)
    code = f"from data import TextDataConfig, open_tokenizer; open_tokenizer(TextDataConfig(**{vars(there)!r}))"
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True)
    first, second = _bpe_json(tmp_path / "a"), _bpe_json(tmp_path / "b")
    assert len(first) == len(second) == 1 and first[0].name == second[0].name
    assert first[0].read_bytes() == second[0].read_bytes()


def test_bpe_is_byte_level_merges_and_lossless(tmp_path: Path):
    tokenizer = open_tokenizer(_bpe_config(tmp_path, _write_corpus(tmp_path), vocab_size=300))
    assert tokenizer.kind == "bpe" and tokenizer.vocab_size == 300
    line = "def function_3(value):\n    return value * 2 + len('word7')\n"
    ids = tokenizer.encode(line)
    assert len(ids) < len(line.encode()) / 2  # merges learnt from the corpus compress its own text
    assert tokenizer.decode(ids) == line
    for text in (UNICODE, "", " ", "x" * 1000, "\n\n\n", "🎉"):
        assert tokenizer.decode(tokenizer.encode(text)) == text
    assert all(0 <= i < 300 for i in tokenizer.encode(UNICODE))


def test_bytes_tokenizer_never_fails_and_decodes_leniently():
    tokenizer = Tokenizer()
    assert (tokenizer.kind, tokenizer.vocab_size) == ("bytes", 256)
    assert tokenizer.encode("é") == [0xC3, 0xA9]
    assert tokenizer.decode(tokenizer.encode(UNICODE)) == UNICODE
    assert len(tokenizer.encode("a\ud800b")) == 5  # a lone surrogate still encodes
    assert tokenizer.decode([0x61, 0xC3]) == "a\ufffd"  # a cut multi-byte character is replaced, not an error
    with pytest.raises(ValueError, match="token id 256 is outside the bytes tokenizer of 256 ids"):
        tokenizer.decode([1, 256])


def test_bpe_refuses_text_it_cannot_encode(tmp_path: Path):
    tokenizer = open_tokenizer(_bpe_config(tmp_path, _write_corpus(tmp_path)))
    with pytest.raises(ValueError, match="lone surrogate"):
        tokenizer.encode("a\ud800b")
    with pytest.raises(ValueError, match="outside the bpe tokenizer of 300 ids"):
        tokenizer.decode([299, 300])


def test_bpe_text_source_tokens_are_the_corpus(tmp_path: Path):
    corpus = _write_corpus(tmp_path, CORPUS + UNICODE)
    config = _bpe_config(tmp_path, corpus, val_fraction=0.1)
    source = open_token_source(config, model_vocab_size=300)
    tokenizer = open_tokenizer(config)
    assert source.vocab_size == 300
    # The file ends with the BPE's end-of-sequence token, its last id.
    assert tokenizer.eos_id == 299 and tokenizer.decode(np.asarray(source.tokens).tolist()) == CORPUS + UNICODE + EOS
    assert len(source.val_tokens) == source.num_tokens - len(source.train_tokens) == -(-source.num_tokens // 10)
    inputs, labels = source.batch(seed=0, step=0, dp_rank=0, micro=0, micro_batch_size=4, seq_len=32)
    assert int(inputs.max()) < 300 and tokenizer.decode(inputs[0].tolist()) in CORPUS


def test_small_corpus_trains_fewer_ids_than_asked(tmp_path: Path):
    config = _bpe_config(tmp_path, _write_corpus(tmp_path, "abab abab abab"), vocab_size=4096)
    assert data_vocab_size(config, 4096) == 4096  # the bound known before training
    tokenizer = open_tokenizer(config)
    assert 256 < tokenizer.vocab_size < 300
    assert open_token_source(config, 4096).vocab_size == tokenizer.vocab_size


def test_bpe_options_are_validated(tmp_path: Path):
    for size in (256, 65537):
        with pytest.raises(ValueError, match=r"data.bpe_vocab_size=\d+ is out of range.*\(256, 65536\]"):
            TextDataConfig(tokenizer="bpe", bpe_vocab_size=size).validate()
    with pytest.raises(ValueError, match="data.tokenizer='sentencepiece' is unknown: allowed values are bytes, bpe"):
        TextDataConfig(tokenizer="sentencepiece").validate()
    with pytest.raises(ValueError, match=r"model.vocab_size=256 .*data.bpe_vocab_size=4096.*at least 4096"):
        check_vocab(TextDataConfig(tokenizer="bpe"), 256)


# --- caches and the lock -------------------------------------------------------------------


def test_each_tokenizer_has_its_own_token_cache(tmp_path: Path):
    corpus = _write_corpus(tmp_path)
    user_file = tmp_path / "user.json"
    user_file.write_text(open_tokenizer(_bpe_config(tmp_path / "other", corpus, vocab_size=280)).hf.to_str())
    configs = [
        TextDataConfig(path=str(corpus), cache_dir=str(tmp_path / "cache")),
        _bpe_config(tmp_path, corpus, vocab_size=300),
        _bpe_config(tmp_path, corpus, vocab_size=320),
        _bpe_config(tmp_path, corpus, tokenizer_file=str(user_file)),
    ]
    sources = [open_token_source(c, 320) for c in configs]
    paths = [s.path for s in sources]
    assert len(set(paths)) == 4 and [text_cache_path(c) for c in configs] == paths
    assert [Path(p).name.split("-")[1] for p in paths] == ["bytes", "bpe", "bpe", "file"]
    assert len({s.num_tokens for s in sources}) == 4  # really tokenized differently
    before = sorted(os.listdir(tmp_path / "cache"))
    stats = [os.stat(p).st_mtime_ns for p in paths]
    assert [open_token_source(c, 320).path for c in configs] == paths  # reopened, not rebuilt
    assert [os.stat(p).st_mtime_ns for p in paths] == stats and sorted(os.listdir(tmp_path / "cache")) == before
    # Another tokenizer.json of the same name is another tokenizer: its content decides.
    user_file.write_text(open_tokenizer(_bpe_config(tmp_path / "third", corpus, vocab_size=290)).hf.to_str())
    assert text_cache_path(configs[3]) != paths[3]


def _open_counting_builds(config: TextDataConfig, log_dir: str, barrier) -> None:
    import data.bpe
    import data.text_source

    def counted(real, what):
        def wrapper(*args, **kwargs):
            Path(log_dir, f"{what}-{os.getpid()}").touch()
            return real(*args, **kwargs)

        return wrapper

    data.bpe.train_bpe = counted(data.bpe.train_bpe, "bpe")
    data.text_source.tokenize_chunks = counted(data.text_source.tokenize_chunks, "tokens")
    barrier.wait()  # all race for both builds at once
    open_token_source(config, model_vocab_size=300)


def test_concurrent_openers_train_the_bpe_and_tokenize_once(tmp_path: Path):
    config = _bpe_config(tmp_path, _write_corpus(tmp_path, CORPUS * 5))
    log_dir = tmp_path / "log"
    log_dir.mkdir()
    ctx = mp.get_context("spawn")
    barrier = ctx.Barrier(2)
    procs = [ctx.Process(target=_open_counting_builds, args=(config, str(log_dir), barrier)) for _ in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
        assert p.exitcode == 0
    built = sorted(name.split("-")[0] for name in os.listdir(log_dir))
    assert built == ["bpe", "tokens"]
    names = sorted(os.listdir(tmp_path / "cache"))  # no lock or temp file left behind
    assert len(names) == 2 and names[0].startswith("bpe-") and names[1].startswith("text-bpe-")


# --- a user's tokenizer.json ---------------------------------------------------------------


def _word_level_file(tmp_path: Path) -> Path:
    """A word-level tokenizer with an unknown token: unlike byte-level BPE, it cannot encode every text."""
    vocab = {"[UNK]": 0, "the": 1, "cat": 2, "sat": 3, ".": 4}
    tokenizer = tokenizers.Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    path = tmp_path / "words.json"
    tokenizer.save(str(path))
    return path


def test_tokenizer_file_is_used_instead_of_training(tmp_path: Path):
    words = _word_level_file(tmp_path)
    corpus = _write_corpus(tmp_path, "the cat sat. " * 100)
    config = _bpe_config(tmp_path, corpus, tokenizer_file=str(words))
    config.validate()
    assert data_vocab_size(config, 256) == 5
    source = open_token_source(config, model_vocab_size=5)
    assert source.vocab_size == 5 and np.asarray(source.tokens)[:4].tolist() == [1, 2, 3, 4]
    assert not _bpe_json(tmp_path)  # nothing trained
    tokenizer = open_tokenizer(config)
    assert tokenizer.encode("the cat") == [1, 2]
    with pytest.raises(ValueError, match=r"cannot encode the characters 'dgo' of the text"):
        tokenizer.encode("the dog")
    with pytest.raises(ValueError, match=r"model.vocab_size=4 .*5 token ids of data.tokenizer_file"):
        check_vocab(config, 4)


def test_bad_tokenizer_file_is_refused(tmp_path: Path):
    garbage = tmp_path / "tokenizer.json"
    garbage.write_text('{"not": "a tokenizer"}')
    with pytest.raises(ValueError, match="data.tokenizer_file=.* is not a valid tokenizer.json"):
        TextDataConfig(tokenizer="bpe", tokenizer_file=str(garbage)).validate()
    with pytest.raises(ValueError, match="data.tokenizer_file=.* is not an existing file"):
        TextDataConfig(tokenizer="bpe", tokenizer_file=str(tmp_path / "missing.json")).validate()
    with pytest.raises(ValueError, match="data.tokenizer_file=.* needs data.tokenizer=bpe, not 'bytes'"):
        TextDataConfig(tokenizer_file=str(_word_level_file(tmp_path))).validate()


# --- the tokenizer of a run ----------------------------------------------------------------


def test_run_tokenizer_round_trips_through_its_folder(tmp_path: Path):
    bpe = open_tokenizer(_bpe_config(tmp_path, _write_corpus(tmp_path)))
    save_tokenizer(bpe, tmp_path / "run")
    meta = json.loads((tmp_path / "run" / "stagecheck_tokenizer.json").read_text())
    assert meta == {"kind": "bpe", "vocab_size": 300, "eos_id": 299}
    loaded = load_tokenizer(tmp_path / "run")
    assert (loaded.kind, loaded.vocab_size) == ("bpe", 300)
    assert loaded.encode(UNICODE) == bpe.encode(UNICODE)
    # tokenizer.json is the Hugging Face file itself, as GPT-2's is: `tokenizers` reads it as it is.
    assert tokenizers.Tokenizer.from_file(str(tmp_path / "run" / "tokenizer.json")).encode(UNICODE).ids == bpe.encode(
        UNICODE
    )
    # A run started over as bytes in the same folder leaves no stale BPE behind.
    save_run_tokenizer(TextDataConfig(), tmp_path / "run")
    assert load_tokenizer(tmp_path / "run").kind == "bytes"
    assert not (tmp_path / "run" / "tokenizer.json").exists()


def test_runs_without_a_tokenizer_say_why(tmp_path: Path):
    save_run_tokenizer(SyntheticDataConfig(), tmp_path / "synthetic")
    with pytest.raises(ValueError, match="data=synthetic .*has no tokenizer"):
        load_tokenizer(tmp_path / "synthetic")
    train = tmp_path / "train.bin"
    np.zeros(10, dtype=np.uint16).tofile(train)
    save_run_tokenizer(MemmapDataConfig(path=str(train)), tmp_path / "memmap")
    with pytest.raises(ValueError, match="data=memmap without data.tokenizer_file"):
        load_tokenizer(tmp_path / "memmap")
    save_run_tokenizer(
        MemmapDataConfig(path=str(train), tokenizer_file=str(_word_level_file(tmp_path))), tmp_path / "m2"
    )
    assert load_tokenizer(tmp_path / "m2").vocab_size == 5
    (tmp_path / "old").mkdir()
    assert load_tokenizer(tmp_path / "old").kind == "bytes"  # a run from before tokenizers were saved
    (tmp_path / "old" / "stagecheck_tokenizer.json").write_text("{")
    with pytest.raises(ValueError, match="is not a stagecheck tokenizer description"):
        load_tokenizer(tmp_path / "old")


CASES = {
    "bpe": case(
        "model=tiny",
        "model.vocab_size=320",
        "model.seq_len=32",
        "train.device=cpu",
        "train.steps=2",
        "train.micro_batches=1",
        "train.micro_batch_size=2",
        "train.trace_step=0",
        "logger=none",
        "data=text",
        "data.path={scratch}/corpus.txt",
        "data.cache_dir={scratch}/cache",
        "data.tokenizer=bpe",
        "data.bpe_vocab_size=320",
        files={"corpus.txt": CORPUS * 3},
    )
}


@pytest.mark.multiproc
def test_a_bpe_run_saves_its_tokenizer_in_the_run_directory(case_runs):
    run_dir = case_runs["bpe"]
    scratch = Path(yaml.safe_load((run_dir / "config.yaml").read_text())["data"]["cache_dir"]).parent
    tokenizer = load_tokenizer(run_dir)
    assert tokenizer.kind == "bpe" and 256 < tokenizer.vocab_size <= 320
    trained = _bpe_json(scratch)[0]
    assert json.loads((run_dir / "tokenizer.json").read_text()) == json.loads(trained.read_text())
