"""Hugging Face GPT-2 in and out: a small random GPT2LMHeadModel, built locally (no hub), imported into model.GPT
through model/hf_format.py, exported by harness/hf_export.py and reloaded by transformers gives HF's logits, and
our greedy sampler gives HF's greedy tokens."""

import json

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel

from harness.hf_export import write_hf_dir
from model import GPT, GPTConfig, gpt_layers, module_entries
from model.hf_format import layer_state_from_hf
from model.hf_gpt2 import HF_PREFIX, gpt_config_from_hf
from model.sampling import SamplingConfig, generate

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
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
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
