"""export_hf.py: a checkpoint as a Hugging Face directory that `AutoModelForCausalLM.from_pretrained` loads, of the
model type it came from (gpt2, or llama, qwen2, qwen3, mistral: model/hf/format.py).

config.json, generation_config.json and the weights in the dtype asked for (default: the training precision): one
model.safetensors, or shards of at most `max_shard_bytes` with model.safetensors.index.json, as save_pretrained
writes them; a tied LM head is left out, as save_pretrained leaves it. For a BPE tokenizer also tokenizer.json and
tokenizer_config.json, so that `AutoTokenizer.from_pretrained` loads it too.

A run from model.init_from exports what the source had (harness/hf/source.py): its max_position_embeddings, and,
while the run's token ids are the source's, its bos, eos and pad ids, generation_config.json and tokenizer files
(the chat template) verbatim. A run from scratch gets values made from its own config and tokenizer (token ids:
the tokenizer's own, null where it has none). Each value's origin is printed. Files get the permissions the umask
gives a new file. The directory is written beside its target under a temporary name and renamed into place once
complete, so a kill never leaves a half-written export at `out`.
"""

import json
import os
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from data.tokenizer import Tokenizer, load_tokenizer, save_tokenizer
from harness.consolidate import consolidate
from harness.files import fsync_path
from harness.hf.checkpoint import INDEX_FILE
from harness.hf.source import GENERATION_CONFIG, TOKENIZER_SIDE_FILES, HFSource, read_hf_source
from model import GPT
from model.hf.format import hf_config_from_model, hf_state_from_layers
from schema.scripts import ExportConfig

WEIGHTS = "model.safetensors"
# Special-token spellings of the tokenizers in use (Llama 3, Llama 2 / Mistral, GPT-2 / Qwen2 / SmolLM2), in order
# of preference: the first one a tokenizer holds gives its id.
BOS_TOKENS = ("<|begin_of_text|>", "<s>", "<|endoftext|>")
EOS_TOKENS = ("<|end_of_text|>", "</s>", "<|endoftext|>")
PAD_TOKENS = ("<pad>", "<|pad|>", "[PAD]")
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}  # schema/scripts.py's EXPORT_DTYPES


def check_out(out: Path) -> None:
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ValueError(
            f"out={str(out)!r} exists and is not an empty directory: give a new directory (never overwritten)"
        )


def export_hf(config: ExportConfig) -> Path:
    """Write the export of config.checkpoint to config.out; returns it. Raises ValueError naming the option."""
    out = Path(config.out).expanduser()
    check_out(out)
    loaded = consolidate(Path(config.checkpoint), option="checkpoint")
    try:
        tokenizer = load_tokenizer(loaded.tokenizer_dir)
    except ValueError:  # a run without a tokenizer (synthetic tokens): the weights alone
        tokenizer = None
    # The training precision when dtype is not given (checkpoints older than the field: fp32).
    dtype = config.dtype or loaded.checkpoint.meta.get("precision", "fp32")
    source = read_hf_source(loaded.checkpoint.path, loaded.run_dir)
    for line in write_hf_dir(loaded.model, tokenizer, out, config.max_shard_bytes, source, DTYPES[dtype]):
        print(f"stagecheck: {line}", flush=True)
    return out


def special_tokens(tokenizer: Tokenizer | None) -> dict[str, tuple[str, int] | None]:
    """{"bos_token": (spelling, id), "eos_token": ..., "pad_token": ...}: the tokenizer's own, None where it has none
    (bytes have no special tokens; the BPE data=text trains has <|endoftext|>). The end-of-sequence id that ended
    every document in training, when the tokenizer records one, is the eos_token."""
    vocab = tokenizer.hf.get_vocab(with_added_tokens=True) if tokenizer is not None and tokenizer.hf else {}
    candidates = {"bos_token": BOS_TOKENS, "eos_token": EOS_TOKENS, "pad_token": PAD_TOKENS}
    found = {
        role: next(((t, vocab[t]) for t in spellings if t in vocab), None) for role, spellings in candidates.items()
    }
    if vocab and tokenizer.eos_id is not None:
        found["eos_token"] = (tokenizer.hf.id_to_token(tokenizer.eos_id), tokenizer.eos_id)
    return found


def write_hf_dir(
    model: GPT,
    tokenizer: Tokenizer | None,
    out: Path,
    max_shard_bytes: int = ExportConfig.max_shard_bytes,
    source: HFSource | None = None,
    dtype: torch.dtype = torch.float32,
) -> list[str]:
    """The Hugging Face directory of `model` (and of a BPE `tokenizer`) at `out`, which must not exist or be empty,
    keeping what `source` (model.init_from's record) had; weights in `dtype`. Returns one line per value whose origin
    matters: where it came from."""
    hf_config = hf_config_from_model(model.config)  # refuses a model HF cannot hold (GPT-2 without biases)
    hf_config["dtype"] = str(dtype).removeprefix("torch.")
    files, origins = _source_or_own(model, tokenizer, hf_config, source)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        state = hf_state_from_layers(model.config, model.layer_states())
        write_weights({name: t.detach().to(dtype).contiguous() for name, t in state.items()}, tmp, max_shard_bytes)
        (tmp / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")
        if tokenizer is not None and tokenizer.kind == "bpe":
            save_tokenizer(tokenizer, tmp)  # tokenizer.json
        for name, text in files.items():
            (tmp / name).write_text(text)
        file_mode = 0o666 & ~_umask()  # safetensors writes its files 0600
        for child in tmp.iterdir():
            child.chmod(file_mode)
            fsync_path(child)
        check_out(out)  # nothing appeared there meanwhile
        os.replace(tmp, out)  # rename(2) replaces a missing or empty directory, atomically
        fsync_path(out.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return origins


def _source_or_own(
    model: GPT, tokenizer: Tokenizer | None, hf_config: dict, source: HFSource | None
) -> tuple[dict[str, str], list[str]]:
    """Sets config.json's context length and token ids in `hf_config`, from `source` where it holds them, else from
    the model and its tokenizer; returns the other files to write (name -> text) and each value's origin."""
    config = model.config
    files, origins = {}, []

    def from_source(what: str) -> str:
        return f"model.init_from's {what} ({source.directory})"

    if config.arch == "llama":
        key = "max_position_embeddings"
        if source is not None and source.max_positions is not None:
            hf_config[key] = source.max_positions
            origin = from_source("config.json")
        elif config.rope_scaling == "llama3" and hf_config[key] > config.seq_len:
            origin = "model.rope_original_max_positions x model.rope_factor (llama3 scaling; no source gave it)"
        else:
            origin = "model.seq_len (the training length; no source gave it)"
        origins.append(f"config.json {key}={hf_config[key]} from {origin}")
    tokens = special_tokens(tokenizer)
    ids = {f"{role}_id": found[1] if found else None for role, found in tokens.items()}
    carried = source.token_ids() if source is not None else {}
    hf_config.update({**ids, **carried})
    id_origin = from_source("config.json") if carried else "the run's tokenizer"
    origins.append(f"config.json bos/eos/pad ids {[hf_config[k] for k in ids]} from {id_origin}")

    source_files = source.files if source is not None else {}
    if GENERATION_CONFIG in source_files:
        files[GENERATION_CONFIG] = source_files[GENERATION_CONFIG]
        origins.append(f"{GENERATION_CONFIG} from {from_source(GENERATION_CONFIG)}")
    else:
        generation = {"_from_model_config": True, **{k: hf_config[k] for k in ids}}
        files[GENERATION_CONFIG] = json.dumps(generation, indent=2) + "\n"
        origins.append(f"{GENERATION_CONFIG} made from config.json's token ids (no source gave one)")
    if tokenizer is not None and tokenizer.kind == "bpe":
        side = {name: text for name, text in source_files.items() if name in TOKENIZER_SIDE_FILES}
        if side:
            files.update(side)
            origins.append(f"{', '.join(side)} (the chat template) from {from_source('tokenizer files')}")
        else:
            tokenizer_config = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": config.seq_len}
            tokenizer_config.update({role: found[0] for role, found in tokens.items() if found})
            files["tokenizer_config.json"] = json.dumps(tokenizer_config, indent=2) + "\n"
            origins.append("tokenizer_config.json made from the run's tokenizer (no chat template)")
    return files, origins


def write_weights(state: dict[str, torch.Tensor], directory: Path, max_shard_bytes: int) -> None:
    """model.safetensors, or, when the tensors outgrow max_shard_bytes, model-0000K-of-0000N.safetensors (each at
    most that size unless one tensor alone is bigger) and the index that maps each tensor to its shard."""
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, tensor in state.items():
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensor
        size += nbytes
    if len(shards) == 1:
        save_file(state, directory / WEIGHTS, metadata={"format": "pt"})
        return
    weight_map = {}
    for k, shard in enumerate(shards, start=1):
        file = f"model-{k:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, directory / file, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, file))
    total = sum(t.numel() * t.element_size() for t in state.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (directory / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask
