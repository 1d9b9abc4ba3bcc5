"""A local Hugging Face GPT-2 directory, read the cheap way: config.json, the tensor names and shapes, and
tensors one at a time (safetensors reads only the bytes of the tensor asked for; a .bin is memory-mapped).

Every failure is a ValueError that names model.init_from. Tensor names are given without GPT2LMHeadModel's
`transformer.` prefix; files written with or without it both work.
"""

import json
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from model.hf_gpt2 import HF_PREFIX

CONFIG_FILE = "config.json"
WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")  # the first one present is read


@dataclass(frozen=True)
class HFCheckpoint:
    directory: Path
    config: dict
    """config.json as parsed."""
    weights: Path
    """model.safetensors or pytorch_model.bin."""


def open_hf_dir(path: str) -> HFCheckpoint:
    """The directory's config.json and weight file; ValueError naming model.init_from when either is missing
    or config.json is not JSON."""
    directory = Path(path).expanduser().resolve()
    if not directory.is_dir():
        raise ValueError(f"model.init_from={path} is not a directory: give a local Hugging Face GPT-2 directory")
    config_file = directory / CONFIG_FILE
    if not config_file.is_file():
        raise ValueError(f"model.init_from={path} holds no {CONFIG_FILE}: give a Hugging Face GPT-2 directory")
    try:
        config = json.loads(config_file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ValueError(f"model.init_from={path}: {CONFIG_FILE} is not valid JSON ({error})") from None
    weights = next((directory / name for name in WEIGHT_FILES if (directory / name).is_file()), None)
    if weights is None:
        raise ValueError(f"model.init_from={path} holds no weights: expected {' or '.join(WEIGHT_FILES)}")
    return HFCheckpoint(directory, config, weights)


def _unprefixed(name: str) -> str:
    return name.removeprefix(HF_PREFIX)


def _where(checkpoint: HFCheckpoint) -> str:
    return f"model.init_from={checkpoint.directory}: {checkpoint.weights.name}"


def _open_safetensors(checkpoint: HFCheckpoint):
    try:
        return safe_open(checkpoint.weights, framework="pt")
    except Exception as error:  # safetensors raises its own SafetensorError for a truncated or foreign file
        raise ValueError(f"{_where(checkpoint)} cannot be read as safetensors ({error})") from None


def _load_bin(checkpoint: HFCheckpoint) -> dict[str, torch.Tensor]:
    try:
        # mmap: only the tensors this stage reads are paged in, not the whole file.
        state = torch.load(checkpoint.weights, map_location="cpu", mmap=True, weights_only=True)
    except Exception as error:  # pickle, zip and torch's own errors for a file torch.save did not write
        raise ValueError(f"{_where(checkpoint)} cannot be read by torch.load ({error})") from None
    if not isinstance(state, dict):
        raise ValueError(f"{_where(checkpoint)} holds a {type(state).__name__}, not a state dict")
    return {_unprefixed(name): tensor for name, tensor in state.items()}


def tensor_shapes(checkpoint: HFCheckpoint) -> dict[str, tuple[int, ...]]:
    """Every tensor's (unprefixed) name and shape: from the header alone for safetensors, from the pickle
    index of a memory-mapped .bin."""
    if checkpoint.weights.suffix != ".safetensors":
        return {name: tuple(tensor.shape) for name, tensor in _load_bin(checkpoint).items()}
    with _open_safetensors(checkpoint) as file:
        return {_unprefixed(name): tuple(file.get_slice(name).get_shape()) for name in file.keys()}


@contextmanager
def open_tensors(checkpoint: HFCheckpoint) -> Iterator[Callable[[str], torch.Tensor]]:
    """get(name) -> that one tensor (unprefixed name) in fp32, valid inside the `with`."""
    if checkpoint.weights.suffix != ".safetensors":
        state = _load_bin(checkpoint)
        yield lambda name: state[name].float()
        return
    with _open_safetensors(checkpoint) as file:
        names = {_unprefixed(name): name for name in file.keys()}
        yield lambda name: file.get_tensor(names[name]).float()
