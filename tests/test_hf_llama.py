"""Hugging Face Llama, Qwen2 and Mistral in and out, in the litgpt manner: random `transformers` models built here
(no hub), shrunk from the published configurations keeping the GQA ratio, tying, biases and rope theta/scaling, read
through model.init_from's reader (harness/hf/checkpoint.py, model/hf/format.py) give HF's logits; an export
(harness/hf/export.py) reloads in transformers with HF's logits and greedy tokens; sharded checkpoints are read shard
by shard; the presets are the published shapes; what we do not compute is refused at start-up, exit 2."""

import json
import os
import re
import tempfile
from pathlib import Path

import pytest
import tokenizers
import torch
import transformers
import yaml
from omegaconf import OmegaConf
from safetensors.torch import save_file

from data.synthetic import SyntheticTokenSource
from data.tokenizer import Tokenizer
from harness.consolidate import consolidate
from harness.hf.checkpoint import open_hf_dir, open_tensors
from harness.hf.export import export_hf, write_hf_dir
from harness.hf.init_from import check_tensors, pick_tokenizer
from model import GPT, GPTConfig, gpt_layers, lm_loss, model_param_count, module_entries
from model.hf.format import ARCH_FIELDS, config_from_hf, layer_hf_names, layer_state_from_hf
from model.sampling import SamplingConfig, generate
from parallel.planning.config import NoRecompute
from parallel.planning.layout import build_layout
from parallel.planning.run_plan import plan_run
from parallel.planning.shapes import RunShape, Target, Topology
from schema.scripts import ExportConfig
from tests.runs import REPO, metrics, python_run
from tests.shared_runs import case

SEQ = 32
VOCAB = 256
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}

# Shrunk from the published configs (PUBLISHED below): 2 layers, head size 16 (8 for qwen's 7:1), the same ratio of
# query to KV heads, tying, q/k/v biases (qwen2), rms eps, rope theta and Llama 3's scaling.
SHRUNK = {
    "llama3.2-1b": (
        transformers.LlamaConfig,
        dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=1, intermediate_size=256, rms_norm_eps=1e-5),
        dict(
            rope_theta=500000.0,
            rope_scaling={**LLAMA3_ROPE, "original_max_position_embeddings": 8192},
            max_position_embeddings=131072,
            tie_word_embeddings=True,
        ),
    ),
    "llama3-8b": (
        transformers.LlamaConfig,
        dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=1, intermediate_size=224, rms_norm_eps=1e-5),
        dict(rope_theta=500000.0, tie_word_embeddings=False),
    ),
    "llama3-70b": (
        transformers.LlamaConfig,
        dict(hidden_size=64, num_attention_heads=8, num_key_value_heads=1, intermediate_size=224, rms_norm_eps=1e-5),
        dict(rope_theta=500000.0, tie_word_embeddings=False),
    ),
    "qwen2.5-0.5b": (
        transformers.Qwen2Config,
        dict(hidden_size=56, num_attention_heads=7, num_key_value_heads=1, intermediate_size=304, rms_norm_eps=1e-6),
        dict(rope_theta=1000000.0, tie_word_embeddings=True, use_sliding_window=False),
    ),
    "qwen2.5-7b": (
        transformers.Qwen2Config,
        dict(hidden_size=56, num_attention_heads=7, num_key_value_heads=1, intermediate_size=296, rms_norm_eps=1e-6),
        dict(rope_theta=1000000.0, tie_word_embeddings=False, use_sliding_window=False),
    ),
    "qwen3-0.6b": (  # head_dim 32 with hidden 64 and 4 heads: q is twice the hidden size, as in the 0.6B
        transformers.Qwen3Config,
        dict(
            hidden_size=64,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=32,
            intermediate_size=192,
            rms_norm_eps=1e-6,
        ),
        dict(rope_theta=1000000.0, tie_word_embeddings=True, use_sliding_window=False),
    ),
    "qwen3-8b": (
        transformers.Qwen3Config,
        dict(
            hidden_size=64,
            num_attention_heads=4,
            num_key_value_heads=1,
            head_dim=16,
            intermediate_size=192,
            rms_norm_eps=1e-6,
        ),
        dict(rope_theta=1000000.0, tie_word_embeddings=False, use_sliding_window=False),
    ),
    "mistral-7b": (
        transformers.MistralConfig,
        dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=1, intermediate_size=224, rms_norm_eps=1e-5),
        dict(rope_theta=1000000.0, tie_word_embeddings=False, sliding_window=None),
    ),
    "smollm2-135m": (
        transformers.LlamaConfig,
        dict(hidden_size=48, num_attention_heads=3, num_key_value_heads=1, intermediate_size=128, rms_norm_eps=1e-5),
        dict(rope_theta=100000.0, tie_word_embeddings=True),
    ),
}


def hf_model(name: str, seed: int = 0) -> transformers.PreTrainedModel:
    config_class, shape, rest = SHRUNK[name]
    config = config_class(
        **shape, **rest, num_hidden_layers=2, vocab_size=VOCAB, bos_token_id=None, eos_token_id=None, pad_token_id=None
    )
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():  # HF starts norms at 1 and biases at 0: random ones show a gain or bias mapped wrongly
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.05)
    return model


@pytest.fixture(scope="module", params=list(SHRUNK))
def hf(request, tmp_path_factory):
    """(name, model, its save_pretrained directory)."""
    model = hf_model(request.param)
    directory = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(directory)
    return request.param, model, directory


def load_ours(directory: Path) -> GPT:
    """Our unpipelined model from an HF directory, every layer through model.init_from's reader and name map."""
    checkpoint = open_hf_dir(str(directory))
    config = GPTConfig(**{**config_from_hf(checkpoint.config, SEQ), "seq_len": SEQ})
    check_tensors(checkpoint, config)
    with open_tensors(checkpoint) as get:
        states = {i: layer_state_from_hf(config, i, get) for i in module_entries(gpt_layers(config, seed=0))}
    return GPT.from_layer_states(config, states).eval()


def tokens(*shape: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, shape, generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def test_init_from_gives_hf_logits(hf):
    name, model, directory = hf
    ours = load_ours(directory)
    assert ours.config.hf_model_type == model.config.model_type
    assert ours.config.tie_embeddings == model.config.tie_word_embeddings
    idx = tokens(2, SEQ)
    torch.testing.assert_close(ours(idx), model(idx).logits, rtol=0, atol=1e-5)


@torch.no_grad()
def test_export_reloads_in_transformers_with_hf_logits_and_greedy_tokens(hf, tmp_path):
    name, model, directory = hf
    out = tmp_path / "export"
    write_hf_dir(load_ours(directory), None, out)
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "generation_config.json", "model.safetensors"]
    exported = json.loads((out / "config.json").read_text())
    assert exported["model_type"] == model.config.model_type
    assert (exported["bos_token_id"], exported["eos_token_id"], exported["pad_token_id"]) == (None, None, None)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(reloaded) is type(model)
    tied = reloaded.lm_head.weight.data_ptr() == reloaded.model.embed_tokens.weight.data_ptr()
    assert tied == model.config.tie_word_embeddings
    idx = tokens(2, SEQ)
    torch.testing.assert_close(reloaded(idx).logits, model(idx).logits, rtol=0, atol=1e-5)

    prompt, new_tokens = tokens(1, 5, seed=2), 24
    ours = generate(load_ours(out), prompt, SamplingConfig(new_tokens, temperature=0.0))
    theirs = reloaded.generate(prompt, do_sample=False, max_new_tokens=new_tokens, eos_token_id=None, pad_token_id=0)
    assert ours.tolist() == theirs[:, prompt.shape[1] :].tolist()


def test_sharded_export_is_read_one_stage_at_a_time(tmp_path):
    """Above max_shard_bytes the export writes shards and an index, as save_pretrained does; transformers loads
    them, and a stage that reads only its layers opens only the shards that hold them."""
    model = hf_model("llama3-8b")
    out = tmp_path / "sharded"
    write_hf_dir(load_ours(tmp_path_with(model, tmp_path / "hf")), None, out, max_shard_bytes=VOCAB * 64 * 4)
    index = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    shards = sorted(set(index.values()))
    assert len(shards) > 4 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    umask = os.umask(0)
    os.umask(umask)
    modes = {p.name: p.stat().st_mode & 0o777 for p in out.iterdir()}
    assert modes == dict.fromkeys(modes, 0o666 & ~umask)  # safetensors alone writes 0600
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    idx = tokens(2, SEQ)
    with torch.no_grad():
        torch.testing.assert_close(reloaded(idx).logits, model(idx).logits, rtol=0, atol=1e-5)
        torch.testing.assert_close(load_ours(out)(idx), model(idx).logits, rtol=0, atol=1e-5)

    checkpoint = open_hf_dir(str(out))
    config = GPTConfig(**{**config_from_hf(checkpoint.config, SEQ), "seq_len": SEQ})
    # The two stages of a 2-stage split: [embedding, block 0] and [block 1, final norm, untied head].
    for stage in ((0, 1), (2, 3, 4)):
        with open_tensors(checkpoint) as get:
            for flat_index in stage:
                layer_state_from_hf(config, flat_index, get)
            opened = {path.name for path in get.opened}
        assert opened == {index[hf] for i in stage for hf, _ in layer_hf_names(config, i).values()}
        assert len(opened) < len(shards)


def test_sharded_bin_checkpoints_are_read_too(tmp_path):
    """Older checkpoints shard pytorch_model.bin files under pytorch_model.bin.index.json (transformers 5 writes
    only safetensors, so the files are written here as older versions did: one torch.save per shard)."""
    model = hf_model("qwen2.5-7b")
    directory = tmp_path_with(model, tmp_path / "hf")
    (directory / "model.safetensors").unlink()
    state = model.state_dict()
    first = {name: t for name, t in state.items() if name.startswith(("model.embed_tokens.", "model.layers.0."))}
    shards = {"pytorch_model-00001-of-00002.bin": first}
    shards["pytorch_model-00002-of-00002.bin"] = {name: t for name, t in state.items() if name not in first}
    weight_map = {}
    for file, shard in shards.items():
        torch.save(shard, directory / file)
        weight_map.update(dict.fromkeys(shard, file))
    (directory / "pytorch_model.bin.index.json").write_text(json.dumps({"weight_map": weight_map}))
    idx = tokens(2, SEQ)
    with torch.no_grad():
        torch.testing.assert_close(load_ours(directory)(idx), model(idx).logits, rtol=0, atol=1e-5)
    checkpoint = open_hf_dir(str(directory))
    config = GPTConfig(**{**config_from_hf(checkpoint.config, SEQ), "seq_len": SEQ})
    with open_tensors(checkpoint) as get:  # the first stage of two
        for flat_index in (0, 1):
            layer_state_from_hf(config, flat_index, get)
        assert [path.name for path in get.opened] == ["pytorch_model-00001-of-00002.bin"]


def tmp_path_with(model: transformers.PreTrainedModel, directory: Path) -> Path:
    model.save_pretrained(directory)
    return directory


def special_token_tokenizer() -> Tokenizer:
    """A word-level tokenizer holding Llama 3's bos and eos tokens, and a pad token."""
    vocab = {"<unk>": 0, "a": 1, "b": 2, "<|begin_of_text|>": 3, "<|end_of_text|>": 4, "<pad>": 5}
    hf = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    hf.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    hf.add_special_tokens(["<|begin_of_text|>", "<|end_of_text|>", "<pad>"])
    return Tokenizer(hf)


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_export_carries_the_tokenizers_own_special_ids(arch, tmp_path):
    """config.json's bos/eos/pad ids are the tokenizer's (GPT-2's 50256 outside a small vocabulary made transformers
    warn); tokenizer_config.json names the tokens, and AutoTokenizer reads them back."""
    shape = {"arch": "llama", "intermediate_size": 176, "bias": False, "activation": "silu"} if arch == "llama" else {}
    model = GPT(GPTConfig(n_layer=1, n_embd=32, n_head=2, seq_len=SEQ, vocab_size=VOCAB, dropout=0.0, **shape), 0)
    out = tmp_path / "export"
    write_hf_dir(model, special_token_tokenizer(), out)
    config = json.loads((out / "config.json").read_text())
    assert (config["bos_token_id"], config["eos_token_id"], config["pad_token_id"]) == (3, 4, 5)
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id) == (3, 4, 5)


# config.json of each preset's model as published (values copied from the files; keys transformers would default
# are left out where the files leave them out), and its published parameter count.
PUBLISHED = {
    "llama3.2-1b": (
        {
            "model_type": "llama",
            "hidden_size": 2048,
            "intermediate_size": 8192,
            "num_attention_heads": 32,
            "num_hidden_layers": 16,
            "num_key_value_heads": 8,
            "head_dim": 64,
            "max_position_embeddings": 131072,
            "rms_norm_eps": 1e-05,
            "rope_theta": 500000.0,
            "rope_scaling": {**LLAMA3_ROPE, "original_max_position_embeddings": 8192},
            "tie_word_embeddings": True,
            "vocab_size": 128256,
            "hidden_act": "silu",
            "attention_bias": False,
            "mlp_bias": False,
        },
        1_235_814_400,
    ),
    "llama3-8b": (
        {
            "model_type": "llama",
            "hidden_size": 4096,
            "intermediate_size": 14336,
            "num_attention_heads": 32,
            "num_hidden_layers": 32,
            "num_key_value_heads": 8,
            "max_position_embeddings": 8192,
            "rms_norm_eps": 1e-05,
            "rope_theta": 500000.0,
            "rope_scaling": None,
            "tie_word_embeddings": False,
            "vocab_size": 128256,
            "hidden_act": "silu",
            "attention_bias": False,
        },
        8_030_261_248,
    ),
    "llama3-70b": (
        {
            "model_type": "llama",
            "hidden_size": 8192,
            "intermediate_size": 28672,
            "num_attention_heads": 64,
            "num_hidden_layers": 80,
            "num_key_value_heads": 8,
            "max_position_embeddings": 8192,
            "rms_norm_eps": 1e-05,
            "rope_theta": 500000.0,
            "rope_scaling": None,
            "tie_word_embeddings": False,
            "vocab_size": 128256,
            "hidden_act": "silu",
        },
        70_553_706_496,
    ),
    "qwen2.5-0.5b": (
        {
            "model_type": "qwen2",
            "hidden_size": 896,
            "intermediate_size": 4864,
            "num_attention_heads": 14,
            "num_hidden_layers": 24,
            "num_key_value_heads": 2,
            "max_position_embeddings": 32768,
            "max_window_layers": 24,
            "rms_norm_eps": 1e-06,
            "rope_theta": 1000000.0,
            "sliding_window": 32768,
            "use_sliding_window": False,
            "tie_word_embeddings": True,
            "vocab_size": 151936,
            "hidden_act": "silu",
        },
        494_032_768,
    ),
    "qwen2.5-7b": (
        {
            "model_type": "qwen2",
            "hidden_size": 3584,
            "intermediate_size": 18944,
            "num_attention_heads": 28,
            "num_hidden_layers": 28,
            "num_key_value_heads": 4,
            "max_position_embeddings": 131072,
            "max_window_layers": 28,
            "rms_norm_eps": 1e-06,
            "rope_theta": 1000000.0,
            "sliding_window": 131072,
            "use_sliding_window": False,
            "tie_word_embeddings": False,
            "vocab_size": 152064,
            "hidden_act": "silu",
        },
        7_615_616_512,
    ),
    "qwen3-0.6b": (
        {
            "model_type": "qwen3",
            "hidden_size": 1024,
            "intermediate_size": 3072,
            "num_attention_heads": 16,
            "num_hidden_layers": 28,
            "num_key_value_heads": 8,
            "head_dim": 128,
            "max_position_embeddings": 40960,
            "max_window_layers": 28,
            "rms_norm_eps": 1e-06,
            "rope_theta": 1000000,
            "rope_scaling": None,
            "sliding_window": None,
            "use_sliding_window": False,
            "attention_bias": False,
            "tie_word_embeddings": True,
            "vocab_size": 151936,
            "hidden_act": "silu",
        },
        596_049_920,
    ),
    "qwen3-8b": (
        {
            "model_type": "qwen3",
            "hidden_size": 4096,
            "intermediate_size": 12288,
            "num_attention_heads": 32,
            "num_hidden_layers": 36,
            "num_key_value_heads": 8,
            "head_dim": 128,
            "max_position_embeddings": 40960,
            "max_window_layers": 36,
            "rms_norm_eps": 1e-06,
            "rope_theta": 1000000,
            "rope_scaling": None,
            "sliding_window": None,
            "use_sliding_window": False,
            "attention_bias": False,
            "tie_word_embeddings": False,
            "vocab_size": 151936,
            "hidden_act": "silu",
        },
        8_190_735_360,
    ),
    "mistral-7b": (
        {
            "model_type": "mistral",
            "hidden_size": 4096,
            "intermediate_size": 14336,
            "num_attention_heads": 32,
            "num_hidden_layers": 32,
            "num_key_value_heads": 8,
            "max_position_embeddings": 32768,
            "rms_norm_eps": 1e-05,
            "rope_theta": 1000000.0,
            "sliding_window": None,
            "tie_word_embeddings": False,
            "vocab_size": 32768,
            "hidden_act": "silu",
        },
        7_248_023_552,
    ),
    "smollm2-135m": (
        {
            "model_type": "llama",
            "hidden_size": 576,
            "intermediate_size": 1536,
            "num_attention_heads": 9,
            "num_hidden_layers": 30,
            "num_key_value_heads": 3,
            "max_position_embeddings": 8192,
            "rms_norm_eps": 1e-05,
            "rope_theta": 100000,
            "rope_scaling": None,
            "tie_word_embeddings": True,
            "vocab_size": 49152,
            "hidden_act": "silu",
            "attention_bias": False,
            "mlp_bias": False,
        },
        134_515_008,
    ),
}


def preset(name: str) -> dict:
    return yaml.safe_load((REPO / "conf" / "model" / f"{name}.yaml").read_text())


@pytest.mark.parametrize("name", PUBLISHED)
def test_presets_are_the_published_shapes(name):
    """A preset sets what model.init_from reads from its model's config.json, and has its parameter count."""
    config_json, params = PUBLISHED[name]
    values = preset(name)
    from_json = config_from_hf(config_json, values["seq_len"])
    assert {field: values.get(field, value) for field, value in from_json.items()} == from_json
    assert {f for f in ARCH_FIELDS if not f.startswith("rope_") or f == "rope_theta"} <= values.keys()
    assert model_param_count(gpt_layers(GPTConfig(**values), seed=0)) == params


MISTRAL = PUBLISHED["mistral-7b"][0]
LLAMA = PUBLISHED["llama3-8b"][0]
QWEN = PUBLISHED["qwen2.5-7b"][0]


@pytest.mark.parametrize(
    "config, message",
    [
        ({**MISTRAL, "model_type": "gemma2"}, "model_type='gemma2' is not supported: allowed values are gpt2, llama"),
        ({**MISTRAL, "model_type": "mixtral", "num_local_experts": 8}, "num_local_experts=8 describes a mixture"),
        ({**MISTRAL, "sliding_window": 4096}, "sliding_window=4096 is shorter than model.seq_len=8192"),
        ({k: v for k, v in MISTRAL.items() if k != "sliding_window"}, "sliding_window=4096 is shorter"),
        ({**QWEN, "use_sliding_window": True, "sliding_window": 4096}, "sliding_window=4096 is shorter"),
        ({**LLAMA, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope type 'yarn' is not supported"),
        ({**LLAMA, "rope_parameters": {"rope_type": "dynamic", "factor": 2.0}}, "rope type 'dynamic' is not"),
        ({**LLAMA, "rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "llama3 rope scaling lacks low_freq"),
        ({**LLAMA, "attention_bias": True}, "attention_bias=true is not supported: biases are modelled on q, k"),
        ({**LLAMA, "mlp_bias": True}, "mlp_bias=true is not supported"),
        ({**LLAMA, "head_dim": 0}, "head_dim=0 must be a positive integer"),
        ({**PUBLISHED["qwen3-8b"][0], "attention_bias": True}, "attention_bias=true is not supported"),
        ({**LLAMA, "hidden_act": "gelu"}, "hidden_act='gelu' is not supported: only silu"),
        ({**LLAMA, "max_position_embeddings": 4096}, "model.seq_len=8192 exceeds model.init_from's max_position"),
        ({**LLAMA, "quantization_config": {"quant_method": "gptq"}}, "quantization_config: quantized weights"),
        ({**LLAMA, "num_hidden_layers": 0}, "num_hidden_layers=0 must be a positive integer"),
    ],
)
def test_what_the_block_does_not_compute_is_refused_by_name(config, message):
    with pytest.raises(ValueError, match="model.init_from") as error:
        config_from_hf(config, 8192)
    assert message in str(error.value)


def test_rope_settings_read_in_both_spellings():
    """transformers 5 writes rope_parameters (theta inside); older files a top-level rope_theta and rope_scaling."""
    scaling = {**LLAMA3_ROPE, "original_max_position_embeddings": 8192}
    new = {k: v for k, v in LLAMA.items() if k not in ("rope_theta", "rope_scaling")}
    new["rope_parameters"] = {**scaling, "rope_theta": 500000.0}
    old = {**LLAMA, "rope_scaling": scaling}
    assert config_from_hf(new, 8192) == config_from_hf(old, 8192)
    assert config_from_hf(new, 8192)["rope_scaling"] == "llama3"


def test_tokenizer_json_is_the_default_tokenizer(tmp_path):
    """model.init_from's tokenizer.json becomes data.tokenizer_file (text data: a BPE) unless the user chose one;
    one bigger than the model's vocabulary is refused."""
    directory = tmp_path / "hf"
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps({**LLAMA, "vocab_size": 6}))
    special_token_tokenizer().hf.save(str(directory / "tokenizer.json"))
    checkpoint = open_hf_dir(str(directory), need_weights=False)

    def data_after(overridden=(), vocab_size=6, **data):
        cfg = OmegaConf.create(
            {
                "model": {"vocab_size": vocab_size},
                "data": {"name": "text", "tokenizer": "bytes", "tokenizer_file": None},
            }
        )
        cfg.data.update(data)
        pick_tokenizer(cfg, checkpoint, set(overridden))
        return dict(cfg.data)

    own = str(directory / "tokenizer.json")
    assert data_after() == {"name": "text", "tokenizer": "bpe", "tokenizer_file": own}
    assert data_after(["data.tokenizer"]) == {"name": "text", "tokenizer": "bytes", "tokenizer_file": None}
    with pytest.raises(ValueError, match=r"model.init_from's tokenizer.json=.* has 6 token ids, more than the "):
        data_after(vocab_size=5)


def spoilt_dir(case_name: str, tmp_path: Path) -> Path:
    """A small Llama directory (GQA 4:1, untied), spoilt as `case_name` says."""
    model = hf_model("llama3-8b")
    directory = tmp_path / "hf"
    model.save_pretrained(directory, max_shard_size="40KB" if case_name == "missing shard" else "5GB")
    config = json.loads((directory / "config.json").read_text())
    if case_name == "n_head not divisible by n_kv_head":
        config["num_key_value_heads"] = 3
    elif case_name == "sliding window":
        config.update(model_type="mistral", sliding_window=16)
    elif case_name == "unknown model_type":
        config["model_type"] = "gemma2"
    elif case_name in ("weights of another shape", "a bias config.json does not declare"):
        state = {name: tensor.contiguous() for name, tensor in model.state_dict().items()}
        if case_name == "weights of another shape":
            state["model.layers.1.mlp.up_proj.weight"] = torch.zeros(200, 64)
        else:
            state["model.layers.0.self_attn.o_proj.bias"] = torch.zeros(64)
        save_file(state, directory / "model.safetensors", metadata={"format": "pt"})
    elif case_name == "missing shard":
        shards = sorted(directory.glob("model-*.safetensors"))
        assert len(shards) > 2
        shards[1].unlink()
    elif case_name == "tokenizer bigger than the vocabulary":
        words = {f"w{i}": i for i in range(VOCAB + 10)}
        tokenizers.Tokenizer(tokenizers.models.WordLevel(words, unk_token="w0")).save(str(directory / "tokenizer.json"))
    (directory / "config.json").write_text(json.dumps(config))
    return directory


SPOILT = {
    "n_head not divisible by n_kv_head": "model.n_head=4 is not divisible by model.n_kv_head=3",
    "sliding window": "config.json sliding_window=16 is shorter than model.seq_len=32",
    "unknown model_type": "config.json model_type='gemma2' is not supported",
    "weights of another shape": "holds model.layers.1.mlp.up_proj.weight of shape [200, 64], config.json implies [224",
    "a bias config.json does not declare": "holds 1 tensors the model config.json describes has no place for, e.g. "
    "model.layers.0.self_attn.o_proj.bias",
    "missing shard": "model.safetensors.index.json names 1 shard files that are missing, e.g. model-00002-of-",
    "tokenizer bigger than the vocabulary": "' has 266 token ids, more than the vocab_size=256 of model.init_from=",
}


@pytest.mark.parametrize("case_name", SPOILT)
def test_bad_llama_directories_fail_at_start_up(case_name, tmp_path):
    directory = spoilt_dir(case_name, tmp_path)
    run_dir = tmp_path / "run"
    overrides = ["data=text", "train.device=cpu", "model.seq_len=32", f"model.init_from={directory}"]
    result = python_run(run_dir, *overrides, check=False, timeout=120)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("stagecheck: error: model.init_from"), result.stderr
    assert SPOILT[case_name] in lines[0]
    assert "Traceback" not in result.stderr + result.stdout
    assert not run_dir.exists()


def test_a_dry_run_plans_a_published_model_from_its_config_json_alone(tmp_path):
    """No weights: config.json gives the shape, the preset's (so the plan is the preset's: the planner reads the
    model config alone)."""
    directory = tmp_path / "llama3-8b"
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps(LLAMA))
    grid = ["data=synthetic", "parallel.pipeline_stages=4", "parallel.data_parallel_size=2", "dry_run=true"]
    python_run(tmp_path / "plan", f"model.init_from={directory}", "model.seq_len=8192", *grid)
    plan = json.loads((tmp_path / "plan" / "plan.json").read_text())
    assert {**plan["model"], "init_from": None} == {**GPTConfig().__dict__, **preset("llama3-8b")}
    assert len(plan["stages"]) == 4 and plan["world_size"] == 8
    assert sum(s["params"] for s in plan["stages"]) == PUBLISHED["llama3-8b"][1]  # untied: nothing twice


# A 2-stage run started from a small sharded Llama (GQA 4:1, untied head): one job of the shared 2-rank launch.
LAUNCH_MODEL = hf_model("llama3-8b", seed=3)


def _saved_files(model: transformers.PreTrainedModel, **save_options) -> dict[str, bytes]:
    """{file name: bytes} of the model's save_pretrained directory."""
    transformers.utils.logging.disable_progress_bar()  # no "Writing model shards" bar at collection
    with tempfile.TemporaryDirectory() as scratch:
        model.save_pretrained(scratch, **save_options)
        return {p.name: p.read_bytes() for p in Path(scratch).iterdir()}


LAUNCH_FILES = _saved_files(LAUNCH_MODEL, max_shard_size="40KB")  # a shard per tensor or two
LAUNCH_RUN = (
    "data=synthetic",
    "train.device=cpu",
    "model.init_from={scratch}",
    f"model.seq_len={SEQ}",
    "train.micro_batches=2",
    "train.steps=1",
    "train.trace_step=0",
    "logger=none",
)
CASES = {"from_hf": case(*LAUNCH_RUN, files=LAUNCH_FILES)}


@pytest.mark.multiproc
def test_two_stage_run_from_a_sharded_llama_starts_at_hfs_loss_each_stage_opening_its_shards(case_runs, shared_runs):
    run_dir = case_runs["from_hf"]
    config = yaml.safe_load((run_dir / "config.yaml").read_text())
    model = config["model"]
    assert (model["arch"], model["n_kv_head"], model["tie_embeddings"], model["seq_len"]) == ("llama", 1, False, SEQ)
    t, source = config["train"], SyntheticTokenSource(VOCAB)
    batches = [source.batch(config["seed"], 1, 0, micro, t["micro_batch_size"], SEQ) for micro in range(2)]
    with torch.no_grad():
        hf_loss = sum(lm_loss(LAUNCH_MODEL(x).logits, y) for x, y in batches) / len(batches)
    assert metrics(run_dir)[0]["loss"] == pytest.approx(hf_loss.item(), abs=1e-5)

    # Each rank (one stage each) names the shards it opened: those of its own layers, a prefix and a suffix of the
    # flat list [embedding, block 0, block 1, final norm, head] that meet where the stages split.
    index = json.loads(LAUNCH_FILES["model.safetensors.index.json"])["weight_map"]
    shards = len(set(index.values()))
    ours = GPTConfig(**{k: v for k, v in model.items()})
    files_of = [{index[hf] for hf, _ in layer_hf_names(ours, i).values()} for i in range(5)]
    splits = [(set().union(*files_of[:k]), set().union(*files_of[k:])) for k in range(1, 5)]
    output = shared_runs.case_output()
    where = re.escape(model["init_from"])
    pattern = rf"rank (\d) opened (\d+) of {shards} shards of {where}: ((?:model-[-\w]+\.safetensors ?)+)"
    opened = {}
    for rank, count, names in re.findall(pattern, output):
        opened[int(rank)] = set(names.split())
        assert len(opened[int(rank)]) == int(count)
    assert sorted(opened) == [0, 1], output
    assert (opened[0], opened[1]) in splits
    assert len(opened[0]) < shards and len(opened[1]) < shards


@pytest.mark.multiproc
def test_export_of_the_trained_llama_loads_in_transformers(case_runs, tmp_path):
    """The 2-stage run's checkpoint (untied head, GQA) exported through export_hf.py's path, sharded: transformers
    loads it as the model type it came from, with our consolidated model's logits, and so does model.init_from."""
    run_dir = case_runs["from_hf"]
    out = export_hf(ExportConfig(checkpoint=str(run_dir), out=str(tmp_path / "hf"), max_shard_bytes=VOCAB * 64 * 4))
    assert json.loads((out / "config.json").read_text())["model_type"] == "llama"
    assert (out / "model.safetensors.index.json").is_file()
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(reloaded) is transformers.LlamaForCausalLM
    ours = consolidate(run_dir, option="checkpoint").model.eval()
    idx = tokens(2, SEQ)
    with torch.no_grad():
        torch.testing.assert_close(reloaded(idx).logits, ours(idx), rtol=0, atol=1e-5)
        torch.testing.assert_close(load_ours(out)(idx), ours(idx), rtol=0, atol=1e-5)


@pytest.mark.parametrize("name", PUBLISHED)
def test_every_llama_preset_plans(name):
    """The planner takes every preset (what a dry run does, in process): 4 stages hold the published parameters,
    a tied embedding counted on both ends as DeepSpeed's tied layer holds it."""
    values = preset(name)
    config = GPTConfig(**values)
    run = RunShape(Topology(4), Target("cuda", "bf16"), micro_batches=4, micro_batch_size=1)
    plan = plan_run(config, NoRecompute(), build_layout(config, NoRecompute(), run, "balanced", seed=1), run)
    tied = values["vocab_size"] * values["n_embd"] if values["tie_embeddings"] else 0
    assert sum(stage["params"] for stage in plan.to_json()["stages"]) == PUBLISHED[name][1] + tied


def test_a_bpe_without_special_tokens_exports_null_ids(tmp_path):
    """A BPE trained on the corpus has no special tokens: config.json says so (it used to say GPT-2's 50256)."""
    hf = tokenizers.Tokenizer(tokenizers.models.BPE())
    hf.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    alphabet = tokenizers.pre_tokenizers.ByteLevel.alphabet()
    hf.train_from_iterator(["the cat sat on the mat"] * 4, tokenizers.trainers.BpeTrainer(initial_alphabet=alphabet))
    out = tmp_path / "export"
    write_hf_dir(GPT(GPTConfig(n_layer=1, n_embd=32, n_head=2, seq_len=SEQ, vocab_size=512), 0), Tokenizer(hf), out)
    config = json.loads((out / "config.json").read_text())
    assert (config["bos_token_id"], config["eos_token_id"], config["pad_token_id"]) == (None, None, None)
    assert transformers.AutoTokenizer.from_pretrained(out).bos_token is None
