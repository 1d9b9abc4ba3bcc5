"""The Llama-family model against Hugging Face's, in the litgpt manner: random `transformers` models built locally
from shrunk real configurations (GQA ratio, tying, biases, rope theta and scaling kept), weights copied by the
name map of model/hf/llama_names.py, logits equal within 1e-5 in fp32. Plus the pieces on their own: RMSNorm's and
SwiGLU's hand-written backward, the KV cache of n_kv_head heads, validation."""

import pytest
import torch
import transformers

from model import GPT, GPTConfig, gpt_layers, lm_loss, module_entries
from model.hf.format import hf_config_from_model
from model.hf.llama_names import flat_index_of, llama_layer_hf_names
from model.llama_layers import LlamaBlock, SwiGLU
from model.rms_norm import RMSNorm
from model.rotary import inverse_frequencies, rotary_angles, rotary_cos_sin

# Shrunk from the published configs: (the HF class our config exports as, our fields). The HF model is built from the
# config.json an export writes (model/hf/format.py).
SHAPES = {
    "llama3.1": (
        transformers.LlamaForCausalLM,
        {
            "n_head": 4,
            "n_kv_head": 2,
            "rope_theta": 500000.0,
            "rope_scaling": "llama3",
            "rope_original_max_positions": 16,
            "tie_embeddings": False,
        },
    ),
    "qwen2.5": (
        transformers.Qwen2ForCausalLM,
        {
            "n_head": 4,
            "n_kv_head": 1,
            "rope_theta": 1000000.0,
            "qkv_bias": True,
            "tie_embeddings": True,
            "norm_eps": 1e-6,
        },
    ),
    "mistral": (
        transformers.MistralForCausalLM,
        {"n_head": 4, "n_kv_head": 2, "rope_theta": 1000000.0, "tie_embeddings": False, "hf_model_type": "mistral"},
    ),
}


def llama_config(**overrides) -> GPTConfig:
    fields = {
        "arch": "llama",
        "n_layer": 2,
        "n_head": 4,
        "n_kv_head": 2,
        "n_embd": 32,
        "intermediate_size": 88,
        "seq_len": 24,
        "vocab_size": 64,
        "activation": "silu",
        "bias": False,
        "dropout": 0.0,
        **overrides,
    }
    return GPTConfig(**fields)


def hf_pair(name: str, attention: str = "sdpa"):
    hf_class, ours = SHAPES[name]
    cfg = llama_config(attention=attention, **ours)
    hf_config = transformers.AutoConfig.for_model(**hf_config_from_model(cfg), attn_implementation="eager")
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(hf_config).eval()
    assert type(hf) is hf_class
    with torch.no_grad():  # transformers zeroes biases and keeps norm gains at 1: make them count
        for n, p in hf.named_parameters():
            if n.endswith("bias") or "norm" in n:
                p.normal_(1.0 if "norm" in n else 0.0, 0.1)
    hf_state = hf.state_dict()
    states = {
        i: {ours_name: hf_state[hf_name] for ours_name, hf_name in llama_layer_hf_names(cfg, i).items()}
        for i in module_entries(gpt_layers(cfg, seed=0))
    }
    return cfg, hf, GPT.from_layer_states(cfg, states).eval()


@pytest.mark.parametrize("attention", ["sdpa", "math"])
@pytest.mark.parametrize("name", list(SHAPES))
def test_logits_equal_hugging_faces_within_1e_5(name, attention):
    cfg, hf, ours = hf_pair(name, attention)
    idx = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(ours(idx), hf(idx).logits, rtol=0, atol=1e-5)


@pytest.mark.parametrize("name", list(SHAPES))
def test_gradients_equal_hugging_faces(name):
    """The hand-written backward passes (RMSNorm, SwiGLU) against autograd's through HF's separate ops."""
    cfg, hf, ours = hf_pair(name)
    idx = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len), generator=torch.Generator().manual_seed(1))
    labels = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len), generator=torch.Generator().manual_seed(2))
    lm_loss(ours(idx), labels).backward()
    lm_loss(hf(idx).logits, labels).backward()
    hf_grads = {n: p.grad for n, p in hf.named_parameters()}
    for i in ours.layer_states():
        module = ours.forward_funcs[i]
        for ours_name, hf_name in llama_layer_hf_names(cfg, i).items():
            grad = module.get_parameter(ours_name).grad
            torch.testing.assert_close(grad, hf_grads[hf_name], rtol=1e-4, atol=1e-6, msg=hf_name)


def test_greedy_decoding_with_the_kv_cache_matches_hugging_faces_generate():
    cfg, hf, ours = hf_pair("llama3.1")
    prompt = torch.randint(0, cfg.vocab_size, (2, 5), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(prompt)  # a prompt token 0 is not padding
    expected = hf.generate(prompt, attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=0)[:, 5:]
    caches = ours.new_caches(batch=2)
    assert caches[0].k.shape == (2, cfg.n_kv_head, cfg.seq_len, cfg.head_size)  # only the KV heads are stored
    logits, tokens = ours.forward_cached(prompt, caches), []
    for _ in range(12):
        tokens.append(logits[:, -1].argmax(-1, keepdim=True))
        logits = ours.forward_cached(tokens[-1], caches)
    assert torch.equal(torch.cat(tokens, dim=1), expected)


def test_cached_decoding_equals_the_whole_forward():
    cfg = llama_config()
    model = GPT(cfg, seed=0).eval()
    idx = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len))
    caches = model.new_caches(batch=2)
    pieces = [model.forward_cached(idx[:, a:b], caches) for a, b in ((0, 7), (7, 8), (8, cfg.seq_len))]
    with torch.no_grad():
        torch.testing.assert_close(torch.cat(pieces, dim=1), model(idx), rtol=0, atol=1e-5)


def test_rms_norm_and_swiglu_backward_pass_gradcheck():
    x = torch.randn(2, 3, 8, dtype=torch.float64, requires_grad=True)
    norm = RMSNorm(8, 1e-5).double()
    with torch.no_grad():
        norm.weight.normal_()
    assert torch.autograd.gradcheck(lambda x, w: norm.__class__.forward(norm, x), (x, norm.weight))
    gate, up = (torch.randn(2, 3, 8, dtype=torch.float64, requires_grad=True) for _ in range(2))
    assert torch.autograd.gradcheck(SwiGLU(), (gate, up))


def test_the_untied_head_is_a_module_of_its_own_and_the_tied_one_is_the_embedding():
    untied, tied = gpt_layers(llama_config(tie_embeddings=False), 0), gpt_layers(llama_config(tie_embeddings=True), 0)
    assert [r.tie_key for r in untied] == [None] * 5 and untied[-1].name == "LMHead"
    assert tied[0].tie_key == tied[-1].tie_key is not None and tied[-1].forward_fn is not None
    assert module_entries(untied) == [0, 1, 2, 3, 4] and module_entries(tied) == [0, 1, 2, 3]


def test_block_parameters_carry_hugging_faces_names():
    cfg = llama_config(qkv_bias=True, tie_embeddings=False)
    block = LlamaBlock(cfg, seed=0, layer_index=1)
    assert sorted(n for n, _ in block.named_parameters()) == sorted(
        ["input_layernorm.weight", "post_attention_layernorm.weight"]
        + [f"self_attn.{p}_proj.weight" for p in "qkvo"]
        + [f"self_attn.{p}_proj.bias" for p in "qkv"]
        + [f"mlp.{p}_proj.weight" for p in ("gate", "up", "down")]
    )
    assert flat_index_of(cfg, "model.layers.1.self_attn.k_proj.bias") == (2, "self_attn.k_proj.bias")
    assert flat_index_of(cfg, "model.norm.weight") == (3, "norm.weight")
    assert flat_index_of(cfg, "lm_head.weight") == (4, "lm_head.weight")
    with pytest.raises(KeyError, match="model.layers.2.self_attn.q_proj.weight has no place"):
        flat_index_of(cfg, "model.layers.2.self_attn.q_proj.weight")


def test_qwen3_blocks_norm_each_heads_q_and_k_and_may_be_wider_than_the_hidden_size():
    """Qwen3-0.6B's layout: head_dim 2 n_embd / n_head, so q and o are twice the hidden size wide; the q and k
    norms' gains are head_dim wide, under Hugging Face's names; cached decoding still equals the whole forward."""
    cfg = llama_config(head_dim=32, qk_norm=True, hf_model_type="qwen3")
    block = LlamaBlock(cfg, seed=0, layer_index=1)
    shapes = {n: tuple(p.shape) for n, p in block.named_parameters()}
    assert shapes["self_attn.q_norm.weight"] == shapes["self_attn.k_norm.weight"] == (32,)
    assert shapes["self_attn.q_proj.weight"] == (cfg.n_head * 32, cfg.n_embd)
    assert shapes["self_attn.o_proj.weight"] == (cfg.n_embd, cfg.n_head * 32)
    assert shapes["self_attn.k_proj.weight"] == (cfg.kv_heads * 32, cfg.n_embd)
    model = GPT(cfg, seed=0).eval()
    idx = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len))
    caches = model.new_caches(batch=2)
    pieces = [model.forward_cached(idx[:, a:b], caches) for a, b in ((0, 7), (7, cfg.seq_len))]
    with torch.no_grad():
        torch.testing.assert_close(torch.cat(pieces, dim=1), model(idx), rtol=0, atol=1e-5)


def test_an_rms_norm_that_drops_its_rstd_gives_the_same_gradients():
    """Selective recompute of `layernorm` makes Qwen3's q and k norms keep their input only: the rstd made again
    in backward gives bit-identical gradients."""
    x = torch.randn(2, 3, 4, 8, requires_grad=True)
    grads = []
    for keep in (True, False):
        norm = RMSNorm(8, 1e-6)
        norm.keep_rstd = keep
        with torch.no_grad():
            norm.weight.normal_(generator=torch.Generator().manual_seed(0))
        norm(x).pow(2).sum().backward()
        grads.append((x.grad.clone(), norm.weight.grad.clone()))
        x.grad = None
    assert all(torch.equal(a, b) for a, b in zip(*grads))


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"n_kv_head": 3}, r"model.n_head=4 is not divisible by model.n_kv_head=3"),
        ({"intermediate_size": None}, r"model.intermediate_size=None is invalid with model.arch=llama"),
        ({"bias": True}, r"model.bias=true is invalid with model.arch=llama"),
        ({"activation": "gelu"}, r"model.activation='gelu' is invalid with model.arch=llama: allowed values are silu"),
        ({"dropout": 0.1}, r"model.dropout=0.1 / model.packed_dropout=False are invalid with model.arch=llama"),
        ({"rope_scaling": "yarn"}, r"model.rope_scaling='yarn' is unknown: allowed values are none, llama3"),
        ({"arch": "mamba"}, r"model.arch='mamba' is unknown: allowed values are gpt2, llama"),
        ({"head_dim": 7}, r"model.head_dim = 7 is odd: rotary embeddings rotate pairs of channels"),
        ({"head_dim": 0}, r"model.head_dim=0 is invalid: give a positive integer, or null"),
        ({"hf_model_type": "qwen3"}, r"model.hf_model_type=qwen3 with model.qk_norm=False: Qwen3 normalises q"),
        ({"qk_norm": True, "hf_model_type": "llama"}, r"model.hf_model_type=llama with model.qk_norm=True"),
    ],
)
def test_llama_config_validation(overrides, message):
    with pytest.raises(ValueError, match=message):
        llama_config(**overrides)


def test_gpt2_refuses_llama_only_options():
    with pytest.raises(ValueError, match=r"model.n_kv_head=2 is invalid with model.arch=gpt2"):
        GPTConfig(n_kv_head=2)
    with pytest.raises(ValueError, match=r"model.tie_embeddings=False is invalid with model.arch=gpt2"):
        GPTConfig(tie_embeddings=False)
    with pytest.raises(ValueError, match=r"model.qk_norm=True is invalid with model.arch=gpt2"):
        GPTConfig(qk_norm=True)
    with pytest.raises(ValueError, match=r"model.head_dim=64 is invalid with model.arch=gpt2"):
        GPTConfig(head_dim=64)


def angles_anew(cfg: GPTConfig, start: int, length: int) -> torch.Tensor:
    """The angles (T, hs) as rotary_cos_sin computed them before its per-device table: from the positions asked."""
    positions = torch.arange(start, start + length, dtype=torch.float32)  # (T,)
    freqs = torch.outer(positions, inverse_frequencies(cfg))  # (T, hs/2)
    return torch.cat((freqs, freqs), dim=-1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", list(SHAPES))
def test_rotary_cos_sin_from_the_devices_table_are_bit_identical_to_computing_them_anew(name, dtype):
    """Every start and length a forward, a recompute or a decode step asks for, also past the table's first size;
    each call returns cos and sin of its own (apply_rotary keeps them per block, as the planner counts them)."""
    cfg = llama_config(**SHAPES[name][1])
    for start, length in ((0, 24), (0, 1), (5, 3), (23, 1), (0, 7), (30, 40), (0, 24)):
        cos, sin = rotary_cos_sin(cfg, start, length, dtype, torch.device("cpu"))
        angles = angles_anew(cfg, start, length)
        assert torch.equal(cos, angles.cos().to(dtype)) and torch.equal(sin, angles.sin().to(dtype))
    again, _ = rotary_cos_sin(cfg, 0, 24, dtype, torch.device("cpu"))
    assert again.untyped_storage().data_ptr() != cos.untyped_storage().data_ptr()


def test_the_rotary_angles_are_built_once_per_device_rotary_fields_and_sequence_length():
    cfg = llama_config(**SHAPES["llama3.1"][1])
    table = rotary_angles(cfg, 24, torch.device("cpu"))
    assert rotary_angles(cfg, 10, torch.device("cpu")) is table
    # a shorter model's table is its own length, whatever the process built before (compiled blocks save it)
    shorter = rotary_angles(llama_config(**SHAPES["llama3.1"][1], seq_len=8), 8, torch.device("cpu"))
    assert shorter is not table and shorter.shape[0] == 8 and torch.equal(shorter, table[:8])
    assert rotary_angles(llama_config(**SHAPES["mistral"][1]), 24, torch.device("cpu")) is not table
    longer = rotary_angles(cfg, table.shape[0] + 1, torch.device("cpu"))
    assert longer.shape[0] > table.shape[0] and torch.equal(longer[: table.shape[0]], table)
    with torch.inference_mode():  # sampling may build it: training's autograd must still accept it afterwards
        built = rotary_angles(llama_config(**SHAPES["qwen2.5"][1]), 24, torch.device("cpu"))
    assert not built.is_inference()
