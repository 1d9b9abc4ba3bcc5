"""model.init_from: a local Hugging Face GPT-2 directory gives the model its shape at start-up and, once the
engine is built, each stage its own layers' weights."""

from collections.abc import Callable, Sequence

import torch
import torch.nn as nn
from omegaconf import DictConfig, OmegaConf

from harness.checkpoint import resume_point
from harness.context import RunContext
from harness.hf_checkpoint import HFCheckpoint, open_hf_dir, open_tensors, tensor_shapes
from model import GPTConfig
from model.hf_gpt2 import gpt_config_from_hf, hf_shapes, layer_state_from_hf

# Our model.* field -> the config.json key it comes from, where the names differ.
_HF_KEYS = {"seq_len": "n_positions", "activation": "activation_function"}


def resolve_init_from(cfg: DictConfig, overrides: Sequence[str]) -> None:
    """Set the composed config's model shape from model.init_from's config.json (before it is typed, so
    config.yaml carries it too) and check the weight file's tensors. A model.* field the user set on the
    command line (`overrides`, Hydra's task overrides) to another value is refused; a preset's is replaced.
    Raises ValueError naming model.init_from."""
    path = cfg.model.init_from
    if path is None:
        return
    checkpoint = open_hf_dir(path)
    overridden = {override.split("=", 1)[0].lstrip("+~") for override in overrides}
    for field, value in gpt_config_from_hf(checkpoint.config, where=f"model.init_from={path}").items():
        if f"model.{field}" in overridden and cfg.model[field] != value:
            key = _HF_KEYS.get(field, field)
            # bias (GPT-2 always has biases) and a missing activation_function are implied, not written.
            source = f"{key}={checkpoint.config[key]}" if key in checkpoint.config else f"implies {field}={value}"
            raise ValueError(
                f"model.{field}={cfg.model[field]} conflicts with model.init_from={path} (config.json {source}): "
                f"drop the override"
            )
        cfg.model[field] = value
    cfg.model.init_from = str(checkpoint.directory)
    try:
        model = GPTConfig(**OmegaConf.to_container(cfg.model, resolve=True))
    except ValueError as error:  # e.g. an n_embd that n_head does not divide
        raise ValueError(f"model.init_from={path}: config.json gives an invalid model ({error})") from None
    check_tensors(checkpoint, model)


def check_tensors(checkpoint: HFCheckpoint, model: GPTConfig) -> None:
    """Every tensor the model reads is in the weight file, with its shape (extra tensors, such as the
    attention-mask buffers older files carry or a tied lm_head.weight, are ignored)."""
    found = tensor_shapes(checkpoint)
    where = f"model.init_from={checkpoint.directory}: {checkpoint.weights.name}"
    expected = hf_shapes(model)
    missing = [name for name in expected if name not in found]
    if missing:
        raise ValueError(f"{where} lacks {len(missing)} tensors config.json implies, e.g. {', '.join(missing[:3])}")
    for name, shape in expected.items():
        if found[name] != shape:
            raise ValueError(f"{where} holds {name} of shape {list(found[name])}, config.json implies {list(shape)}")


def hf_initial_weights(ctx: RunContext) -> Callable[[nn.Module], dict[nn.Parameter, torch.Tensor]] | None:
    """parallel.runtime.engine's `initial_weights`: model.init_from's tensors for the built stage's layers only (its
    `local_layers()`). None without model.init_from, and when the run resumes (the checkpoint's weights win).
    (Typed without parallel.runtime.engine's alias: start-up imports this module before DeepSpeed may be imported.)"""
    run = ctx.run
    if run.model.init_from is None or resume_point(run.train, ctx.run_dir) is not None:
        return None
    checkpoint = open_hf_dir(run.model.init_from)

    def read(module: nn.Module) -> dict[nn.Parameter, torch.Tensor]:
        weights = {}
        with open_tensors(checkpoint) as get:
            # The tied embedding appears on the first and the last stage: each reads wte itself.
            for flat_index, layer in module.local_layers():
                params = dict(layer.named_parameters())
                for name, value in layer_state_from_hf(run.model, flat_index, get).items():
                    weights[params[name]] = value
        if ctx.env.rank == 0:
            print(
                f"stagecheck: initial weights from {checkpoint.weights} (each stage reads its own layers)", flush=True
            )
        return weights

    return read
