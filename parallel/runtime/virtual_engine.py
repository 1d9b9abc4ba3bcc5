"""A rank of a virtual-stage schedule (parallel/planning/virtual_schedules.py: interleaved 1F1B, ZB-V, V-Half) on
DeepSpeed, one process per pipeline rank.

DeepSpeed's PipelineEngine cannot run these programmes (docs/virtual_stages.md): its PipelineModule holds one
contiguous layer range per rank, its p2p talks to the neighbouring stages only, and it keeps one gradient and one
loss. So here the rank's chunks are modules of their own (parallel/runtime/planned_layers.py), its programme runs
through one interpreter per chunk (parallel/runtime/virtual_rank.py, chunk_work.py) over torch.distributed p2p posted
boundary by boundary (parallel/runtime/boundary_links.py), and DeepSpeed's engine owns the rest: the chunks go into a
plain DeepSpeedEngine with DeepSpeed's own PipelineParallelGrid as its mpu, so its data-parallel groups, optimizer,
LR schedule, gradient clipping (over the pipeline's ranks: the grid's model-parallel group) and checkpoints are
DeepSpeed's, ZeRO-1 included. The gradients accumulate in the chunks' parameters; as in DeepSpeed's PipelineEngine,
no backward reduces them (`enable_backward_allreduce` off), and the engine is at a gradient-accumulation boundary only
while the programme's ReduceGrads and OptimizerStep run its `allreduce_gradients` and `step` (the programme counts the
micro-batches, not the engine).

The tied embedding's copies: parallel/runtime/tied_copies.py; the chunks as one module, with PipelineModule's
checkpoint files: parallel/runtime/rank_chunks.py; the forward-only pass: parallel/runtime/virtual_eval.py.
"""

from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from functools import partial

import deepspeed
import torch
import torch.distributed as dist
from deepspeed.runtime.bf16_optimizer import BF16_Optimizer
from deepspeed.runtime.constants import BFLOAT16, DDP_BFLOAT16
from deepspeed.runtime.pipe.topology import PipeDataParallelTopology, PipelineParallelGrid

from model.fused_loss import HeadLoss
from parallel.planning.config import OptimConfig, ParallelConfig, RecomputeConfig
from parallel.planning.layout import PipelineLayout
from parallel.planning.shapes import TORCH_DTYPES
from parallel.planning.stage_plan import early_stages
from parallel.planning.virtual_program import Placement, Slots, VirtualProgram, placement_of
from parallel.planning.virtual_schedules import virtual_schedule
from parallel.planning.virtual_support import virtual_refusal
from parallel.runtime.boundary_links import BoundaryBatch
from parallel.runtime.chunk_work import ChunkStageWork, ForwardScope, unobserved
from parallel.runtime.dropout_keys import DropoutKeys
from parallel.runtime.ds_config import deepspeed_config
from parallel.runtime.engine import (
    DEEPSPEED_OPTIMIZER_LINES,
    DEEPSPEED_START_UP_LINES,
    InitialWeights,
    counted_on_every_stage,
    dropping_lines,
    param_groups,
)
from parallel.runtime.engine_backward import engine_backward
from parallel.runtime.lr_schedule import CosineSegment, warmup_cosine
from parallel.runtime.planned_layers import PlannedLayers
from parallel.runtime.rank_chunks import RankChunks, checkpoint_by_layer
from parallel.runtime.stage_interpreter import StageInterpreter
from parallel.runtime.tied_copies import TiedCopies
from parallel.runtime.virtual_eval import forward_losses
from parallel.runtime.virtual_rank import ProgrammeObserver, backward_kind, run_training_step

DEEPSPEED_SURFACE = frozenset(
    {
        "optimizer",
        "lr_scheduler",
        "global_steps",
        "get_lr",
        "get_global_grad_norm",
        "was_step_applied",
        "save_checkpoint",
        "load_checkpoint",
        "_load_zero_checkpoint",
        "bfloat16_enabled",
        "zero_optimization",
        "device",
    }
)
"""What the trainer reads of DeepSpeed's PipelineEngine that is the plain DeepSpeedEngine's here: the optimizer, LR
schedule, counters and checkpoints (harness/run_control.py, checkpoint.py, faults.py)."""


class VirtualPipelineEngine:
    """This rank's chunks under `schedule`, on DeepSpeed's `engine`; `train_batch` runs one training step of
    `micro_batches` and `eval_batch` one forward-only pass. The trainer drives it as it drives DeepSpeed's
    PipelineEngine (harness/trainer.py): what it reads of that engine is here, or DeepSpeed's (DEEPSPEED_SURFACE)."""

    def __init__(
        self,
        engine: deepspeed.DeepSpeedEngine,
        grid: PipelineParallelGrid,
        schedule: str,
        placement: Placement,
        stages: Sequence[int],
        hidden: tuple[int, int, int],
        dtype: torch.dtype,
        tied: TiedCopies,
        seed: int,
        micro_batches: int,
        slots: Slots,
        early: frozenset[int],
    ):
        self.engine, self.grid, self.schedule, self.placement = engine, grid, schedule, placement
        self.slots = slots
        """The slots the programmes are laid out in (the layout's: parallel/planning/virtual_slots.py)."""
        self.early = early
        """The virtual stages that recompute early (their plans')."""
        self.schedule_kind = schedule  # as the zero-bubble engine names the schedule it runs (checkpoint metadata)
        self.stages, self.hidden, self.dtype, self.tied = list(stages), hidden, dtype, tied
        self.micro_batches = micro_batches
        self.stage_id = grid.get_stage_id()
        """This rank's place in the pipeline (its chunks' virtual stages: `stages`)."""
        self.num_stages = placement.ranks
        self.rank = self.stage_id
        self.dropout = DropoutKeys(seed, grid.get_data_parallel_rank())
        self._programs: dict[int, VirtualProgram] = {}
        self._observer: ProgrammeObserver | None = None
        self.forward_scope: ForwardScope = unobserved
        """Around each chunk's forward and the loss: harness/virtual_accounting.py's activation meters."""

    def __getattr__(self, name: str):
        if name in DEEPSPEED_SURFACE:
            return getattr(self.engine, name)
        raise AttributeError(f"{type(self).__name__} has no attribute {name!r}")

    @property
    def module(self) -> RankChunks:
        return self.engine.module

    @property
    def chunks(self) -> list[PlannedLayers]:
        return list(self.engine.module)

    def is_first_stage(self) -> bool:
        """Holds virtual stage 0: reads the token ids."""
        return 0 in self.stages

    def is_last_stage(self) -> bool:
        """Holds the last virtual stage: reads the labels and computes the loss (a V's rank 0; interleaved, p - 1)."""
        return self.placement.virtual_stages - 1 in self.stages

    @contextmanager
    def record_programme(self, observer: ProgrammeObserver) -> Iterator[None]:
        """The training steps run inside time their instructions through `observer` (a traced step:
        parallel/measurement/trace.py's StepTracer)."""
        self._observer = observer
        try:
            yield
        finally:
            self._observer = None

    def program(self, micro_batches: int) -> VirtualProgram:
        if micro_batches not in self._programs:
            programs = virtual_schedule(
                self.schedule, micro_batches, self.placement.ranks, self.placement.chunks, self.slots, self.early
            )
            self._programs[micro_batches] = programs[self.rank]
        return self._programs[micro_batches]

    def train_batch(self, data_iter: Iterable[tuple[torch.Tensor, torch.Tensor]] | None = None) -> torch.Tensor:
        """One training step over the (token ids, labels) micro-batches, each (b, s) (None on a rank that holds
        neither the first nor the last virtual stage): the mean loss, on every rank of the pipeline (as DeepSpeed's
        train_batch returns it)."""
        micro_batches = list(data_iter) if data_iter is not None else None
        count, virtual = self.micro_batches, self.placement.virtual_stages
        program = self.program(count)
        batch = BoundaryBatch(self._holder_rank, dist.get_rank())
        interpreters: list[StageInterpreter | None] = [None] * virtual
        for index, (chunk, stage) in enumerate(zip(self.chunks, self.stages)):
            last_chunk = index == len(self.stages) - 1
            work = ChunkStageWork(
                chunk,
                stage,
                virtual,
                self.module.loss_fn,
                self.hidden,
                self.dtype,
                count,
                micro_batches.__getitem__ if micro_batches is not None else _no_data,
                self if last_chunk else None,  # the once-per-step work runs once, with the rank's last chunk's
                partial(engine_backward, self.engine),
                self.forward_scope,
            )
            interpreters[stage] = StageInterpreter(
                work,
                batch.link(stage),
                stage,
                virtual,
                count,
                backward_kind(program),
                early=stage in self.early,
                posted_sends=False,
                dropout=self.dropout,
            )
        self.engine.module.train()
        # global_steps: the optimizer steps taken, restored with DeepSpeed's checkpoint (the dropout masks' key)
        run_training_step(program, interpreters, batch, self.engine.global_steps, self._observer)
        last = interpreters[virtual - 1]
        return self._mean_loss(last.work.step_losses if last is not None else None, count)

    def eval_batch(
        self, data_iter: Iterable[tuple[torch.Tensor, torch.Tensor]] | None, num_micro_batches: int
    ) -> torch.Tensor:
        """The mean loss of a forward-only pass over the micro-batches in eval mode (parallel/runtime/virtual_eval.py),
        on every rank of the pipeline, as DeepSpeed's eval_batch returns it; the caller restores the module's mode."""
        self.engine.module.eval()
        losses = forward_losses(
            dict(zip(self.stages, self.chunks)),
            self.placement,
            self.rank,
            self.grid.stage_to_global,
            list(data_iter) if data_iter is not None else None,
            num_micro_batches,
            self.hidden,
            self.dtype,
            self.module.loss_fn,
        )
        return self._mean_loss(losses if self.is_last_stage() else None, num_micro_batches)

    def _holder_rank(self, stage: int) -> int:
        """The global rank of this data-parallel replica's pipeline that holds virtual stage `stage`."""
        return self.grid.stage_to_global(self.placement.holder(stage)[0])

    def _mean_loss(self, losses: list[torch.Tensor] | None, count: int) -> torch.Tensor:
        """The last chunk's `losses` (None on the other ranks) summed in micro-batch order and divided by their count,
        averaged over the data-parallel replicas, as DeepSpeed's PipelineEngine aggregates them, broadcast to the
        pipeline's ranks."""
        loss = torch.zeros((), device=self.engine.device)
        if losses is not None:
            for micro_batch_loss in losses:
                loss += micro_batch_loss
            loss = loss / count
            if self.grid.get_data_parallel_world_size() > 1:
                dist.all_reduce(loss, group=self.grid.get_data_parallel_group())
                loss /= self.grid.get_data_parallel_world_size()
        holder = self._holder_rank(self.placement.virtual_stages - 1)
        dist.broadcast(loss, src=holder, group=self.grid.get_pipe_parallel_group())
        return loss

    # The rank's once-per-step work (parallel/runtime/chunk_work.py's RankStep).

    def reduce_tied_grads(self) -> None:
        if isinstance(self.engine.optimizer, BF16_Optimizer):
            self.tied.reduce(lambda weight: weight._hp_grad)
        else:
            self.tied.reduce()

    def reduce_grads(self) -> None:
        with self._at_boundary():
            self.engine.allreduce_gradients()

    def optimizer_step(self) -> None:
        with self._at_boundary():
            self.engine.step()

    @contextmanager
    def _at_boundary(self) -> Iterator[None]:
        """The engine at a gradient-accumulation boundary, as DeepSpeed's PipelineEngine forces it around its
        ReduceGrads and OptimizerStep only: a backward outside it accumulates (ZeRO's gradient hooks reduce at a
        boundary)."""
        self.engine.set_gradient_accumulation_boundary(True)
        try:
            yield
        finally:
            self.engine.set_gradient_accumulation_boundary(False)


class _PipelinesOptimizerEngine(deepspeed.DeepSpeedEngine):
    """A plain DeepSpeedEngine that wraps its optimizer as DeepSpeed's PipelineEngine does: DeepSpeed chooses by
    `pipeline_parallelism` (a PipelineModule), and in bf16 without ZeRO gives a plain engine DDP's bf16 path (the
    16-bit weights stepped and gradients accumulated in bf16), where a pipeline gets BF16_Optimizer (fp32 master
    weights, each backward's gradients added into its accumulated ones): the chunks must train as 1F1B trains."""

    def _do_optimizer_sanity_check(self, basic_optimizer):
        wrapper = super()._do_optimizer_sanity_check(basic_optimizer)
        return BFLOAT16 if wrapper == DDP_BFLOAT16 else wrapper


@contextmanager
def _pipelines_optimizer_wrapper() -> Iterator[None]:
    """deepspeed.initialize builds the engine class its module names DeepSpeedEngine: the subclass above, inside."""
    deepspeed.DeepSpeedEngine = _PipelinesOptimizerEngine
    try:
        yield
    finally:
        deepspeed.DeepSpeedEngine = _PipelinesOptimizerEngine.__base__


def _no_data(micro_batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    raise RuntimeError(f"micro-batch {micro_batch} loaded on a rank given no data (it holds neither end)")


def build_virtual_engine(
    layout: PipelineLayout,
    schedule: str,
    chunks: int,
    train: OptimConfig,
    parallel: ParallelConfig,
    precision: str,
    device: str,
    recompute: RecomputeConfig,
    initial_weights: InitialWeights | None = None,
    lr_segment: CosineSegment | None = None,
    compile: bool = False,
) -> VirtualPipelineEngine:
    """This rank's engine: `layout`'s stages are the virtual stages, `chunks` of them per pipeline rank, placed by
    `schedule`, planned under `recompute`; the rest of the world is data parallelism. `initial_weights`, `lr_segment`
    and `compile` as parallel/runtime/engine.py's build_engine takes them."""
    if len(layout.stages) % chunks:
        raise ValueError(f"{len(layout.stages)} virtual stages do not split into {chunks} chunks per rank")
    ranks = len(layout.stages) // chunks
    data_parallel = dist.get_world_size() // ranks
    config = layout.recipes[0].args[0]  # the token embedding's GPTConfig
    refusal = virtual_refusal(schedule, recompute, precision, parallel.zero_stage)
    if refusal:
        raise ValueError(refusal)
    with dropping_lines(DEEPSPEED_START_UP_LINES):
        grid = PipelineParallelGrid(topology=PipeDataParallelTopology(num_pp=ranks, num_dp=data_parallel))
    placement = placement_of(schedule, ranks, chunks)
    stages = [placement.virtual_stage(grid.get_stage_id(), chunk) for chunk in range(chunks)]
    module = RankChunks(
        (PlannedLayers(layout.recipes, layout.stages[s], layout.plans[s], precision, compile) for s in stages),
        layout.parts,
        HeadLoss.of(layout.recipes),
        {flat for flat, recipe in enumerate(layout.recipes) if recipe.tie_key is not None},
    )
    tied = TiedCopies(layout, placement, grid, list(module), stages)
    counted_on_every_stage(module)
    weights = initial_weights(module) if initial_weights is not None else {}
    with torch.no_grad():
        for param, value in weights.items():
            param.copy_(value)
    with _pipelines_optimizer_wrapper(), dropping_lines(DEEPSPEED_OPTIMIZER_LINES):
        engine, _, _, _ = deepspeed.initialize(
            model=module,
            model_parameters=param_groups(module, train.weight_decay),
            config=deepspeed_config(
                train, parallel, data_parallel, precision, device, sum(p.numel() for p in module.parameters())
            ),
            lr_scheduler=partial(warmup_cosine, train=train, segment=lr_segment),
            mpu=grid,
        )
    engine.set_gradient_accumulation_boundary(False)  # the programme accumulates the micro-batches itself
    # As DeepSpeed's PipelineEngine: gradients are reduced at ReduceGrads, never by a backward's epilogue.
    engine.enable_backward_allreduce = False
    tied.count_once_in_clipping(engine)
    checkpoint_by_layer(engine, grid)
    hidden = (train.micro_batch_size, config.seq_len, config.n_embd)
    return VirtualPipelineEngine(
        engine,
        grid,
        schedule,
        placement,
        stages,
        hidden,
        TORCH_DTYPES[precision],
        tied,
        layout.seed,
        train.micro_batches,
        layout.virtual_slots,
        early_stages(layout.plans),
    )
