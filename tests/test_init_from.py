"""model.init_from: a small random GPT-2 built and saved by `transformers` here (no hub) gives our model HF's
logits, and a 2-stage run started from it HF's first loss; bad directories fail at start-up, exit 2."""

import json

import pytest
import torch
import transformers
import yaml

from data.synthetic import SyntheticTokenSource
from harness.hf.checkpoint import open_hf_dir, open_tensors
from harness.hf.init_from import check_tensors
from model import GPT, GPTConfig, lm_loss
from model.hf.format import hf_state_from_layers, layer_hf_names, layer_state_from_hf
from model.hf.gpt2 import gpt_config_from_hf
from tests.runs import TINY, metrics, python_run
from tests.shared_runs import case

HF_SHAPE = dict(n_layer=2, n_head=2, n_embd=32, n_positions=32, vocab_size=256)


def hf_model(**overrides) -> transformers.GPT2LMHeadModel:
    config = transformers.GPT2Config(
        **HF_SHAPE,
        activation_function="gelu_new",
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=None,  # GPT-2's 50256 lies outside a 256-token vocabulary
        eos_token_id=None,
        **overrides,
    )
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(config).eval()


def _save_hf_model(scratch) -> None:
    hf_model().save_pretrained(scratch / "hf")


# model=tiny's 4 blocks are replaced silently; an override equal to config.json's value is accepted. The second job
# resumes from the first's checkpoint and names the same weights, which it must not read again.
HF_RUN = [*TINY, "model.n_layer=2", "model.dropout=0", "train.micro_batches=2", "train.trace_step=0", "logger=none"]
CASES = {
    "hf-start": case(*HF_RUN, "model.init_from={scratch}/hf", "train.steps=1", setup=_save_hf_model),
    "hf-resumed": case(
        *HF_RUN,
        "model.init_from={runs}/../files/init_from-hf-start/hf",
        "train.steps=2",
        "train.resume={runs}/init_from-hf-start/checkpoints/step_00000001",
    ),
}


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    """(model, safetensors directory, pytorch_model.bin directory). The .bin is written the way older GPT-2
    files are: no `transformer.` prefix, the attention-mask buffers included, lm_head.weight stored too."""
    model = hf_model()
    safetensors_dir = tmp_path_factory.mktemp("hf_safetensors")
    model.save_pretrained(safetensors_dir)
    bin_dir = tmp_path_factory.mktemp("hf_bin")
    (bin_dir / "config.json").write_text((safetensors_dir / "config.json").read_text())
    state = {name.removeprefix("transformer."): tensor for name, tensor in model.state_dict().items()}
    T = HF_SHAPE["n_positions"]
    for block in range(HF_SHAPE["n_layer"]):
        state[f"h.{block}.attn.bias"] = torch.tril(torch.ones(T, T)).view(1, 1, T, T)
        state[f"h.{block}.attn.masked_bias"] = torch.tensor(-1e4)
    torch.save(state, bin_dir / "pytorch_model.bin")
    return model, safetensors_dir, bin_dir


def loaded_gpt(directory) -> GPT:
    """Our unpipelined GPT with every layer loaded through layer_state_from_hf."""
    checkpoint = open_hf_dir(str(directory))
    config = GPTConfig(**gpt_config_from_hf(checkpoint.config))
    gpt = GPT(config, seed=7).eval()  # a seed HF's weights must fully replace
    with open_tensors(checkpoint) as get:
        # GPT.layers holds each module once: the flat entries in order, the tied LM head (the last) left out.
        for flat_index, module in enumerate(gpt.layers):
            module.load_state_dict(layer_state_from_hf(config, flat_index, get))
        head = layer_state_from_hf(config, len(gpt.forward_funcs) - 1, get)
    torch.testing.assert_close(head["wte.weight"], gpt.layers[0].wte.weight, rtol=0, atol=0)
    return gpt


@pytest.mark.parametrize("weights", ["safetensors", "bin"])
def test_loaded_model_gives_hf_logits(hf, weights):
    model, safetensors_dir, bin_dir = hf
    gpt = loaded_gpt(safetensors_dir if weights == "safetensors" else bin_dir)
    assert gpt.config.activation == "gelu_tanh"
    idx = torch.randint(
        0, HF_SHAPE["vocab_size"], (2, HF_SHAPE["n_positions"]), generator=torch.Generator().manual_seed(1)
    )
    with torch.no_grad():
        # 1e-6, tighter than the 1e-5 asked for: with exact GELU instead of gelu_tanh these logits are 3e-6 off.
        torch.testing.assert_close(gpt(idx), model(idx).logits, rtol=0, atol=1e-6)


def test_layer_states_map_back_to_hf_names(hf):
    """hf_state_from_layers (export's direction) gives back exactly the HF state dict, lm_head left out."""
    model, safetensors_dir, _ = hf
    gpt = loaded_gpt(safetensors_dir)
    exported = hf_state_from_layers(gpt.config, {i: module.state_dict() for i, module in enumerate(gpt.layers)})
    expected = {name: t for name, t in model.state_dict().items() if name != "lm_head.weight"}
    assert exported.keys() == expected.keys()
    for name, tensor in expected.items():
        torch.testing.assert_close(exported[name], tensor, rtol=0, atol=0)


@pytest.mark.parametrize(
    "change, message",
    [
        ({"n_inner": 100}, "n_inner=100 is not 4 * n_embd = 128"),
        ({"tie_word_embeddings": False}, "tie_word_embeddings is false"),
        ({"layer_norm_epsilon": 1e-6}, "layer_norm_epsilon=1e-06"),
        ({"scale_attn_by_inverse_layer_idx": True}, "scale_attn_by_inverse_layer_idx=True"),
        ({"reorder_and_upcast_attn": True}, "reorder_and_upcast_attn=True"),
        ({"activation_function": "relu"}, "activation_function='relu' is not one of gelu_new"),
        ({"model_type": "gpt_neox"}, "model_type='gpt_neox'"),
        ({"n_layer": None}, "n_layer=None must be a positive integer"),
    ],
)
def test_unmappable_gpt2_variants_are_refused(change, message):
    config = {**HF_SHAPE, "activation_function": "gelu_new", "n_inner": None, **change}
    with pytest.raises(ValueError, match="model.init_from") as error:
        gpt_config_from_hf(config)
    assert message in str(error.value)


def test_hf_activation_names_map_onto_ours():
    assert gpt_config_from_hf({**HF_SHAPE, "activation_function": "gelu"})["activation"] == "gelu"
    assert gpt_config_from_hf({**HF_SHAPE, "activation_function": "gelu_pytorch_tanh"})["activation"] == "gelu_tanh"


def test_weights_of_another_shape_are_refused(hf):
    checkpoint = open_hf_dir(str(hf[1]))
    model = GPTConfig(**{**gpt_config_from_hf(checkpoint.config), "n_embd": 64})
    with pytest.raises(ValueError, match=r"holds wte.weight of shape \[256, 32\], config.json implies \[256, 64\]"):
        check_tensors(checkpoint, model)


@pytest.mark.multiproc
def test_two_stage_run_starts_from_hf_weights_and_a_resume_does_not_reload(case_runs, shared_runs):
    run_dir, resumed_dir = case_runs["hf-start"], case_runs["hf-resumed"]
    weights = (
        f"stagecheck: initial weights from {run_dir.parent.parent / 'files' / run_dir.name / 'hf'}/model.safetensors"
    )
    output = shared_runs.case_output()
    assert output.count(weights) == 1  # by the first job only: the resumed one takes the checkpoint's weights
    config = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert {k: config["model"][k] for k in ("n_layer", "n_head", "n_embd", "seq_len", "vocab_size")} == {
        "n_layer": 2,
        "n_head": 2,
        "n_embd": 32,
        "seq_len": 32,
        "vocab_size": 256,
    }
    assert config["model"]["activation"] == "gelu_tanh"

    t, source = config["train"], SyntheticTokenSource(HF_SHAPE["vocab_size"])
    batches = [source.batch(config["seed"], 1, 0, micro, t["micro_batch_size"], 32) for micro in range(2)]
    with torch.no_grad():
        hf_loss = sum(lm_loss(hf_model()(x).logits, y) for x, y in batches) / len(batches)
    assert metrics(run_dir)[0]["loss"] == pytest.approx(hf_loss.item(), abs=1e-5)

    assert f"stagecheck: resuming from {run_dir / 'checkpoints' / 'step_00000001'} after step 1" in output
    assert [row["step"] for row in metrics(resumed_dir)] == [2]


@pytest.mark.multiproc
def test_bf16_master_weights_are_the_fp32_hf_weights(tmp_path, hf):
    """DeepSpeed's BF16_Optimizer copies its fp32 masters from the module after casting it to bf16, which would
    round HF's weights to 8 bits of mantissa for good: the masters must hold the fp32 values themselves. A step
    at lr 1e-30 changes no weight (the zero biases move by 5e-31), and the checkpoint holds the masters."""
    model, safetensors_dir, _ = hf
    run_dir = tmp_path / "run"
    overrides = [*TINY, f"model.init_from={safetensors_dir}", "train.precision=bf16", "train.lr=1e-30"]
    python_run(run_dir, *overrides, "train.steps=1", "train.trace_step=0", "logger=none")
    (optim_file,) = (run_dir / "checkpoints").glob("step_*/bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt")
    optim = torch.load(optim_file, weights_only=False)["optimizer_state_dict"]
    hf_state = model.state_dict()
    config = GPTConfig(**gpt_config_from_hf(model.config.to_dict()))
    checked = 0
    for masters, slices in zip(optim["single_partition_of_fp32_groups"], optim["param_slice_mappings"]):
        for name, where in slices.items():  # DeepSpeed's names: "<flat index>.<param>", the tied one apart
            index, _, param = name.partition(".")
            flat_index, param = (0, "wte.weight") if index == "tied_modules" else (int(index), param)
            hf_name, transposed = layer_hf_names(config, flat_index)[param]
            expected = hf_state["transformer." + hf_name]
            expected = (expected.t() if transposed else expected).flatten()
            got = masters[where.start : where.start + where.numel]
            torch.testing.assert_close(got, expected, rtol=0, atol=1e-29)  # bf16 rounding would be ~1e-4
            checked += 1
    assert checked == 4 + 12 * HF_SHAPE["n_layer"]


def bad_dir(case: str, good, tmp_path):
    """A copy of the good safetensors directory `good`, spoilt as `case` says."""
    directory = tmp_path / "hf"
    if case == "missing directory":
        return directory
    directory.mkdir()
    config = json.loads((good / "config.json").read_text())
    changes = {"n_inner not 4h": {"n_inner": 64}, "untied": {"tie_word_embeddings": False}}
    text = "{n_layer: 2" if case == "malformed config.json" else json.dumps({**config, **changes.get(case, {})})
    (directory / "config.json").write_text(text)
    if case != "no weights file":
        (directory / "model.safetensors").write_bytes((good / "model.safetensors").read_bytes())
    return directory


BAD_DIRS = {
    "missing directory": "is not a directory",
    "no weights file": "holds no weights: expected model.safetensors or model.safetensors.index.json or pytorch",
    "malformed config.json": "config.json is not valid JSON",
    "n_inner not 4h": "config.json n_inner=64 is not 4 * n_embd = 128",
    "untied": "config.json tie_word_embeddings is false",
}


@pytest.mark.parametrize("case", BAD_DIRS)
def test_bad_init_from_fails_at_start_up(tmp_path, hf, case):
    directory = bad_dir(case, hf[1], tmp_path)
    run_dir = tmp_path / "run"
    result = python_run(run_dir, *TINY, f"model.init_from={directory}", check=False, timeout=120)
    assert result.returncode == 2, result.stderr
    assert f"stagecheck: error: model.init_from={directory}" in result.stderr
    assert BAD_DIRS[case] in result.stderr, result.stderr
    assert "Traceback" not in result.stderr + result.stdout
    assert not run_dir.exists()


def test_conflicting_model_override_is_refused(tmp_path, hf):
    run_dir = tmp_path / "run"
    result = python_run(run_dir, *TINY, f"model.init_from={hf[1]}", "model.n_layer=4", check=False, timeout=120)
    assert result.returncode == 2, result.stderr
    assert (
        f"stagecheck: error: model.n_layer=4 conflicts with model.init_from={hf[1]} (config.json n_layer=2): "
        "drop the override"
    ) in result.stderr
    assert "Traceback" not in result.stderr + result.stdout
    assert not run_dir.exists()


def test_a_resume_takes_the_model_from_its_checkpoint_without_reading_init_from(tmp_path):
    """Start-up read model.init_from (config.json, every shard header) before it looked for a checkpoint, so a resume
    needed the directory. Now the checkpoint's saved config gives the model: here the directory is gone, and the
    model is the saved one (3 layers, not the preset's)."""
    gone = tmp_path / "hf_gone"
    run_dir = tmp_path / "run"
    checkpoint = run_dir / "checkpoints" / "step_00000004"
    checkpoint.mkdir(parents=True)
    saved = {"model": {"n_layer": 3, "init_from": str(gone)}}
    meta = {"step": 4, "world_size": 1, "pipeline_stages": 1, "config": saved}
    (checkpoint / "stagecheck.json").write_text(json.dumps(meta))
    (checkpoint.parent / "latest").write_text("step_00000004\n")
    result = python_run(run_dir, *TINY, f"model.init_from={gone}", "dry_run=true", check=False, timeout=180)
    assert result.returncode == 0, result.stderr
    assert json.loads((run_dir / "plan.json").read_text())["model"]["n_layer"] == 3
