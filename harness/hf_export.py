"""export_hf.py: a checkpoint as a Hugging Face GPT-2 directory that `GPT2LMHeadModel.from_pretrained` loads.

config.json and model.safetensors (fp32; no lm_head.weight: HF ties it to wte itself, as its own save_pretrained
leaves it out), plus tokenizer.json and tokenizer_config.json when the run's tokenizer is a BPE, so that
`AutoTokenizer.from_pretrained` loads it too. The directory is written beside its target under a temporary name
and renamed into place once complete, so a kill never leaves a half-written export at `out`.
"""

import json
import os
import shutil
from pathlib import Path

from safetensors.torch import save_file

from data.tokenizer import Tokenizer, load_tokenizer, save_tokenizer
from harness.consolidate import consolidate
from harness.files import fsync_path
from model import GPT
from model.hf_gpt2 import hf_config_from_gpt, hf_state_from_layers
from schema.scripts import ExportConfig

WEIGHTS = "model.safetensors"


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
    write_hf_dir(loaded.model, tokenizer, out)
    return out


def write_hf_dir(model: GPT, tokenizer: Tokenizer | None, out: Path) -> None:
    """The Hugging Face directory of `model` (and of a BPE `tokenizer`) at `out`, which must not exist or be empty."""
    hf_config = hf_config_from_gpt(model.config)  # refuses a model HF GPT-2 cannot hold (no biases)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        state = hf_state_from_layers(model.config, model.layer_states())
        weights = {name: tensor.detach().float().contiguous() for name, tensor in state.items()}
        save_file(weights, tmp / WEIGHTS, metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")
        if tokenizer is not None and tokenizer.kind == "bpe":
            save_tokenizer(tokenizer, tmp)  # tokenizer.json
            tokenizer_config = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": model.config.seq_len}
            if tokenizer.eos_id is not None:  # the token that ended every document in training
                tokenizer_config["eos_token"] = tokenizer.hf.id_to_token(tokenizer.eos_id)
            (tmp / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2) + "\n")
        for child in tmp.iterdir():
            fsync_path(child)
        check_out(out)  # nothing appeared there meanwhile
        os.replace(tmp, out)  # rename(2) replaces a missing or empty directory, atomically
        fsync_path(out.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
