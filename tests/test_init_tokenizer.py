"""model.init_from's tokenizer against the data's (harness/init_tokenizer.py): prepared data tokenized by another
tokenizer, or by one bigger than the model's vocabulary, and an explicit data.tokenizer_file that maps tokens to other
ids are refused at start-up, each naming which tokenizer came from where and what to change. In process."""

import json
from pathlib import Path

import pytest
import tokenizers
from omegaconf import OmegaConf

from data.prepare import prepare
from data.prepare_config import PrepareDataConfig
from harness.hf.checkpoint import open_hf_dir
from harness.hf.init_from import pick_tokenizer

LLAMA = {
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 176,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 1,
    "max_position_embeddings": 64,
    "vocab_size": 1000,
}


def words(path: Path, size: int, shift: int = 0) -> Path:
    """A word-level tokenizer of `size` ids: w0 ... w{size-2} (w_i at id (i + shift) mod (size - 1)), then
    <|endoftext|>."""
    vocab = {f"w{i}": (i + shift) % (size - 1) for i in range(size - 1)} | {"<|endoftext|>": size - 1}
    tokenizer = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="w0"))
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    path.parent.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(path))
    return path


def prepared(tmp_path: Path, name: str, tokenizer: str) -> Path:
    corpus = tmp_path / f"{name}.jsonl"
    corpus.write_text("".join(json.dumps({"text": "w1 w2 w3 " * 20}) + "\n" for _ in range(8)))
    out = tmp_path / name
    prepare(PrepareDataConfig(input=str(corpus), out=str(out), tokenizer=tokenizer))
    return out


@pytest.fixture
def model_dir(tmp_path):
    directory = tmp_path / "hf"
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps(LLAMA))
    words(directory / "tokenizer.json", 1000)
    return directory


def data_after(model_dir: Path, overridden=(), **data) -> dict:
    cfg = OmegaConf.create({"model": {"vocab_size": 1000}, "data": {"tokenizer_file": None, **data}})
    pick_tokenizer(cfg, open_hf_dir(str(model_dir), need_weights=False), set(overridden))
    return dict(cfg.data)


def test_prepared_data_of_the_models_tokenizer_keeps_the_folders(tmp_path, model_dir):
    folder = prepared(tmp_path, "same", str(model_dir / "tokenizer.json"))
    assert data_after(model_dir, name="memmap", path=str(folder))["tokenizer_file"] is None


def test_prepared_data_of_another_tokenizer_names_both_and_the_prepare_command(tmp_path, model_dir):
    """The issue's case: the message said "leave data.tokenizer_file unset", which the user never set."""
    folder = prepared(tmp_path, "other", str(words(tmp_path / "other_tok" / "tokenizer.json", 1000, shift=1)))
    with pytest.raises(ValueError) as refusal:
        data_after(model_dir, name="memmap", path=str(folder))
    message = str(refusal.value)
    meta = folder / "stagecheck_data.json"
    assert f"data.path={str(folder)!r} was prepared ({meta}) with the tokenizer saved there" in message
    assert f"other ids than model.init_from={model_dir}'s tokenizer.json" in message
    assert f"`python prepare_data.py input=CORPUS out=NEW_DIR tokenizer={model_dir}`" in message
    assert "data.tokenizer_file" not in message
    bytes_folder = prepared(tmp_path, "bytes", "bytes")
    with pytest.raises(ValueError, match=r"was prepared .* with the bytes tokenizer, and model.init_from=.* reads"):
        data_after(model_dir, name="memmap", path=str(bytes_folder))


def test_a_bigger_vocabulary_gets_its_own_message(tmp_path, model_dir):
    folder = prepared(tmp_path, "big", str(words(tmp_path / "big_tok" / "tokenizer.json", 2000)))
    with pytest.raises(ValueError) as refusal:
        data_after(model_dir, name="memmap", path=str(folder))
    assert "with a tokenizer of 2,000 token ids, and model.init_from=" in str(refusal.value)
    assert "embeds 1,000 (its config.json vocab_size): ids past 999 have no embedding" in str(refusal.value)


def test_an_explicit_tokenizer_file_must_map_tokens_as_the_models_own(tmp_path, model_dir):
    """Another tokenizer.json beside model.init_from was accepted silently; one that differs only in its
    pre-tokenizer (the same token -> id map) is the same tokenizer to the model."""
    other = words(tmp_path / "shifted.json", 1000, shift=1)
    with pytest.raises(ValueError, match=r"data.tokenizer_file=.*shifted.json' maps tokens to other ids than "):
        data_after(model_dir, ["data.tokenizer_file"], name="text", tokenizer="bpe", tokenizer_file=str(other))
    same = tokenizers.Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    same.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    same.save(str(tmp_path / "same.json"))
    chosen = str(tmp_path / "same.json")
    kept = data_after(model_dir, ["data.tokenizer_file"], name="text", tokenizer="bpe", tokenizer_file=chosen)
    assert kept["tokenizer_file"] == chosen
