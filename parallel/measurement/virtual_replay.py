"""One rank's training step under a schedule with virtual stages, in this process, to measure its peak tensor memory
(parallel/measurement/tensor_peak.py) without launching ranks, as parallel/measurement/stage_replay.py does for one
stage: the rank's chunks built and planned as the in-process virtual pipeline builds them
(parallel/measurement/virtual_local.py), its programme run through one interpreter per chunk, its neighbours fake
(`FakeNeighbours`: what they send is random tensors of the right shape), on random micro-batches, with no optimizer
(the activations are what is measured: the peak above the step's baseline of parameters and gradients). The rank's
runner and its boundary batch are the engine's (parallel/runtime/virtual_rank.py, boundary_links.py), the fake
neighbours its exchange, so what the engine's messages hold and when, the replay's hold."""

import gc

import torch

from parallel.measurement.in_process import FakeNeighbours
from parallel.measurement.tensor_peak import TensorPeak, TensorPeakMeter
from parallel.measurement.virtual_local import VirtualLocalPipeline, chunk_interpreter
from parallel.planning.layout import PipelineLayout
from parallel.planning.stage_plan import early_stages
from parallel.planning.virtual_schedules import virtual_schedule
from parallel.runtime.boundary_links import BoundaryBatch
from parallel.runtime.virtual_rank import run_training_step


class VirtualRankReplay:
    """Rank `rank` of `layout`'s virtual stages under `schedule` with `chunks` per rank, ready to run training steps
    of `micro_batches` micro-batches of `micro_batch_size` sequences."""

    def __init__(
        self,
        layout: PipelineLayout,
        schedule: str,
        chunks: int,
        rank: int,
        micro_batches: int,
        micro_batch_size: int,
        seed: int = 0,
    ):
        torch.manual_seed(seed)
        pipe = VirtualLocalPipeline(layout, schedule, chunks)
        early = early_stages(layout.plans)
        self.program = virtual_schedule(schedule, micro_batches, pipe.ranks, chunks, layout.virtual_slots, early)[rank]
        config = layout.recipes[0].args[0]  # the token embedding's GPTConfig
        self.tokens, self.vocab = (micro_batch_size, config.seq_len), config.vocab_size
        self.mine = [self.program.placement.virtual_stage(rank, chunk) for chunk in range(chunks)]
        self.pipe = pipe
        self.steps = 0
        """Training steps run: the next one's dropout key."""

    def micro_batches(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """A step's random (token ids, labels), each (b, s)."""
        return [
            (torch.randint(0, self.vocab, self.tokens), torch.randint(0, self.vocab, self.tokens))
            for _ in range(self.program.micro_batches)
        ]

    def step(self, micro_batches: list[tuple[torch.Tensor, torch.Tensor]] | None = None) -> None:
        """One training step: every instruction of the rank's programme, each chunk's work a fresh one, as the engine
        makes them (parallel/runtime/virtual_engine.py)."""
        data = (micro_batches or self.micro_batches()).__getitem__
        interpreters = [None] * len(self.pipe.stages)
        placement = self.program.placement
        batch = BoundaryBatch(lambda stage: placement.holder(stage)[0], self.program.rank, FakeNeighbours().post)
        for i in self.mine:
            interpreters[i] = chunk_interpreter(self.pipe, i, self.program, batch.link(i), data)
        run_training_step(self.program, interpreters, batch, self.steps)
        self.steps += 1

    def measure_peak(self, steps: int = 2) -> TensorPeak:
        """The peak of the last of `steps` steps (the earlier ones allocate the gradients)."""
        for _ in range(steps - 1):
            self.step()
        gc.collect()  # the garbage of earlier objects would otherwise count as alive in the window
        meter = TensorPeakMeter("cpu")
        batches = self.micro_batches()  # before the window, as the trainer loads a step's micro-batches before its step
        with meter.window() as result:
            self.step(batches)
        return result[0]
