"""A local Hugging Face model directory, read the cheap way: config.json, the tensor names and shapes, and tensors
one at a time (safetensors reads only the bytes of the tensor asked for; a .bin is memory-mapped). A sharded
checkpoint (model.safetensors.index.json, or pytorch_model.bin.index.json) opens a shard only when a tensor of it
is first read, so a pipeline stage opens only the shards that hold its layers.

Every failure is a ValueError that names model.init_from. Tensor names are given without a family's file prefix
(GPT2LMHeadModel's `transformer.`: model/hf/format.py's FILE_PREFIXES); files written with or without it both work.
"""

import json
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from model.hf.format import FILE_PREFIXES

CONFIG_FILE = "config.json"
TOKENIZER_FILE = "tokenizer.json"
INDEX_FILE = "model.safetensors.index.json"
BIN_INDEX_FILE = "pytorch_model.bin.index.json"
# The first one present is read.
WEIGHT_FILES = ("model.safetensors", INDEX_FILE, "pytorch_model.bin", BIN_INDEX_FILE)


@dataclass(frozen=True)
class HFCheckpoint:
    directory: Path
    config: dict
    """config.json as parsed."""
    weights: Path | None
    """One of WEIGHT_FILES: a weight file or a shard index; None when the directory holds none (enough for a dry
    run)."""
    shards: dict[str, Path] | None = None
    """For an index: each tensor's name, as the index writes it, -> the shard file that holds it."""

    @property
    def where(self) -> str:
        return f"model.init_from={self.directory}: {self.weights.name}"


def open_hf_dir(path: str, need_weights: bool = True) -> HFCheckpoint:
    """The directory's config.json and weight file (or shard index); ValueError naming model.init_from when either
    is missing (the weights only if `need_weights`), config.json is not JSON, or the index is unusable."""
    directory = Path(path).expanduser().resolve()
    if not directory.is_dir():
        raise ValueError(f"model.init_from={path} is not a directory: give a local Hugging Face model directory")
    config_file = directory / CONFIG_FILE
    if not config_file.is_file():
        raise ValueError(f"model.init_from={path} holds no {CONFIG_FILE}: give a Hugging Face model directory")
    try:
        config = json.loads(config_file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ValueError(f"model.init_from={path}: {CONFIG_FILE} is not valid JSON ({error})") from None
    weights = next((directory / name for name in WEIGHT_FILES if (directory / name).is_file()), None)
    if weights is None and need_weights:
        raise ValueError(f"model.init_from={path} holds no weights: expected {' or '.join(WEIGHT_FILES)}")
    shards = _read_index(weights) if weights is not None and weights.name in (INDEX_FILE, BIN_INDEX_FILE) else None
    return HFCheckpoint(directory, config, weights, shards)


def _read_index(index: Path) -> dict[str, Path]:
    where = f"model.init_from={index.parent}: {index.name}"
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as error:
        raise ValueError(f"{where} is not a shard index with a weight_map ({error!r})") from None
    if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
        raise ValueError(f"{where}: its weight_map must map tensor names to shard file names")
    files = sorted(set(weight_map.values()))
    foreign = [name for name in files if Path(name).name != name]
    if foreign:
        raise ValueError(f"{where} names shard files outside the directory, e.g. {foreign[0]!r}")
    missing = [name for name in files if not (index.parent / name).is_file()]
    if missing:
        raise ValueError(
            f"{where} names {len(missing)} shard files that are missing, e.g. {', '.join(missing[:3])}: "
            f"copy the whole checkpoint"
        )
    return {name: index.parent / file for name, file in weight_map.items()}


def _unprefixed(name: str) -> str:
    for prefix in FILE_PREFIXES:
        name = name.removeprefix(prefix)
    return name


def _open_safetensors(file: Path, checkpoint: HFCheckpoint):
    try:
        return safe_open(file, framework="pt")
    except Exception as error:  # safetensors raises its own SafetensorError for a truncated or foreign file
        raise ValueError(
            f"model.init_from={checkpoint.directory}: {file.name} cannot be read as safetensors ({error})"
        ) from None


def _load_bin(file: Path, checkpoint: HFCheckpoint) -> dict[str, torch.Tensor]:
    where = f"model.init_from={checkpoint.directory}: {file.name}"
    try:
        # mmap: only the tensors this stage reads are paged in, not the whole file.
        state = torch.load(file, map_location="cpu", mmap=True, weights_only=True)
    except Exception as error:  # pickle, zip and torch's own errors for a file torch.save did not write
        raise ValueError(f"{where} cannot be read by torch.load ({error})") from None
    if not isinstance(state, dict):
        raise ValueError(f"{where} holds a {type(state).__name__}, not a state dict")
    return state


class _WeightFile:
    """One safetensors file (its header read, tensors read one at a time) or one memory-mapped .bin."""

    def __init__(self, path: Path, checkpoint: HFCheckpoint, files: ExitStack) -> None:
        self.path = path
        self._state = _load_bin(path, checkpoint) if path.suffix == ".bin" else None
        self._file = None if self._state is not None else files.enter_context(_open_safetensors(path, checkpoint))

    def shapes(self) -> dict[str, tuple[int, ...]]:
        if self._state is not None:
            return {name: tuple(tensor.shape) for name, tensor in self._state.items()}
        return {name: tuple(self._file.get_slice(name).get_shape()) for name in self._file.keys()}

    def get(self, name: str) -> torch.Tensor:
        return self._state[name] if self._state is not None else self._file.get_tensor(name)


def tensor_shapes(checkpoint: HFCheckpoint) -> dict[str, tuple[int, ...]]:
    """Every tensor's (unprefixed) name and shape, in every shard: from the headers alone for safetensors, from the
    pickle index of a memory-mapped .bin."""
    paths = sorted(set(checkpoint.shards.values())) if checkpoint.shards else [checkpoint.weights]
    shapes = {}
    with ExitStack() as files:
        for path in paths:
            shapes.update({_unprefixed(n): shape for n, shape in _WeightFile(path, checkpoint, files).shapes().items()})
    return shapes


class TensorReader:
    """reader(name) -> that one tensor (unprefixed name) in fp32. A shard is opened when a tensor of it is first
    read, and stays open until the reader closes; `opened` lists the files opened."""

    def __init__(self, checkpoint: HFCheckpoint, files: ExitStack) -> None:
        self.checkpoint = checkpoint
        self.opened: dict[Path, _WeightFile] = {}
        self._files = files
        shards = checkpoint.shards
        if shards is None:  # one file: its own names
            whole = self._open(checkpoint.weights)
            shards = dict.fromkeys(whole.shapes(), checkpoint.weights)
        # Unprefixed name -> (file, the name inside it).
        self._where = {_unprefixed(name): (path, name) for name, path in shards.items()}

    def _open(self, path: Path) -> _WeightFile:
        if path not in self.opened:
            self.opened[path] = _WeightFile(path, self.checkpoint, self._files)
        return self.opened[path]

    def __call__(self, name: str) -> torch.Tensor:
        path, stored = self._where[name]
        file = self._open(path)  # ValueError for a file that cannot be read
        try:
            tensor = file.get(stored)
        except Exception as error:  # KeyError, SafetensorError: a shard that lacks a tensor its index names
            where = f"model.init_from={self.checkpoint.directory}: {path.name}"
            raise ValueError(f"{where} lacks {stored} ({error!r})") from None
        return tensor.float()


@contextmanager
def open_tensors(checkpoint: HFCheckpoint) -> Iterator[TensorReader]:
    """A TensorReader, valid inside the `with`."""
    with ExitStack() as files:
        yield TensorReader(checkpoint, files)
