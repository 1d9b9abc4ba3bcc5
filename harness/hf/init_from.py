"""model.init_from: a local Hugging Face directory (GPT-2, Llama, Qwen2 or Mistral) gives the model its shape at
start-up, the run its tokenizer when it holds a tokenizer.json, and, once the engine is built, each stage its own
layers' weights (a sharded checkpoint's stage opens only the shards that hold them)."""

from collections.abc import Callable, Sequence

import torch
import torch.nn as nn
from omegaconf import DictConfig, OmegaConf

from data.tokenizer_file import read_tokenizer_file
from harness.checkpoint import resume_point
from harness.context import RunContext
from harness.hf.checkpoint import TOKENIZER_FILE, HFCheckpoint, open_hf_dir, open_tensors, tensor_shapes
from harness.init_tokenizer import check_chosen_tokenizer, check_prepared_data, prepared_files
from model import GPTConfig
from model.hf.format import config_from_hf, family_of, hf_shapes, layer_state_from_hf

# Our model.* field -> the config.json keys it may come from (GPT-2's, Llama's), where the names differ.
_HF_KEYS = {
    "seq_len": ("n_positions",),
    "activation": ("activation_function", "hidden_act"),
    "n_layer": ("n_layer", "num_hidden_layers"),
    "n_head": ("n_head", "num_attention_heads"),
    "n_kv_head": ("num_key_value_heads",),
    "n_embd": ("n_embd", "hidden_size"),
    "head_dim": ("head_dim",),
    "norm_eps": ("layer_norm_epsilon", "rms_norm_eps"),
    "tie_embeddings": ("tie_word_embeddings",),
    "hf_model_type": ("model_type",),
}


def resolve_init_from(cfg: DictConfig, overrides: Sequence[str]) -> None:
    """Set the composed config's model shape from model.init_from's config.json (before it is typed, so
    config.yaml carries it too), pick its tokenizer.json, and check the weight files' tensors (a dry run needs
    config.json alone). A model.* field the user set on the command line (`overrides`, Hydra's task overrides) to
    another value is refused; a preset's is replaced. Raises ValueError naming the option."""
    path = cfg.model.init_from
    if path is None:
        return
    checkpoint = open_hf_dir(path, need_weights=not cfg.dry_run)
    overridden = {override.split("=", 1)[0].lstrip("+~") for override in overrides}
    fields = config_from_hf(checkpoint.config, cfg.model.seq_len, where=f"model.init_from={path}")
    for field, value in fields.items():
        if f"model.{field}" in overridden and cfg.model[field] != value:
            key = next((k for k in _HF_KEYS.get(field, (field,)) if k in checkpoint.config), None)
            # What config.json does not write (GPT-2's biases, a llama's dropout) is implied, not read.
            source = f"{key}={checkpoint.config[key]}" if key else f"implies {field}={value}"
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
    pick_tokenizer(cfg, checkpoint, overridden)
    if checkpoint.weights is not None:
        check_tensors(checkpoint, model)


def model_from_checkpoint(cfg: DictConfig, saved: dict | None, overrides: Sequence[str]) -> bool:
    """A launch that resumes with model.init_from set: the model's shape comes from the checkpoint's saved config
    (`saved`, stagecheck.json's), which the first launch read from model.init_from's config.json, and so do
    data.tokenizer and data.tokenizer_file where that launch took them from the directory. model.init_from is not
    read: a resume needs neither the directory nor its shard headers (the weights come from the checkpoint). An
    option the command line sets keeps its value, for harness/resume_check.py to compare with the saved one. False
    (nothing done) when the checkpoint saved no config: model.init_from is then read as at a fresh start."""
    if cfg.model.init_from is None or saved is None or "model" not in saved:
        return False
    overridden = {override.split("=", 1)[0].lstrip("+~") for override in overrides}
    for field, value in saved["model"].items():
        if field in cfg.model and field != "init_from" and f"model.{field}" not in overridden:
            cfg.model[field] = value
    data, saved_data = cfg.data, saved.get("data") or {}
    chosen = {"data.tokenizer", "data.tokenizer_file"} & overridden
    if "tokenizer_file" in data and saved_data.get("name") == data.name and not chosen:
        for field in ("tokenizer", "tokenizer_file"):
            if field in data and field in saved_data:
                data[field] = saved_data[field]
    return True


def pick_tokenizer(cfg: DictConfig, checkpoint: HFCheckpoint, overridden: set[str]) -> None:
    """The directory's tokenizer.json becomes data.tokenizer_file (text data: with data.tokenizer=bpe; a bare .bin)
    unless the user chose a tokenizer; whichever file the run then uses must fit the model's vocabulary and be the
    model's own tokenizer (harness/init_tokenizer.py). Prepared data (a folder prepare_data.py wrote) keeps its own
    tokenizer, which must be the model's."""
    data = cfg.data
    if "tokenizer_file" not in data:  # synthetic tokens have no tokenizer
        return
    own = checkpoint.directory / TOKENIZER_FILE
    prepared = prepared_files(data.path) if data.name == "memmap" else None
    if prepared is not None:  # data.tokenizer_file, if set, is held to the folder's (data/memmap_files.py)
        check_prepared_data(
            prepared, data.path, checkpoint.directory, own if own.is_file() else None, cfg.model.vocab_size
        )
        return
    picked = own.is_file() and data.tokenizer_file is None and "data.tokenizer" not in overridden
    if picked:
        data.tokenizer_file = str(own)
        if data.name == "text":
            data.tokenizer = "bpe"
    if data.tokenizer_file is None:
        return
    # Messages name what the user gave: the directory, or data.tokenizer_file.
    option = f"model.init_from's {TOKENIZER_FILE}" if picked else "data.tokenizer_file"
    ids = read_tokenizer_file(data.tokenizer_file, option).get_vocab_size(with_added_tokens=True)
    if ids > cfg.model.vocab_size:
        raise ValueError(
            f"{option}={data.tokenizer_file!r} has {ids} token ids, more than the vocab_size="
            f"{cfg.model.vocab_size} of model.init_from={checkpoint.directory}: use the model's own tokenizer"
        )
    if not picked and own.is_file():
        check_chosen_tokenizer(data.tokenizer_file, checkpoint.directory, own)


def check_tensors(checkpoint: HFCheckpoint, model: GPTConfig) -> None:
    """Every tensor the model reads is in the weight files, with its shape. An extra tensor is refused, since the
    model would silently lack it, unless its family says the model does not read it (model/hf/family.py's
    `unread_tensor`: GPT-2's attention-mask buffers, a tied Llama's lm_head.weight, rotary inv_freq buffers)."""
    found = tensor_shapes(checkpoint)
    expected = hf_shapes(model)
    unread = family_of(model).unread_tensor
    foreign = [name for name in found if name not in expected and not unread(model, name)]
    if foreign:
        raise ValueError(
            f"{checkpoint.where} holds {len(foreign)} tensors the model config.json describes has no place for, "
            f"e.g. {', '.join(foreign[:3])}"
        )
    missing = [name for name in expected if name not in found]
    if missing:
        raise ValueError(
            f"{checkpoint.where} lacks {len(missing)} tensors config.json implies, e.g. {', '.join(missing[:3])}"
        )
    for name, shape in expected.items():
        if found[name] != shape:
            raise ValueError(
                f"{checkpoint.where} holds {name} of shape {list(found[name])}, config.json implies {list(shape)}"
            )


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
            # A tied embedding appears on the first and the last stage: each reads it itself.
            for flat_index, layer in module.local_layers():
                params = dict(layer.named_parameters())
                for name, value in layer_state_from_hf(run.model, flat_index, get).items():
                    weights[params[name]] = value
            opened = sorted(path.name for path in get.opened)
        if ctx.env.rank == 0:
            print(
                f"stagecheck: initial weights from {checkpoint.weights} (each stage reads its own layers)", flush=True
            )
        if checkpoint.shards:
            shards = len(set(checkpoint.shards.values()))
            what = f"rank {ctx.env.rank} opened {len(opened)} of {shards} shards of {checkpoint.directory}"
            # One write, newline included: the ranks share the launcher's unbuffered stdout.
            print(f"stagecheck: {what}: {' '.join(opened)}\n", end="", flush=True)
        return weights

    return read
