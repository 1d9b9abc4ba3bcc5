"""prepare_data.py: JSONL, Parquet, text and `datasets` inputs made here, tokenized by real worker processes into
token files; data=memmap reading them back (dtype, vocabulary, tokenizer); a 2-rank run on prepared data."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import tokenizers
from tokenizers import models, pre_tokenizers

from data import MemmapDataConfig, TextDataConfig, check_data_files, check_vocab, open_token_source, open_tokenizer
from data.prepare import plan_prepare, prepare
from data.prepare_config import PrepareDataConfig
from data.token_files import META_FILE
from data.tokenizer import load_tokenizer, save_run_tokenizer
from tests.runs import REPO, cpu_env
from tests.shared_runs import case

EOS = 256  # the bytes tokenizer's end-of-sequence id
# Documents with what trips tokenizers up: empty ones, multi-byte UTF-8, newlines, a long one.
DOCUMENTS = [f"document {i}: {'é🎉 ' * (i % 3)}line\nnext line {i}" for i in range(40)]
DOCUMENTS[3] = DOCUMENTS[17] = ""
DOCUMENTS[5] = "a long document " * 500


def write_jsonl(path: Path, documents: list[str], field: str = "text") -> Path:
    with open(path, "w", encoding="utf-8") as handle:
        for i, text in enumerate(documents):
            handle.write(json.dumps({"id": i, field: text}) + "\n")
    return path


def write_parquet(path: Path, documents: list[str]) -> Path:
    table = pa.table({"id": list(range(len(documents))), "text": documents})
    pq.write_table(table, path, row_group_size=7)  # several row groups, read in chunks
    return path


def write_text_folder(folder: Path, documents: list[str]) -> Path:
    folder.mkdir()
    for i, text in enumerate(documents):
        (folder / f"doc{i:03d}.txt").write_text(text, encoding="utf-8")
    (folder / ".hidden").write_text("never read")
    return folder


def save_dataset(folder: Path, documents: list[str]) -> Path:
    import datasets

    datasets.Dataset.from_dict({"text": documents, "id": list(range(len(documents)))}).save_to_disk(str(folder))
    return folder


INPUTS = {"jsonl": write_jsonl, "parquet": write_parquet, "text": write_text_folder, "dataset": save_dataset}
NAMES = {"jsonl": "corpus.jsonl", "parquet": "corpus.parquet", "text": "texts", "dataset": "saved"}


def make_input(tmp_path: Path, kind: str, documents: list[str] = DOCUMENTS) -> Path:
    return INPUTS[kind](tmp_path / NAMES[kind], documents)


def run_prepare(source: Path, out: Path, **options) -> str:
    return prepare(PrepareDataConfig(input=str(source), out=str(out), **options))


def read_tokens(out: Path) -> tuple[dict, np.ndarray, np.ndarray]:
    meta = json.loads((out / META_FILE).read_text())
    return meta, np.fromfile(out / "train.bin", dtype=meta["dtype"]), np.fromfile(out / "val.bin", dtype=meta["dtype"])


def split_documents(tokens: np.ndarray, eos: int) -> list[list[int]]:
    """The documents of a token stream that ends every document with ``eos`` (so the stream ends with it)."""
    assert tokens.size == 0 or int(tokens[-1]) == eos
    ends = np.flatnonzero(tokens == eos)
    return [tokens[start + 1 if i else 0 : end].tolist() for i, (start, end) in enumerate(zip([-1, *ends], ends))]


def byte_level_bpe(documents: list[str], vocab_size: int) -> tokenizers.Tokenizer:
    """GPT-2's recipe, small: byte-level pre-tokens, merges learnt from ``documents``, <|endoftext|> its last id."""
    bpe = tokenizers.Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = tokenizers.decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    bpe.train_from_iterator(
        documents, tokenizers.trainers.BpeTrainer(vocab_size=vocab_size - 1, initial_alphabet=alphabet)
    )
    bpe.add_special_tokens(["<|endoftext|>"])
    return bpe


def big_vocab_tokenizer(tmp_path: Path, size: int = 70_000) -> Path:
    """A word-level tokenizer of ``size`` ids, past what uint16 holds: w0 ... w{size-3}, [UNK], <|endoftext|>."""
    vocab = {f"w{i}": i for i in range(size - 2)} | {"[UNK]": size - 2, "<|endoftext|>": size - 1}
    tokenizer = tokenizers.Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    path = tmp_path / "big" / "tokenizer.json"
    path.parent.mkdir()
    tokenizer.save(str(path))
    return path


# --- the files ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", sorted(INPUTS))
def test_one_and_two_workers_write_identical_files_with_eos_after_every_document(tmp_path: Path, kind: str):
    source = make_input(tmp_path, kind)
    run_prepare(source, tmp_path / "one", workers=1, val_count=6)
    run_prepare(source, tmp_path / "two", workers=2, val_count=6)
    for name in ("train.bin", "val.bin", META_FILE):
        assert (tmp_path / "one" / name).read_bytes() == (tmp_path / "two" / name).read_bytes(), name
    meta, train, val = read_tokens(tmp_path / "one")
    assert meta["dtype"] == "uint16" and meta["tokenizer"] == {
        "kind": "bytes",
        "vocab_size": 257,
        "eos_id": EOS,
        "eos_token": "<|endoftext|>",
        "before_document": [],
        "after_document": [],
        "eos_appended": True,
        "file": None,
        "sha256": None,
        "source": None,
    }
    # Every non-empty document whole, in order, in exactly one split, each ended by the EOS id; empty ones skipped.
    train_docs, val_docs = split_documents(train, EOS), split_documents(val, EOS)
    expected = [list(d.encode()) for d in DOCUMENTS if d]
    assert sorted(train_docs + val_docs) == sorted(expected)
    assert train_docs == [d for d in expected if d in train_docs] and val_docs == [d for d in expected if d in val_docs]
    assert meta["empty_documents"] == 2 and meta["source"]["documents"] == 40
    assert (meta["train"]["documents"], meta["val"]["documents"]) == (len(train_docs), len(val_docs))
    assert (meta["train"]["tokens"], meta["val"]["tokens"]) == (train.size, val.size)
    assert len(val_docs) + sum(DOCUMENTS[i] == "" for i in plan_val_documents(source, val_count=6)) == 6
    assert meta["options"]["format"] == kind and "workers" not in meta["options"]
    assert sorted(p.name for p in (tmp_path / "one").iterdir()) == [META_FILE, "train.bin", "val.bin"]


def plan_val_documents(source: Path, **options) -> list[int]:
    plan = plan_prepare(PrepareDataConfig(input=str(source), out=str(source.parent / "unused"), **options))
    return plan.val_documents.tolist()


def test_the_validation_split_is_whole_documents_seeded_by_fraction_or_count(tmp_path: Path):
    source = make_input(tmp_path, "jsonl", [f"doc {i}" for i in range(1000)])
    chosen = plan_val_documents(source, val_fraction=0.05, seed=1)
    assert len(chosen) == 50 and chosen == plan_val_documents(source, val_fraction=0.05, seed=1)
    assert chosen != plan_val_documents(source, val_fraction=0.05, seed=2)
    assert len(plan_val_documents(source, val_count=7)) == 7
    assert plan_val_documents(source, val_fraction=0.0) == []
    run_prepare(source, tmp_path / "out", val_count=7, seed=3)
    _, _, val = read_tokens(tmp_path / "out")
    held = [bytes(d).decode() for d in split_documents(val, EOS)]
    assert held == [f"doc {i}" for i in plan_val_documents(source, val_count=7, seed=3)]


def test_a_vocabulary_past_uint16_writes_uint32_and_data_memmap_reads_it(tmp_path: Path):
    tokenizer_path = big_vocab_tokenizer(tmp_path)
    documents = ["w69997 w1 w65536", "w2 w3", "w69000"] * 20
    out = tmp_path / "out"
    run_prepare(make_input(tmp_path, "jsonl", documents), out, tokenizer=str(tokenizer_path.parent), val_count=3)
    meta, train, val = read_tokens(out)
    eos = 69_999
    assert meta["dtype"] == "uint32" and (meta["tokenizer"]["vocab_size"], meta["tokenizer"]["eos_id"]) == (70_000, eos)
    assert (out / "tokenizer.json").read_bytes() == tokenizer_path.read_bytes()
    assert train[:4].tolist() == [69_997, 1, 65_536, eos] and int(train.max()) == eos
    assert len(split_documents(train, eos)) == 57 and len(split_documents(val, eos)) == 3

    config = MemmapDataConfig(path=str(out))  # the folder itself; its train.bin works too
    config.validate()
    check_vocab(config, 70_000)
    with pytest.raises(ValueError, match=r"model.vocab_size=65536 .*the 70000 ids of the tokenizer in .*least 70000"):
        check_vocab(config, 65_536)
    check_data_files(config, seq_len=8)
    source = open_token_source(MemmapDataConfig(path=str(out / "train.bin")), 70_000)
    assert source.tokens.dtype == np.uint32 and source.has_val and source.num_tokens == train.size
    inputs, labels = source.batch(seed=0, step=0, dp_rank=0, micro=0, micro_batch_size=2, seq_len=8)
    assert int(inputs.max()) >= 65_536 and inputs.dtype.is_floating_point is False
    tokenizer = open_tokenizer(config)
    assert (tokenizer.vocab_size, tokenizer.eos_id) == (70_000, eos) and tokenizer.decode([69_997, 1]) == "w69997 w1"
    save_run_tokenizer(config, tmp_path / "run")
    assert load_tokenizer(tmp_path / "run").encode("w65536 w2") == [65_536, 2]


def test_data_text_uses_the_same_workers_uint32_and_eos_after_every_file(tmp_path: Path):
    big = big_vocab_tokenizer(tmp_path)
    folder = write_text_folder(tmp_path / "texts", ["w1 w65536", "", "w69997\nw2"])
    caches = []
    for workers in (1, 2):
        config = TextDataConfig(
            path=str(folder), cache_dir=str(tmp_path / f"cache{workers}"), tokenizer="bpe", tokenizer_file=str(big)
        )
        config.workers = workers
        source = open_token_source(config, 70_000)
        caches.append(Path(source.path).read_bytes())
    assert caches[0] == caches[1]
    assert source.tokens.dtype == np.uint32 and source.tokens.tolist() == [1, 65_536, 69_999, 69_997, 2, 69_999]
    with pytest.raises(ValueError, match="has 6 bpe tokens"):  # the cache's length is read in uint32 tokens
        check_data_files(config, seq_len=2)


def test_memmap_refuses_metadata_that_disagrees(tmp_path: Path):
    out = tmp_path / "out"
    run_prepare(make_input(tmp_path, "jsonl"), out)
    with pytest.raises(ValueError, match=r"data.vocab_size=50257 disagrees with .*stagecheck_data.json.* 257 ids"):
        MemmapDataConfig(path=str(out), vocab_size=50257).validate()
    big = big_vocab_tokenizer(tmp_path)
    with pytest.raises(ValueError, match="data.tokenizer_file=.* disagrees with .*the bytes tokenizer"):
        MemmapDataConfig(path=str(out), tokenizer_file=str(big)).validate()
    with pytest.raises(ValueError, match=r"model.vocab_size=256 is smaller .*257 ids of the tokenizer"):
        check_vocab(MemmapDataConfig(path=str(out)), 256)
    words = tmp_path / "words"
    run_prepare(write_jsonl(tmp_path / "words.jsonl", ["w1 w2"] * 5), words, tokenizer=str(big))
    with pytest.raises(ValueError, match="data.tokenizer_file=.* is not the tokenizer that wrote the data"):
        MemmapDataConfig(path=str(words), tokenizer_file=str(word_tokenizer(tmp_path))).validate()
    MemmapDataConfig(path=str(words), tokenizer_file=str(words / "tokenizer.json")).validate()  # the same one
    (out / META_FILE).write_text("{")
    with pytest.raises(ValueError, match="is not a stagecheck token description"):
        MemmapDataConfig(path=str(out)).validate()


def test_a_rerun_reuses_the_output_and_other_files_are_never_overwritten(tmp_path: Path):
    source = make_input(tmp_path, "jsonl")
    out = tmp_path / "out"
    run_prepare(source, out, workers=1)
    stamp = (out / "train.bin").stat().st_mtime_ns
    assert "reusing it" in run_prepare(source, out, workers=2)  # workers do not change the output
    assert (out / "train.bin").stat().st_mtime_ns == stamp
    with pytest.raises(ValueError, match=r"out=.* holds other files \(stagecheck_data.json, train.bin, val.bin\)"):
        run_prepare(source, out, seed=5)
    assert (out / "train.bin").stat().st_mtime_ns == stamp
    (tmp_path / "empty").mkdir()
    run_prepare(source, tmp_path / "empty")  # an empty folder is as good as a new one
    assert (tmp_path / "empty" / META_FILE).exists()


def test_a_bpe_tokenizer_json_with_its_tokenizer_config(tmp_path: Path):
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    bpe = byte_level_bpe([d for d in DOCUMENTS if d], 300)
    bpe.add_special_tokens(["</s>"])  # the model's own end of sequence, which its tokenizer_config.json names
    bpe.save(str(model_dir / "tokenizer.json"))
    (model_dir / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": "</s>"}}))
    run_prepare(make_input(tmp_path, "parquet"), tmp_path / "out", tokenizer=str(model_dir), val_count=0)
    meta, train, val = read_tokens(tmp_path / "out")
    eos = bpe.token_to_id("</s>")
    assert (meta["tokenizer"]["eos_token"], meta["tokenizer"]["eos_id"], val.size) == ("</s>", eos, 0)
    assert [bpe.decode(d) for d in split_documents(train, eos)] == [d for d in DOCUMENTS if d]
    with pytest.raises(ValueError, match="eos_token='<eos>' is not a token of the tokenizer"):
        run_prepare(tmp_path / "corpus.parquet", tmp_path / "x", tokenizer=str(model_dir), eos_token="<eos>")


# --- token files equal tokenizer.encode(document), for byte-level and Metaspace tokenizers --------------------------

# Text that a cut inside a document would tokenize differently: blank lines before code (GPT-2's pattern makes "\n\n"
# one pre-token at a piece's end), lines starting with a letter (where a Metaspace tokenizer would prepend "▁"), and
# one document bigger than a 1 MiB read.
CODE = "".join(f"x = {i}\n\ndef f{i % 7}():\n    return x\nwhile x:\n pass\n" for i in range(30_000))
CUT_DOCUMENTS = [CODE, "Hello world\nsecond line", "", "déjà vu 🎉\n\n\nend", "word " * 300]


def metaspace_bpe(documents: list[str]) -> tokenizers.Tokenizer:
    """Llama 2's recipe, small: Metaspace pre-tokens ("▁" before the first word), merges learnt from ``documents``,
    and a post-processor that puts <s> before every text."""
    bpe = tokenizers.Tokenizer(models.BPE(unk_token="<unk>"))
    bpe.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    bpe.decoder = tokenizers.decoders.Metaspace(replacement="▁", prepend_scheme="first")
    trainer = tokenizers.trainers.BpeTrainer(vocab_size=400, special_tokens=["<unk>", "<s>", "</s>"])
    bpe.train_from_iterator([d[:20_000] for d in documents], trainer)
    bpe.post_processor = tokenizers.processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    return bpe


TOKENIZERS = {
    "byte-level": lambda documents: byte_level_bpe([d[:20_000] for d in documents], 400),
    "metaspace": metaspace_bpe,
}


@pytest.mark.parametrize("kind", ["text", "jsonl"])
@pytest.mark.parametrize("name", sorted(TOKENIZERS))
def test_prepared_documents_are_tokenizer_encode_at_one_and_two_workers(
    tmp_path: Path, name: str, kind: str, monkeypatch
):
    from data import tokenize_pool

    monkeypatch.setattr(tokenize_pool, "IN_FLIGHT_BYTES", 1 << 10)  # the 1.3 MB document waits for those before it
    hf = TOKENIZERS[name]([d for d in CUT_DOCUMENTS if d])
    hf.save(str(tmp_path / "tokenizer.json"))
    source = make_input(tmp_path, kind, CUT_DOCUMENTS)
    for workers in (1, 2):
        run_prepare(source, tmp_path / f"w{workers}", tokenizer=str(tmp_path / "tokenizer.json"), workers=workers)
    assert (tmp_path / "w1" / "train.bin").read_bytes() == (tmp_path / "w2" / "train.bin").read_bytes()
    meta, train, _ = read_tokens(tmp_path / "w1")
    eos = meta["tokenizer"]["eos_id"]
    expected = [hf.encode(d).ids for d in CUT_DOCUMENTS if d]  # the post-processor's special tokens included
    assert split_documents(train, eos) == expected
    bos = [] if name == "byte-level" else [hf.token_to_id("<s>")]
    assert (meta["tokenizer"]["before_document"], meta["tokenizer"]["after_document"]) == (bos, [])
    assert meta["tokenizer"]["eos_appended"] and meta["format"] == "stagecheck-tokens-v2"
    tokenizer = open_tokenizer(MemmapDataConfig(path=str(tmp_path / "w1")))  # what a run on the files reads
    assert (tokenizer.before_document, tokenizer.eos_appended) == (bos, True)


def test_data_text_files_are_tokenizer_encode_with_the_post_processors_bos(tmp_path: Path):
    hf = metaspace_bpe([d for d in CUT_DOCUMENTS if d])
    hf.save(str(tmp_path / "tokenizer.json"))
    folder = write_text_folder(tmp_path / "texts", CUT_DOCUMENTS)
    config = TextDataConfig(
        path=str(folder),
        cache_dir=str(tmp_path / "cache"),
        tokenizer="bpe",
        tokenizer_file=str(tmp_path / "tokenizer.json"),
    )
    config.workers = 2
    tokens = open_token_source(config, 400).tokens
    eos = hf.token_to_id("</s>")
    assert split_documents(np.asarray(tokens), eos) == [hf.encode(d).ids for d in CUT_DOCUMENTS if d]


# --- bad input: one message naming the file and line or row, and no file written ----------------------------------


def refused(tmp_path: Path, source: Path, match: str, **options) -> None:
    out = tmp_path / "refused"
    with pytest.raises(ValueError, match=match):
        run_prepare(source, out, **options)
    assert not out.exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".refused")]


def test_bad_input_names_the_file_and_line(tmp_path: Path):
    jsonl = write_jsonl(tmp_path / "c.jsonl", DOCUMENTS)
    with open(jsonl, "a") as handle:
        handle.write('{"text": "cut off\n{"other": "x"}\n')
    refused(tmp_path, jsonl, rf"{jsonl}:41: malformed JSON at column 10 \(Unterminated string", workers=2)
    write_jsonl(jsonl, ["a", "b"], field="body")
    refused(tmp_path, jsonl, rf"{jsonl}:1: the record has no field 'text' \(fields: id, body\): set text_field")
    run_prepare(jsonl, tmp_path / "body", text_field="body", val_count=0)
    texts = write_text_folder(tmp_path / "texts", ["fine"])
    (texts / "latin1.txt").write_bytes(b"line one\nline two\ncaf\xe9\n")
    refused(tmp_path, texts, rf"{texts / 'latin1.txt'}:3: the file is not UTF-8 text")
    (tmp_path / "empty.jsonl").write_text("")
    refused(tmp_path, tmp_path / "empty.jsonl", "input=.*empty.jsonl' is empty: it holds no jsonl documents")
    write_jsonl(tmp_path / "blank.jsonl", ["", ""])
    refused(tmp_path, tmp_path / "blank.jsonl", r"holds only empty documents \(2\)", val_count=0)
    table = tmp_path / "t.parquet"
    pq.write_table(pa.table({"body": ["x"]}), table)
    refused(tmp_path, table, rf"{table} has no column 'text' \(columns: body\)")
    refused(tmp_path, jsonl, "val_count=2 holds out 2 of the input's 2 documents", val_count=2, text_field="body")
    refused(tmp_path, jsonl, "tokenizer=.* names no end-of-sequence token", tokenizer=str(word_tokenizer(tmp_path)))


def word_tokenizer(tmp_path: Path) -> Path:
    path = tmp_path / "words.json"
    path.write_text(tokenizers.Tokenizer(models.WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]")).to_str())
    return path


def command(*overrides: str, cwd: Path) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, str(REPO / "prepare_data.py"), *overrides],
        cwd=cwd,
        env=cpu_env(cwd),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def test_the_command_ends_bad_input_with_one_line_and_exit_code_2(tmp_path: Path):
    jsonl = tmp_path / "c.jsonl"
    jsonl.write_text('{"text": "a"}\n{"text": 3}\n')
    _, stderr = (process := command(f"input={jsonl}", f"out={tmp_path / 'out'}", cwd=tmp_path)).communicate(timeout=120)
    assert process.returncode == 2 and "Traceback" not in stderr, stderr
    assert f"stagecheck: error: {jsonl}:2: field 'text' holds a int, not a string" in stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.jsonl"]


def test_an_interrupted_prepare_leaves_nothing_a_run_would_accept(tmp_path: Path):
    source = write_jsonl(tmp_path / "big.jsonl", [f"document {i} " * 40 for i in range(8_000)])  # about 5 MB
    out = tmp_path / "out"
    process = command(f"input={source}", f"out={out}", "workers=1", cwd=tmp_path)
    deadline = time.monotonic() + 120
    while not [p for p in tmp_path.iterdir() if p.name.startswith(".out.tmp-")] and time.monotonic() < deadline:
        assert process.poll() is None, process.communicate()
        time.sleep(0.01)
    os.kill(process.pid, signal.SIGKILL)  # no clean-up runs
    process.communicate(timeout=60)
    assert not out.exists()
    with pytest.raises(ValueError, match="data.path=.* does not exist"):
        MemmapDataConfig(path=str(out)).validate()
    # The next prepare of the same `out` removes what the killed one left, and finishes.
    run_prepare(source, out, val_count=10)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["big.jsonl", "out"]


# --- a 2-rank run on prepared data (a job of the shared launch) ----------------------------------------------------

RUN_DOCUMENTS = [f"def function_{i}(value):\n    return value * {i}\n" for i in range(400)]
RUN_VOCAB = 300


def prepare_run_corpus(scratch: Path) -> None:
    byte_level_bpe(RUN_DOCUMENTS, RUN_VOCAB).save(str(scratch / "tokenizer.json"))
    corpus = write_jsonl(scratch / "corpus.jsonl", RUN_DOCUMENTS)
    run_prepare(corpus, scratch / "prepared", tokenizer=str(scratch / "tokenizer.json"), val_count=20, workers=2)


CASES = {
    "prepared": case(
        "model=tiny",
        f"model.vocab_size={RUN_VOCAB}",
        "model.seq_len=32",
        "data=memmap",
        "data.path={scratch}/prepared",
        "train.device=cpu",
        "train.steps=4",
        "train.micro_batches=2",
        "train.micro_batch_size=2",
        "train.eval_every=2",
        "train.eval_batches=1",
        "train.trace_step=0",
        "logger=none",
        setup=prepare_run_corpus,
    )
}


@pytest.mark.multiproc
def test_a_run_on_prepared_data_trains_evaluates_and_samples_with_its_tokenizer(case_runs, tmp_path: Path):
    from transformers import AutoTokenizer

    from harness.generation import sample_text
    from harness.hf.export import export_hf
    from schema.scripts import ExportConfig, GenerateConfig

    run_dir = case_runs["prepared"]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 4 and summary.get("val_loss") is not None, summary
    prepared = run_dir.parent.parent / "files" / run_dir.name / "prepared"
    assert json.loads((run_dir / "tokenizer.json").read_text()) == json.loads((prepared / "tokenizer.json").read_text())
    tokenizer = load_tokenizer(run_dir)
    assert (tokenizer.kind, tokenizer.vocab_size, tokenizer.eos_id) == ("bpe", RUN_VOCAB, RUN_VOCAB - 1)
    sample = sample_text(GenerateConfig(checkpoint=str(run_dir), prompt="def", max_new_tokens=20, device="cpu"))
    assert sample.startswith("def") and len(tokenizer.encode(sample)) > len(tokenizer.encode("def"))
    exported = AutoTokenizer.from_pretrained(export_hf(ExportConfig(checkpoint=str(run_dir), out=str(tmp_path / "hf"))))
    assert exported.eos_token == "<|endoftext|>" and exported.eos_token_id == RUN_VOCAB - 1


@pytest.mark.multiproc
def test_evaluating_the_2_stage_checkpoint_equals_evaluating_its_export(case_runs, tmp_path: Path):
    """evaluate.py on the checkpoint, in this process's model, against lm-eval's own hf model on its export."""
    from harness.consolidate import consolidate
    from harness.hf.export import export_hf
    from harness.lm_evaluation import evaluate
    from schema.scripts import EvaluateConfig, ExportConfig
    from tests import wandb_file
    from tests.test_evaluate import TASKS, assert_same_evaluation, read_samples

    run_dir = case_runs["prepared"]
    assert consolidate(run_dir).checkpoint.meta["pipeline_stages"] == 2
    prepared = run_dir.parent.parent / "files" / run_dir.name / "prepared"
    export = export_hf(ExportConfig(checkpoint=str(run_dir), out=str(tmp_path / "hf")))
    options = [f"tasks=[{','.join(TASKS)}]", f"val_data={prepared}", "device=cpu"]
    ours = subprocess.run(
        [sys.executable, str(REPO / "evaluate.py"), f"checkpoint={run_dir}", f"out={tmp_path / 'ours'}", *options],
        cwd=tmp_path,
        env=cpu_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert ours.returncode == 0, ours.stderr[-4000:]
    assert ours.stdout.splitlines()[-1].startswith("stagecheck: eval done | stagecheck_mc/acc ")
    config = EvaluateConfig(pretrained=str(export), out=str(tmp_path / "hf_eval"), tasks=TASKS, val_data=str(prepared))
    evaluate(config)
    results = assert_same_evaluation(tmp_path / "ours", tmp_path / "hf_eval", TASKS)
    assert len(read_samples(tmp_path / "ours", "stagecheck_val_ppl")) == 20  # every held-out document
    assert results["stagecheck_val_ppl"]["bits_per_byte,none"] > 0
    (run_file,) = wandb_file.find_run_files(tmp_path / "ours")  # the command's W&B run, complete once it exited
    assert wandb_file.summary(run_file)["stagecheck_mc/acc"] == results["stagecheck_mc"]["acc,none"]
