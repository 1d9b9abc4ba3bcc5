"""The pure-PyTorch GPT: shapes, GPT-2 sizes and initialisation, causality, kernels, validation."""

import math

import pytest
import torch

from model import GPT, Block, GPTConfig, gpt_layers, lm_loss


def tiny(**overrides) -> GPTConfig:
    return GPTConfig(**{"n_layer": 2, "n_head": 2, "n_embd": 32, "seq_len": 16, "vocab_size": 64, **overrides})


def test_forward_shapes_and_initial_loss():
    cfg = tiny()
    model = GPT(cfg, seed=0)
    idx = torch.randint(0, cfg.vocab_size, (3, cfg.seq_len))
    logits = model(idx)
    assert logits.shape == (3, cfg.seq_len, cfg.vocab_size)
    # Small N(0, 0.02) weights: on unrelated labels the first loss is close to a uniform guess.
    labels = torch.randint(0, cfg.vocab_size, (3, cfg.seq_len))
    assert abs(lm_loss(logits, labels).item() - math.log(cfg.vocab_size)) < 0.1


def test_gpt2_small_has_124m_parameters():
    cfg = GPTConfig(n_layer=12, n_head=12, n_embd=768, seq_len=1024, vocab_size=50257)
    with torch.device("meta"):
        model = GPT(cfg, seed=0)
    assert sum(p.numel() for p in model.parameters()) == 124_439_808


def test_lm_head_is_tied_to_the_token_embedding():
    model = GPT(tiny(), seed=0)
    layers = gpt_layers(tiny(), seed=0)
    assert layers[0].tie_key == layers[-1].tie_key is not None
    embedding = model.layers[0]
    assert len([m for m in model.layers if m is embedding]) == 1  # one module, two positions


def test_gpt2_initialisation():
    cfg = GPTConfig(n_layer=8, n_head=4, n_embd=256, seq_len=64, vocab_size=512)
    block = Block(cfg, seed=3, layer_index=2)
    assert block.attn.c_attn.weight.std().item() == pytest.approx(0.02, rel=0.05)
    assert block.mlp.c_proj.weight.std().item() == pytest.approx(0.02 / math.sqrt(2 * cfg.n_layer), rel=0.05)
    assert torch.count_nonzero(block.attn.c_attn.bias) == 0
    assert torch.all(block.ln_1.weight == 1)


def test_layer_weights_depend_only_on_seed_and_index():
    cfg = tiny()
    a, b = Block(cfg, seed=7, layer_index=3), Block(cfg, seed=7, layer_index=3)
    c = Block(cfg, seed=7, layer_index=4)
    assert torch.equal(a.attn.c_attn.weight, b.attn.c_attn.weight)
    assert not torch.equal(a.attn.c_attn.weight, c.attn.c_attn.weight)


@pytest.mark.parametrize("attention", ["sdpa", "math"])
def test_attention_is_causal(attention):
    cfg = tiny(attention=attention)
    model = GPT(cfg, seed=0).eval()
    idx = torch.randint(0, cfg.vocab_size, (1, cfg.seq_len))
    changed = idx.clone()
    changed[0, -1] = (idx[0, -1] + 1) % cfg.vocab_size
    assert torch.equal(model(idx)[:, :-1], model(changed)[:, :-1])


def test_math_and_sdpa_kernels_agree():
    idx = torch.randint(0, 64, (2, 16))
    sdpa, math_ = GPT(tiny(attention="sdpa"), seed=1), GPT(tiny(attention="math"), seed=1)
    torch.testing.assert_close(sdpa(idx), math_(idx), rtol=1e-5, atol=1e-5)
    lm_loss(sdpa(idx), idx).backward()
    lm_loss(math_(idx), idx).backward()
    for p, q in zip(sdpa.parameters(), math_.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"n_embd": 30, "n_head": 4}, "model.n_embd=30 is not divisible by model.n_head=4"),
        ({"n_layer": 0}, "model.n_layer=0"),
        ({"dropout": 1.5}, "model.dropout=1.5"),
        ({"attention": "flash3"}, "model.attention='flash3' is unknown: allowed values are sdpa, math"),
    ],
)
def test_config_validation(overrides, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        tiny(**overrides)
