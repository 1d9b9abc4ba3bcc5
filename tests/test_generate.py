"""Sampling with a KV cache (model/sampling.py) and generate.py on a real 2-stage training run's checkpoint."""

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import tokenizers
import torch
from transformers import AutoTokenizer, GPT2LMHeadModel

from data.tokenizer import Tokenizer, load_tokenizer, save_tokenizer
from harness.checkpoint import read_checkpoint
from harness.consolidate import consolidate
from harness.generation import sample_text
from harness.hf.export import export_hf
from model import GPT, GPTConfig
from model.sampling import SamplingConfig, generate
from schema.scripts import ExportConfig, GenerateConfig
from tests.runs import REPO, cpu_env
from tests.shared_runs import case

TINY = {"n_layer": 2, "n_head": 2, "n_embd": 32, "seq_len": 32, "vocab_size": 64}


def tiny_model(attention: str = "sdpa", dropout: float = 0.0) -> GPT:
    return GPT(GPTConfig(**TINY, attention=attention, dropout=dropout), seed=3)


def prompt_tokens(batch: int, length: int) -> torch.Tensor:
    return torch.randint(0, TINY["vocab_size"], (batch, length), generator=torch.Generator().manual_seed(5))


@pytest.mark.parametrize("attention", ["sdpa", "math"])
@torch.no_grad()
def test_cached_logits_equal_the_full_forward(attention):
    model = tiny_model(attention).eval()
    idx = prompt_tokens(2, TINY["seq_len"])
    caches = model.new_caches(batch=2)
    # A prompt, one token, then the rest: each call covers only the positions after those cached.
    pieces = [model.forward_cached(idx[:, a:b], caches) for a, b in ((0, 7), (7, 8), (8, TINY["seq_len"]))]
    torch.testing.assert_close(torch.cat(pieces, dim=1), model(idx), atol=1e-5, rtol=0)
    assert [cache.length for cache in caches] == [TINY["seq_len"]] * TINY["n_layer"]


@torch.no_grad()
def test_sampling_runs_without_dropout_and_keeps_the_model_mode():
    model = tiny_model(dropout=0.5).train()
    prompt = prompt_tokens(2, 4)
    greedy = generate(model, prompt, SamplingConfig(max_new_tokens=12, temperature=0.0))
    assert model.training
    # The same tokens, one full forward (eval mode, no cache) per token.
    model.eval()
    idx = prompt
    for _ in range(12):
        idx = torch.cat([idx, model(idx)[:, -1].argmax(dim=-1, keepdim=True)], dim=1)
    assert greedy.tolist() == idx[:, 4:].tolist()


@torch.no_grad()
def test_the_same_seed_gives_the_same_tokens():
    model = tiny_model().eval()
    prompt = prompt_tokens(3, 4)

    def sample(**options) -> list:
        return generate(model, prompt, SamplingConfig(max_new_tokens=20, **options)).tolist()

    assert sample(temperature=1.0, top_k=10, seed=7) == sample(temperature=1.0, top_k=10, seed=7)
    assert sample(temperature=1.0, top_k=10, seed=7) != sample(temperature=1.0, top_k=10, seed=8)
    assert sample(temperature=1.0, top_k=1, seed=7) == sample(temperature=0.0)  # top_k=1 is greedy
    assert max(max(row) for row in sample(temperature=2.0, seed=1, vocab_size=5)) < 5


@torch.no_grad()
def test_sampling_stops_once_every_row_drew_the_stop_id():
    model = tiny_model().eval()
    prompt = prompt_tokens(2, 4)
    full = generate(model, prompt, SamplingConfig(max_new_tokens=12, temperature=0.0)).tolist()
    stop = full[0][2]  # row 0 draws it third; row 1 may draw it later, or never
    stopped = generate(model, prompt, SamplingConfig(max_new_tokens=12, temperature=0.0, stop_id=stop)).tolist()
    last = max(row.index(stop) if stop in row else len(row) - 1 for row in full)
    assert stopped == [row[: last + 1] for row in full]
    assert len(stopped[0]) < 12 or stop not in full[1]


def test_prompt_and_new_tokens_must_fit_the_positions():
    with pytest.raises(ValueError, match=r"max_new_tokens=30 is 34 positions, more than model.seq_len=32"):
        generate(tiny_model(), prompt_tokens(1, 4), SamplingConfig(max_new_tokens=30))


def test_activation_is_validated():
    with pytest.raises(ValueError, match=r"model.activation='relu' is unknown: allowed values are gelu, gelu_tanh"):
        GPTConfig(activation="relu")


# ---- generate.py and export_hf.py on a real 2-stage training run -------------------------------------------------

CORPUS = "".join(f"The cat number {i} sat on the mat and looked at the moon.\n" for i in range(300))
SEQ_LEN = 64
STEPS = 2


def tiny_run(pipeline_stages: int):
    """A 2-rank run of a 2-block model on a small text corpus; its checkpoint is the one of the last step."""
    return case(
        "model=tiny",
        "model.n_layer=2",
        f"model.seq_len={SEQ_LEN}",
        "model.vocab_size=320",  # room for the BPE a test saves into a copy of the run
        "data=text",
        "data.path={scratch}/corpus.txt",
        "data.cache_dir={scratch}/cache",
        "logger=none",
        "train.device=cpu",
        f"train.steps={STEPS}",
        "train.micro_batches=2",
        "train.micro_batch_size=2",
        "train.trace_step=0",
        f"parallel.pipeline_stages={pipeline_stages}",
        files={"corpus.txt": CORPUS},
    )


# 2 pipeline stages; 1 stage x 2 data-parallel ranks
CASES = {"pipelined": tiny_run(pipeline_stages=2), "data-parallel": tiny_run(pipeline_stages=1)}


@pytest.fixture(scope="module")
def trained(case_runs) -> Path:
    """2 pipeline stages."""
    return case_runs["pipelined"]


def script(name: str, cwd: Path, *overrides: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(REPO / name), *overrides],
        cwd=cwd,
        env=cpu_env(cwd),
        capture_output=True,
        text=True,
        timeout=120,
    )


def check_layers_trained_from_their_init(run_dir: Path) -> dict:
    """Each flat layer lands where it started: the trained weights are within the few Adam steps of their own
    layer's initialisation (a layer in another place would be a different random draw), and did move. Returns
    the checkpoint's stagecheck.json."""
    loaded = consolidate(run_dir, option="checkpoint")
    assert loaded.checkpoint.step == STEPS
    init = GPT(loaded.model.config, seed=1234).state_dict()
    moved = 0.0
    for name, weight in loaded.model.state_dict().items():
        drift = (weight - init[name]).abs().max().item()
        assert drift < 3 * STEPS * 6e-4, name  # Adam moves a weight by at most about lr per step
        moved = max(moved, drift)
    assert moved > 0
    return loaded.checkpoint.meta


@pytest.mark.multiproc
def test_a_pipelined_checkpoint_consolidates_layer_for_layer(trained):
    assert check_layers_trained_from_their_init(trained)["pipeline_stages"] == 2


@pytest.mark.multiproc
def test_a_data_parallel_checkpoint_consolidates_layer_for_layer(case_runs):
    """1 stage x 2 data-parallel ranks: the replicas' files are written once, by data-parallel rank 0."""
    meta = check_layers_trained_from_their_init(case_runs["data-parallel"])
    assert (meta["pipeline_stages"], meta["data_parallel_size"]) == (1, 2)


@pytest.mark.multiproc
def test_generate_gives_the_same_text_for_the_same_seed(trained, tmp_path):
    options = [f"checkpoint={trained}", "prompt=The cat", "max_new_tokens=24", "seed=3", "device=cpu"]
    first = script("generate.py", tmp_path, *options)
    assert first.returncode == 0, first.stderr
    assert first.stdout.startswith("The cat")
    assert not list(tmp_path.iterdir())  # no run directory, .hydra/ or log file
    config = GenerateConfig(checkpoint=str(trained), prompt="The cat", max_new_tokens=24, seed=3, device="cpu")
    assert sample_text(config) + "\n" == first.stdout  # the same in another process
    config.seed = 4
    assert sample_text(config) + "\n" != first.stdout


@pytest.mark.multiproc
def test_export_of_the_checkpoint_loads_in_transformers(trained, tmp_path):
    out = export_hf(ExportConfig(checkpoint=str(trained / "checkpoints"), out=str(tmp_path / "hf")))
    assert not (out / "tokenizer.json").exists()  # a bytes run: the weights alone
    reloaded = GPT2LMHeadModel.from_pretrained(out).eval()
    ours = consolidate(trained).model
    idx = torch.randint(0, 256, (2, SEQ_LEN), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(reloaded(idx).logits, ours(idx), atol=1e-5, rtol=0)


@pytest.fixture
def bpe_run(trained, tmp_path) -> Path:
    """A copy of the run whose saved tokenizer, in the run directory and in its checkpoint (as training saves it), is
    a byte-level BPE of 300 ids (the model has 320)."""
    run_dir = tmp_path / "bpe_run"
    shutil.copytree(trained, run_dir)
    hf = tokenizers.Tokenizer(tokenizers.models.BPE())
    hf.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = tokenizers.decoders.ByteLevel()
    alphabet = tokenizers.pre_tokenizers.ByteLevel.alphabet()
    hf.train_from_iterator([CORPUS], tokenizers.trainers.BpeTrainer(vocab_size=300, initial_alphabet=alphabet))
    for folder in (run_dir, consolidate(run_dir).checkpoint.path):
        save_tokenizer(Tokenizer(hf), folder)
    return run_dir


@pytest.mark.multiproc
def test_generate_ends_at_the_tokenizers_end_of_sequence_unless_asked_to_go_on(bpe_run):
    """As Hugging Face's `generate`: the sample stops at the tokenizer's end-of-sequence token and does not print
    it; stop_at_eos=false samples on, into the next document."""
    config = GenerateConfig(checkpoint=str(bpe_run), prompt="The cat", max_new_tokens=12, temperature=0.0)
    config.device, config.stop_at_eos = "cpu", False
    tokenizer = load_tokenizer(bpe_run)
    prompt = tokenizer.encode("The cat")
    on = tokenizer.encode(sample_text(config))[len(prompt) :]
    eos = on[3]  # the run's tokenizer ends documents with the fourth greedy token
    for folder in (bpe_run, consolidate(bpe_run).checkpoint.path):
        save_tokenizer(Tokenizer(tokenizer.hf, eos_id=eos), folder)
    assert sample_text(config) == tokenizer.decode(prompt + on)
    config.stop_at_eos = True
    assert sample_text(config) == tokenizer.decode(prompt + on[: on.index(eos)])


@pytest.mark.multiproc
def test_a_checkpoint_keeps_the_tokenizer_of_its_run(trained, bpe_run, tmp_path):
    """Training copies the run's tokenizer into every checkpoint, so a checkpoint moved away from its run still
    decodes with the tokenizer that trained it, not silently with bytes."""
    tag_dir = consolidate(trained).checkpoint.path
    assert json.loads((tag_dir / "stagecheck_tokenizer.json").read_text())["kind"] == "bytes"
    moved = tmp_path / "moved" / "step"
    shutil.copytree(consolidate(bpe_run).checkpoint.path, moved)
    assert load_tokenizer(consolidate(moved).tokenizer_dir).kind == "bpe"


@pytest.mark.multiproc
def test_export_writes_a_bpe_tokenizer_that_transformers_loads(bpe_run, tmp_path):
    out = export_hf(ExportConfig(checkpoint=str(bpe_run), out=str(tmp_path / "hf")))
    theirs = AutoTokenizer.from_pretrained(out)
    ours = load_tokenizer(bpe_run)
    text = "The cat sat on the moon."
    assert theirs(text).input_ids == ours.encode(text)
    assert theirs.decode(ours.encode(text)) == text


@pytest.mark.multiproc
def test_a_prompt_the_tokenizer_cannot_encode_is_refused(trained, tmp_path):
    run_dir = tmp_path / "word_run"
    shutil.copytree(trained, run_dir)
    hf = tokenizers.Tokenizer(tokenizers.models.WordLevel({"the": 0, "cat": 1, "[UNK]": 2}, unk_token="[UNK]"))
    hf.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    for folder in (run_dir, consolidate(run_dir).checkpoint.path):
        save_tokenizer(Tokenizer(hf), folder)
    with pytest.raises(ValueError, match=r"prompt='the dog' cannot be encoded by the run's tokenizer: .*'dgo'"):
        sample_text(GenerateConfig(checkpoint=str(run_dir), prompt="the dog", device="cpu"))


@pytest.mark.multiproc
def test_evaluate_refuses_a_run_whose_tokenizer_ends_no_document(trained, tmp_path):
    """data=text's bytes tokenizer has no EOS id, on which lm-eval conditions a document's first token."""
    from harness.lm_evaluation import evaluate
    from schema.scripts import EvaluateConfig

    with pytest.raises(ValueError, match=r"checkpoint=.*: the run's bytes tokenizer of 256 ids has no end-of-sequence"):
        evaluate(EvaluateConfig(checkpoint=str(trained), out=str(tmp_path / "eval"), device="cpu"))
    assert not (tmp_path / "eval").exists()


BAD_GENERATE = [
    ({"checkpoint": None}, "checkpoint=None is not set"),
    ({"checkpoint": "/no/such/run"}, "checkpoint='/no/such/run' is not a complete stagecheck checkpoint"),
    ({"prompt": ""}, "prompt='' is empty"),
    ({"max_new_tokens": 0}, "max_new_tokens=0 is invalid: it must be an integer >= 1"),
    ({"top_k": 0}, "top_k=0 is invalid: it must be an integer >= 1, or null"),
    ({"temperature": -0.5}, "temperature=-0.5 is invalid: it must be >= 0"),
    ({"device": "tpu"}, "device='tpu' is unknown: allowed values are auto, cpu, cuda"),
    ({"max_new_tokens": 62}, "max_new_tokens=62 plus the prompt's 3 tokens exceeds the model's seq_len=64"),
]


@pytest.mark.multiproc
@pytest.mark.parametrize("options, message", BAD_GENERATE, ids=[m.split(" ")[0] for _, m in BAD_GENERATE])
def test_bad_generate_input_names_the_option(trained, options, message):
    config = GenerateConfig(**{"checkpoint": str(trained), "prompt": "The", "device": "cpu", **options})
    with pytest.raises(ValueError, match=re.escape(message)):
        config.validate()
        sample_text(config)


@pytest.mark.multiproc
def test_an_incomplete_checkpoint_is_refused(trained, tmp_path):
    tag = tmp_path / "step"
    shutil.copytree(read_checkpoint(trained).path, tag)
    (tag / "layer_03-model_states.pt").unlink()
    with pytest.raises(ValueError, match=r"checkpoint=.* is incomplete: layer_03-model_states.pt is missing"):
        consolidate(tag, option="checkpoint")


@pytest.mark.multiproc
def test_the_commands_exit_2_with_one_line_for_bad_input(trained, tmp_path):
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "file").write_text("mine")
    cases = [
        ("generate.py", [f"checkpoint={trained}", "top_k=0"], "top_k=0 is invalid"),
        ("export_hf.py", [f"checkpoint={trained}", f"out={tmp_path / 'taken'}"], "exists and is not an empty"),
        ("export_hf.py", [f"checkpoint={trained}", f"out={tmp_path / 'new'}", "dtype=int8"], "dtype='int8' is unknown"),
    ]
    for name, overrides, message in cases:
        result = script(name, tmp_path, *overrides)
        assert result.returncode == 2, (name, result.stderr)
        assert result.stderr.startswith("stagecheck: error: ") and message in result.stderr, result.stderr
        assert "Traceback" not in result.stderr + result.stdout
    assert [p.name for p in (tmp_path / "taken").iterdir()] == ["file"]
