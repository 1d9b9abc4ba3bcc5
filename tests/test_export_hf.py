"""Hugging Face exports: a small random GPT2LMHeadModel, built locally (no hub), imported into model.GPT through
model/hf/format.py, exported by harness/hf/export.py and reloaded by transformers gives HF's logits, and our greedy
sampler gives HF's greedy tokens; an export from scratch says where its values came from; random Llama-3.1, Qwen2.5
and Qwen3 models fine-tuned two steps export with what the source had (harness/hf/source.py)."""

import json
import tempfile
from pathlib import Path

import pytest
import tokenizers
import torch
import transformers
import yaml
from safetensors import safe_open
from transformers import GPT2Config, GPT2LMHeadModel

from harness.checkpoint import read_checkpoint
from harness.generation import sample_text
from harness.hf.export import export_hf, write_hf_dir
from harness.hf.source import SOURCE_FILE
from model import GPT, GPTConfig, gpt_layers, module_entries
from model.hf.format import layer_state_from_hf
from model.hf.gpt2 import HF_PREFIX, gpt_config_from_hf
from model.sampling import SamplingConfig, generate
from schema.scripts import ExportConfig, GenerateConfig
from tests.shared_runs import case

SHAPE = {"n_layer": 2, "n_head": 2, "n_embd": 32, "n_positions": 32, "vocab_size": 256}


@pytest.fixture(scope="module")
def hf_model() -> GPT2LMHeadModel:
    torch.manual_seed(0)
    config = GPT2Config(**SHAPE, activation_function="gelu_new", resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    model = GPT2LMHeadModel(config).eval()
    with torch.no_grad():  # HF starts biases at 0 and gains at 1: random ones show a bias or gain mapped wrongly
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.05)
    model.generation_config.eos_token_id = None  # generate every token asked for, as our sampler does
    return model


def import_hf(hf_model: GPT2LMHeadModel) -> GPT:
    config = GPTConfig(**gpt_config_from_hf(hf_model.config.to_dict()))
    hf_state = hf_model.state_dict()

    def get(name: str) -> torch.Tensor:
        return hf_state[HF_PREFIX + name]

    states = {i: layer_state_from_hf(config, i, get) for i in module_entries(gpt_layers(config, seed=0))}
    return GPT.from_layer_states(config, states).eval()


def tokens(*shape: int) -> torch.Tensor:
    return torch.randint(0, SHAPE["vocab_size"], shape, generator=torch.Generator().manual_seed(1))


@torch.no_grad()
def test_imported_model_gives_hf_logits(hf_model):
    ours = import_hf(hf_model)
    assert ours.config.activation == "gelu_tanh"
    idx = tokens(2, SHAPE["n_positions"])
    torch.testing.assert_close(ours(idx), hf_model(idx).logits, atol=1e-5, rtol=0)


@torch.no_grad()
def test_export_loads_in_transformers_with_hf_logits(hf_model, tmp_path):
    out = tmp_path / "export"
    write_hf_dir(import_hf(hf_model), None, out)
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "generation_config.json", "model.safetensors"]
    assert json.loads((out / "config.json").read_text())["activation_function"] == "gelu_new"
    reloaded = GPT2LMHeadModel.from_pretrained(out).eval()
    assert reloaded.lm_head.weight.data_ptr() == reloaded.transformer.wte.weight.data_ptr()  # tied by HF itself
    idx = tokens(2, SHAPE["n_positions"])
    torch.testing.assert_close(reloaded(idx).logits, hf_model(idx).logits, atol=1e-5, rtol=0)
    assert not list(tmp_path.glob(".export.tmp-*"))  # the temporary directory became `out`


def test_export_refuses_a_directory_that_is_not_empty(hf_model, tmp_path):
    (tmp_path / "kept.txt").write_text("mine")
    with pytest.raises(ValueError, match=r"out=.* exists and is not an empty directory"):
        write_hf_dir(import_hf(hf_model), None, tmp_path)
    assert [p.name for p in tmp_path.iterdir()] == ["kept.txt"]


@torch.no_grad()
def test_greedy_sampling_matches_hf_generate(hf_model):
    prompt = tokens(1, 5)
    new_tokens = 24
    ours = generate(import_hf(hf_model), prompt, SamplingConfig(new_tokens, temperature=0.0))
    theirs = hf_model.generate(prompt, do_sample=False, max_new_tokens=new_tokens, pad_token_id=0)
    assert ours.tolist() == theirs[:, prompt.shape[1] :].tolist()


def test_an_export_from_scratch_writes_sensible_values_and_says_where_they_came_from(tmp_path):
    """No model.init_from: the context length is the model's own (under llama3 scaling the stretched one, above
    rope_original_max_positions, so transformers does not warn), token ids the tokenizer's (none here), and
    generation_config.json is made from them; weights in the dtype asked for."""
    config = GPTConfig(
        arch="llama", n_layer=1, n_head=2, n_embd=32, intermediate_size=64, seq_len=64, bias=False, activation="silu",
        rope_scaling="llama3", rope_factor=8.0, rope_original_max_positions=32, tie_embeddings=False,
    )  # fmt: skip
    out = tmp_path / "export"
    origins = write_hf_dir(GPT(config, 0), None, out, dtype=torch.bfloat16)
    assert origins[0] == (
        "config.json max_position_embeddings=256 from model.rope_original_max_positions x model.rope_factor (llama3 "
        "scaling; no source gave it)"
    )
    assert any(
        line.startswith("config.json bos/eos/pad ids [None, None, None] from the run's tokenizer") for line in origins
    )
    written = json.loads((out / "config.json").read_text())
    assert (written["max_position_embeddings"], written["dtype"]) == (256, "bfloat16")
    assert written["rope_parameters"]["original_max_position_embeddings"] == 32
    with safe_open(out / "model.safetensors", framework="pt") as weights:
        assert {weights.get_tensor(name).dtype for name in weights.keys()} == {torch.bfloat16}
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] is None
    transformers.AutoModelForCausalLM.from_pretrained(out)


# Round trips: HF Llama-3.1 (llama3 scaling, 131,072 positions), Qwen2.5 and Qwen3 random models with a BPE tokenizer,
# a chat template and a generation config, fine-tuned two steps on text on 2 stages (jobs of the shared 2-rank launch)
# and exported.
CORPUS = "".join(f"The cat number {i} sat on the mat and looked at the moon.\n" for i in range(200))
SPECIAL = ["<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>"]  # ids 0, 1, 2
SMALL = dict(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4, vocab_size=320)
SOURCES = {
    "llama3_1": transformers.LlamaConfig(
        **SMALL,
        num_key_value_heads=1,
        max_position_embeddings=131072,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },  # fmt: skip
        tie_word_embeddings=False,
    ),
    "qwen2_5": transformers.Qwen2Config(
        **SMALL, num_key_value_heads=2, max_position_embeddings=32768, rope_theta=1000000.0, tie_word_embeddings=True
    ),
    "qwen3": transformers.Qwen3Config(
        **SMALL, num_key_value_heads=2, head_dim=32, max_position_embeddings=40960, tie_word_embeddings=True
    ),
}
CHAT_TEMPLATE = "{% for m in messages %}<|begin_of_text|>{{ m['role'] }}: {{ m['content'] }}<|eot_id|>{% endfor %}"


def source_files(name: str) -> dict[str, str | bytes]:
    """The source directory's files (config.json, weights, tokenizer.json, tokenizer_config.json with the chat
    template, generation_config.json stopping on two ids), and the corpus."""
    config = SOURCES[name]
    config.bos_token_id, config.eos_token_id, config.pad_token_id = 0, 1, None
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():  # weights well above transformers' 0.02 init: no near-tie for greedy decoding to flip
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.1)
    hf = tokenizers.Tokenizer(tokenizers.models.BPE())
    hf.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=300, special_tokens=SPECIAL, initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet()
    )
    hf.train_from_iterator([CORPUS], trainer)
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": SPECIAL[0],
        "eos_token": SPECIAL[1],
        "chat_template": CHAT_TEMPLATE,
        "model_max_length": config.max_position_embeddings,
    }
    generation = {"bos_token_id": 0, "eos_token_id": [1, 2], "do_sample": True, "temperature": 0.6, "top_p": 0.9}
    transformers.utils.logging.disable_progress_bar()
    with tempfile.TemporaryDirectory() as scratch:
        model.save_pretrained(scratch)
        files: dict[str, str | bytes] = {p.name: p.read_bytes() for p in Path(scratch).iterdir()}
    return {
        **files,
        "tokenizer.json": hf.to_str(),
        "tokenizer_config.json": json.dumps(tokenizer_config),
        "generation_config.json": json.dumps(generation),
        "corpus.txt": CORPUS,
    }


FINE_TUNE = (
    "data=text",
    "data.path={scratch}/corpus.txt",
    "data.cache_dir={scratch}/cache",
    "model.init_from={scratch}",
    "model.seq_len=32",
    "train.device=cpu",
    "train.steps=2",
    "train.micro_batches=2",
    "train.micro_batch_size=2",
    "train.trace_step=0",
    "logger=none",
)
CASES = {name: case(*FINE_TUNE, files=source_files(name)) for name in SOURCES}


@pytest.mark.multiproc
@pytest.mark.parametrize("name", SOURCES)
def test_a_fine_tuned_export_keeps_what_its_source_had(name, case_runs, tmp_path, capsys):
    """transformers loads the export with the source's model type, max_position_embeddings, rope_parameters, chat
    template and generation config (not the training length and defaults), and its greedy generation is
    generate.py's."""
    run_dir = case_runs[name]
    source = Path(yaml.safe_load((run_dir / "config.yaml").read_text())["model"]["init_from"])
    assert (read_checkpoint(run_dir, option="checkpoint").path / SOURCE_FILE).is_file()  # the checkpoint carries it
    out = export_hf(ExportConfig(checkpoint=str(run_dir), out=str(tmp_path / "hf")))
    assert f"config.json max_position_embeddings={SOURCES[name].max_position_embeddings} from model.init_from's" in (
        capsys.readouterr().out
    )
    theirs, ours = transformers.AutoConfig.from_pretrained(source), transformers.AutoConfig.from_pretrained(out)
    assert ours.model_type == theirs.model_type
    assert ours.max_position_embeddings == theirs.max_position_embeddings == SOURCES[name].max_position_embeddings
    assert ours.rope_parameters == theirs.rope_parameters
    assert (ours.bos_token_id, ours.eos_token_id) == (0, 1)
    generation = [transformers.GenerationConfig.from_pretrained(d).to_diff_dict() for d in (source, out)]
    assert generation[0] == generation[1] and generation[1]["eos_token_id"] == [1, 2]
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    chat = [{"role": "user", "content": "The cat"}]
    expected = transformers.AutoTokenizer.from_pretrained(source).apply_chat_template(chat, tokenize=False)
    assert tokenizer.chat_template == CHAT_TEMPLATE
    assert tokenizer.apply_chat_template(chat, tokenize=False) == expected

    prompt, new_tokens = "The cat", 12
    text = sample_text(
        GenerateConfig(
            str(run_dir), prompt=prompt, max_new_tokens=new_tokens, temperature=0.0, top_k=None, device="cpu"
        )
    )
    model = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    greedy = model.generate(
        ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=new_tokens, eos_token_id=None
    )
    assert tokenizer.decode(greedy[0]) == text


@pytest.mark.multiproc
def test_export_writes_the_dtype_asked_for(case_runs, tmp_path):
    out = export_hf(ExportConfig(checkpoint=str(case_runs["qwen3"]), out=str(tmp_path / "hf"), dtype="bf16"))
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    with safe_open(out / "model.safetensors", framework="pt") as weights:
        assert {weights.get_tensor(name).dtype for name in weights.keys()} == {torch.bfloat16}
    default = export_hf(ExportConfig(checkpoint=str(case_runs["qwen3"]), out=str(tmp_path / "default")))
    assert json.loads((default / "config.json").read_text())["dtype"] == "float32"  # the training precision on CPU
