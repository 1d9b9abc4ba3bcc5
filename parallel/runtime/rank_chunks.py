"""The model chunks one rank of a virtual-stage schedule holds (parallel/runtime/virtual_engine.py), as the one module
DeepSpeed's engine optimizes and checkpoints: what the trainer reads of DeepSpeed's PipelineModule on a 1F1B stage
(`parts`, `local_layers`, `tied_weight_digest`, `loss_fn`) for the rank's chunks."""

import hashlib
from collections.abc import Iterable

import torch
import torch.nn as nn

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

    def tied_weight_digest(self) -> str | None:
        """SHA-256 of the tied embedding/LM-head weight this rank holds (a V's rank 0 holds both copies, equal after
        each step: the first), as PipelineModule's; None where it holds none."""
        for chunk in self:
            for flat, fn in zip(chunk.stage.layers, chunk.funcs):
                if flat in self.tied_layers:
                    weight = head_module(fn).head_weight.detach().cpu().contiguous()
                    return hashlib.sha256(weight.view(-1).view(torch.uint8).numpy().tobytes()).hexdigest()
        return None
