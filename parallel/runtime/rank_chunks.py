"""The model chunks one rank of a virtual-stage schedule holds (parallel/runtime/virtual_engine.py), as the one module
DeepSpeed's engine optimizes and checkpoints: what the trainer reads of DeepSpeed's PipelineModule on a 1F1B stage
(`parts`, `local_layers`, `tied_weight_digest`, `loss_fn`) for the rank's chunks, and its checkpoint layout: one
`layer_NN-model_states.pt` per layer that runs as a module (NN its flat index; a tied LM head has none, the embedding's
file holds the one tied weight), so generate.py and export_hf.py (harness/consolidate.py) read a checkpoint of any
schedule alike."""

import hashlib
import os
from collections.abc import Iterable
from pathlib import Path

import torch
import torch.nn as nn
from deepspeed import DeepSpeedEngine
from deepspeed.runtime.pipe.topology import PipelineParallelGrid

from model import head_module
from model.fused_loss import HeadLoss
from parallel.runtime.planned_layers import PlannedLayers


class RankChunks(nn.ModuleList):
    """This rank's chunks in chunk order; `parts`: every virtual stage's first layer, then one past the last (the whole
    pipeline's, as PipelineModule.parts); `tied_layers`: the flat indices of the tied layers (embedding, LM head)."""

    def __init__(self, chunks: Iterable[PlannedLayers], parts: list[int], loss_fn: HeadLoss, tied_layers: set[int]):
        super().__init__(chunks)
        self.parts = parts
        self.loss_fn = loss_fn
        """The last chunk's loss (output, labels, head weight); read at each step, so a wrapper (the activation
        meter's, train.inject_nan_at_steps') reaches it as it reaches PipelineModule.loss_fn."""
        self.tied_layers = tied_layers

    def local_layers(self) -> list[tuple[int, nn.Module]]:
        """(flat index, module) of each layer of the rank's chunks, as PipelineModule.local_layers (model.init_from
        reads them)."""
        return [(flat, head_module(fn)) for chunk in self for flat, fn in zip(chunk.stage.layers, chunk.funcs)]

    def save_layer_files(self, directory: str, checkpoint_engine, data_parallel_rank: int) -> None:
        """Each layer's state dict into `directory`, as PipelineModule.save_state_dict writes it (data-parallel rank 0
        writes, its replicas hold the same weights)."""
        if data_parallel_rank != 0:
            return
        checkpoint_engine.makedirs(directory, exist_ok=True)
        for chunk in self:
            for flat, fn in zip(chunk.stage.layers, chunk.funcs):
                if isinstance(fn, nn.Module):  # a tied LM head runs as a function of its embedding: no file
                    checkpoint_engine.save(state_dict=fn.state_dict(), path=str(layer_file(directory, flat)))

    def load_layer_files(self, directory: str, checkpoint_engine) -> None:
        """Every layer's weights from `directory`; a tied LM head's copy from the first tied layer's file."""
        for chunk in self:
            for flat, fn in zip(chunk.stage.layers, chunk.funcs):
                source = flat if isinstance(fn, nn.Module) else min(self.tied_layers)
                state = checkpoint_engine.load(str(layer_file(directory, source)), map_location="cpu")
                head_module(fn).load_state_dict(state)

    def tied_weight_digest(self) -> str | None:
        """SHA-256 of the tied embedding/LM-head weight this rank holds (a V's rank 0 holds both copies, equal after
        each step: the first), as PipelineModule's; None where it holds none."""
        for chunk in self:
            for flat, fn in zip(chunk.stage.layers, chunk.funcs):
                if flat in self.tied_layers:
                    weight = head_module(fn).head_weight.detach().cpu().contiguous()
                    return hashlib.sha256(weight.view(-1).view(torch.uint8).numpy().tobytes()).hexdigest()
        return None


def layer_file(directory: str, flat_index: int) -> Path:
    """PipelineModule.ckpt_layer_path's name for layer `flat_index` (harness/consolidate.py reads it)."""
    return Path(directory) / f"layer_{flat_index:02d}-model_states.pt"


def checkpoint_by_layer(engine: DeepSpeedEngine, grid: PipelineParallelGrid) -> None:
    """DeepSpeed's engine saves the module's state dict into each rank's model-states file; DeepSpeed's PipelineEngine
    instead has its module write one file per layer (and loads them back), which harness/consolidate.py reads. The
    rank's chunks do the same here, as PipelineEngine overrides these two methods."""
    module: RankChunks = engine.module

    def module_state_dict(exclude_frozen_parameters: bool = False) -> None:
        module.save_layer_files(engine._curr_ckpt_path, engine.checkpoint_engine, grid.get_data_parallel_rank())
        return None

    def load_module_state_dict(checkpoint: dict, strict: bool = True, **_) -> None:
        module.load_layer_files(engine._curr_ckpt_path, engine.checkpoint_engine)

    # DeepSpeed sets the path a load reads for a PipelineModule only: here, around every load.
    load_checkpoint = engine._load_checkpoint

    def load_checkpoint_at(load_dir: str, tag: str, *args, **kwargs):
        engine._curr_ckpt_path = os.path.join(load_dir, str(tag))
        try:
            return load_checkpoint(load_dir, tag, *args, **kwargs)
        finally:
            engine._curr_ckpt_path = None

    engine.module_state_dict = module_state_dict
    engine.load_module_state_dict = load_module_state_dict
    engine._load_checkpoint = load_checkpoint_at
