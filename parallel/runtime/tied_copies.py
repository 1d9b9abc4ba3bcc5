"""The tied weights of a rank of a virtual-stage schedule (parallel/runtime/virtual_engine.py): the token embedding's
copy (virtual stage 0) and the LM head's (the last) get the sum of both gradients, as DeepSpeed's ReduceTiedGrads sums
them over the stages that hold them: a V's rank 0 holds both (a local sum), interleaved ranks 0 and p - 1 all-reduce
over a group of the two. The LM head's copy is marked `ds_pipe_replicated`, as PipelineModule marks a tied weight's
later copies, and the rank's clipping counts the weight once."""

from collections.abc import Callable, Sequence

import deepspeed
import torch
import torch.distributed as dist
import torch.nn as nn
from deepspeed.runtime.pipe.topology import PipelineParallelGrid
from deepspeed.runtime.utils import clip_grad_norm_

from model import head_module
from parallel.planning.layout import PipelineLayout
from parallel.planning.virtual_program import Placement
from parallel.runtime.planned_layers import PlannedLayers


class TiedCopies:
    """The copies of each tied weight this rank holds (in virtual-stage order) and the group it sums them over with
    the other ranks that hold one (None: this rank holds them all). Every rank builds every group, as
    `dist.new_group` asks."""

    def __init__(
        self,
        layout: PipelineLayout,
        placement: Placement,
        grid: PipelineParallelGrid,
        chunks: Sequence[PlannedLayers],
        stages: Sequence[int],
    ):
        self.copies: dict[str, list[nn.Parameter]] = {}
        self.groups: dict[str, dist.ProcessGroup | None] = {}
        keys = sorted({r.tie_key for r in layout.recipes if r.tie_key is not None})
        for key in keys:
            holders = [s.stage for s in layout.stages if any(layout.recipes[f].tie_key == key for f in s.layers)]
            ranks = sorted({placement.holder(stage)[0] for stage in holders})
            self.groups[key] = None
            for data in range(grid.get_data_parallel_world_size()) if len(ranks) > 1 else ():
                members = [grid.topology().get_rank(pipe=rank, data=data) for rank in ranks]
                group = dist.new_group(ranks=members)
                if dist.get_rank() in members:
                    self.groups[key] = group
            self.copies[key] = []
            for chunk, stage in sorted(zip(chunks, stages), key=lambda pair: pair[1]):
                if stage in holders:
                    weight = _tied_weight(layout, chunk, key)
                    weight.ds_pipe_replicated = stage != holders[0]
                    self.copies[key].append(weight)

    def count_once_in_clipping(self, engine: deepspeed.DeepSpeedEngine) -> None:
        """An fp32 run without ZeRO clips with DeepSpeed's `clip_grad_norm_`, which counts every parameter on the
        model-parallel group's rank 0 (ZeRO's norm leaves `ds_pipe_replicated` copies out itself): a V's rank 0 holds
        both copies of the tied weight, so that norm counted it twice where 1F1B counts it once. Its clipping then
        leaves the later copies out of the norm and gives them the first copy's clipped gradient (both held the same
        sum: the same result as clipping them)."""
        pairs = [(copies[0], later) for copies in self.copies.values() for later in copies[1:]]
        if not pairs or engine.zero_optimization() or engine.fp16_enabled() or engine.bfloat16_enabled():
            return
        later_copies = {id(later) for _, later in pairs}

        def clip_fp32_gradients() -> None:
            counted = [p for p in engine.module.parameters() if id(p) not in later_copies]
            clip_grad_norm_(parameters=counted, max_norm=engine.gradient_clipping(), mpu=engine.mpu)
            for first, later in pairs:
                later.grad.copy_(first.grad)

        engine.clip_fp32_gradients = clip_fp32_gradients

    def reduce(self, gradient: Callable[[nn.Parameter], torch.Tensor] = lambda weight: weight.grad) -> None:
        """Every copy's `gradient` (the one its optimizer steps with: BF16_Optimizer's accumulated one, `_hp_grad`, as
        DeepSpeed's ReduceTiedGrads reduces it) becomes the sum of all copies'."""
        for key, copies in self.copies.items():
            if not copies:
                continue
            grads = [gradient(copy) for copy in copies]
            total = grads[0]
            for grad in grads[1:]:
                total = total + grad
            if self.groups[key] is not None:
                dist.all_reduce(total, group=self.groups[key])
            for grad in grads:
                if grad is not total:
                    grad.copy_(total)


def _tied_weight(layout: PipelineLayout, chunk: PlannedLayers, key: str) -> nn.Parameter:
    """The chunk's copy of the tied weight `key` (a chunk with both ends builds the module once)."""
    (module,) = {
        head_module(fn) for flat, fn in zip(chunk.stage.layers, chunk.funcs) if layout.recipes[flat].tie_key == key
    }
    return module.head_weight
