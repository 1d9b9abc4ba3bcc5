"""One unpipelined GPT from a stagecheck checkpoint, whatever its stage count and data-parallel size.

DeepSpeed 0.19.8 (`PipelineModule.save_state_dict`) writes one file per flat layer run as a module,
`layer_NN-model_states.pt` (NN = the flat index, two digits or more), holding that layer's `state_dict()`. Data-
parallel replicas hold the same weights and write each file once. The tied LM head (the last flat entry) runs as a
function of the token embedding and has no file: layer_00 holds the one tied weight. The flat indices are those of
model.GPT, so each file loads into the same entry of the unpipelined model.
"""

from dataclasses import dataclass, fields
from pathlib import Path

import torch
from omegaconf import OmegaConf

from data.tokenizer import META_FILE as TOKENIZER_META
from harness.checkpoint import ResumePoint, read_checkpoint
from model import GPT, GPTConfig, gpt_layers, module_entries

RUN_CONFIG = "config.yaml"


@dataclass(frozen=True)
class Consolidated:
    model: GPT
    """In eval mode, on the CPU, in the dtype asked for."""
    checkpoint: ResumePoint

    @property
    def run_dir(self) -> Path:
        """The run that wrote the checkpoint (<run dir>/checkpoints/<tag>): its tokenizer and config live there."""
        return self.checkpoint.path.parent.parent

    @property
    def tokenizer_dir(self) -> Path:
        """Where the tokenizer that trained the model is: the checkpoint itself (harness/checkpoint.py copies it in),
        else, for checkpoints older than that, its run directory."""
        if (self.checkpoint.path / TOKENIZER_META).is_file():
            return self.checkpoint.path
        return self.run_dir


def layer_file(tag_dir: Path, flat_index: int) -> Path:
    return tag_dir / f"layer_{flat_index:02d}-model_states.pt"


def model_config(point: ResumePoint, option: str) -> GPTConfig:
    """The model shape recorded in stagecheck.json, or, for checkpoints written before it was, in the run's
    config.yaml."""
    section = point.meta.get("model")
    if section is None:
        run_config = point.path.parent.parent / RUN_CONFIG
        if not run_config.is_file():
            raise ValueError(
                f"{option}={str(point.path)!r} records no model config and its run directory has no {RUN_CONFIG}"
            )
        section = OmegaConf.to_container(OmegaConf.load(run_config).model, resolve=True)
    known = {f.name for f in fields(GPTConfig)}  # a config.yaml from before a field existed lacks it: its default
    return GPTConfig(**{name: value for name, value in section.items() if name in known})


def read_layer_states(point: ResumePoint, config: GPTConfig, dtype: torch.dtype, option: str) -> dict[int, dict]:
    """{flat index: state dict} of every layer DeepSpeed saved, floating-point tensors cast to dtype."""
    states = {}
    for index in module_entries(gpt_layers(config, seed=0)):
        path = layer_file(point.path, index)
        if not path.is_file():
            raise ValueError(f"{option}={str(point.path)!r} is incomplete: {path.name} is missing")
        state = torch.load(path, map_location="cpu", weights_only=True)
        states[index] = {k: v.to(dtype) if v.is_floating_point() else v for k, v in state.items()}
    return states


def consolidate(path: Path, dtype: torch.dtype = torch.float32, option: str = "checkpoint") -> Consolidated:
    """The GPT a complete checkpoint holds (`path`: a tag directory, or a checkpoints/ or run directory, meaning
    its latest checkpoint). Raises ValueError naming `option` for a path that holds none."""
    point = read_checkpoint(path, option=option)
    config = model_config(point, option)
    model = GPT.from_layer_states(config, read_layer_states(point, config, dtype, option))
    return Consolidated(model.eval(), point)
