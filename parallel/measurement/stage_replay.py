"""One pipeline stage's training step in this process, with DeepSpeed's buffers as its engine keeps them, to measure
the stage's peak tensor memory (parallel/measurement/tensor_peak.py) without launching ranks.

The stage is built and planned as the local pipeline builds it, and its own schedule (parallel/planning/schedules.py's
programme) runs through the interpreter the engine runs (parallel/runtime/stage_interpreter.py): the same B, W, early
recompute and posted sends, each posted tensor held as long. Its work keeps what DeepSpeed 0.19.8's PipelineEngine
keeps in its buffers (parallel/measurement/in_process.py's LocalStageWork) on random micro-batches, its neighbours are
in-process (`FakeNeighbours`: what they send is random tensors of the right shape), and its optimizer is torch's
AdamW, which keeps two fp32 moments per parameter as DeepSpeed's fp32 optimizer does (fp32 only: DeepSpeed's bf16
optimizer keeps other states), after clipping as DeepSpeed clips where the run does (RunShape.grad_clip).

Checked against the real engine (2 CPU ranks, `bench/peak_memory_bench.py`'s first shape: none, selective,
full(1), full(stage)): each stage's peak within 0.02 MiB of the real run's ~12-23 MiB.
"""

import gc
import time
from contextlib import contextmanager

import torch

from model.fused_loss import HeadLoss
from parallel.measurement.in_process import FakeNeighbours, LocalStage, LocalStageWork
from parallel.measurement.tensor_peak import TensorPeak, TensorPeakMeter, storages_now
from parallel.planning.layout import PipelineLayout
from parallel.planning.schedules import posts_sends, train_schedule
from parallel.planning.shapes import RunShape
from parallel.runtime.dropout_keys import DropoutKeys
from parallel.runtime.stage_interpreter import StageInterpreter


class StageReplay:
    """Stage `index` of `layout`, ready to run training steps of `run`'s micro-batches."""

    def __init__(self, layout: PipelineLayout, index: int, run: RunShape, seed: int = 0, compile: bool = False):
        """`compile`: each block compiled (train.compile), as on a rank."""
        if run.target.precision != "fp32":
            raise ValueError(f"a stage replay keeps fp32 optimizer states only, not {run.target.precision}")
        # What the process held before this stage existed (an earlier test's or a cache's tensors): not the stage's.
        self.foreign = storages_now()
        stages = run.topology.pipeline_stages
        plan = layout.plans[index]
        self.early = plan.early and index < stages - 1
        self.split = layout.schedule == "zb-h1"
        self.plan = plan
        torch.manual_seed(seed)
        stage = LocalStage(layout.recipes, layout.stages[index], plan, compile=compile)
        self.program = train_schedule(
            layout.schedule, self.early, run.micro_batches, stages, index, plan.deferred_weights
        )
        config = layout.recipes[0].args[0]  # the token embedding's GPTConfig
        tokens = (run.micro_batch_size, config.seq_len)

        def random_micro_batch(_: int) -> tuple[torch.Tensor, torch.Tensor]:
            return torch.randint(0, config.vocab_size, tokens), torch.randint(0, config.vocab_size, tokens)

        self.work = LocalStageWork(
            stage,
            index,
            stages,
            HeadLoss.of(layout.recipes),
            (*tokens, config.n_embd),
            torch.float32,
            self.program.pipe_buffers,
            random_micro_batch,
            torch.optim.AdamW(stage.parameters(), lr=1e-4),
            run.grad_clip,
        )
        self.interpreter = StageInterpreter(
            work=self.work,
            transport=FakeNeighbours(),
            stage_id=index,
            stages=stages,
            micro_batches=run.micro_batches,
            schedule=layout.schedule,
            early=self.early,
            posted_sends=posts_sends(layout.schedule, [p.early for p in layout.plans]),
            dropout=DropoutKeys(layout.seed),
        )
        self.steps = 0
        """Training steps run: the next one's dropout key."""

    def step(self) -> None:
        """One training step: every instruction of the stage's programme."""
        self.work.start_step()
        self.interpreter.run(self.program, self.steps)
        self.steps += 1

    def timed_step(self) -> list[tuple[str, float]]:
        """One training step with each instruction timed on the host's clock (the replay runs on CPU, where an
        instruction's work is done when its call returns): (its class name, seconds), in programme order."""
        spans = []

        @contextmanager
        def timed(command):
            start = time.perf_counter()
            yield
            spans.append((type(command).__name__, time.perf_counter() - start))

        self.work.start_step()
        self.interpreter.run(self.program, self.steps, timed)
        self.steps += 1
        return spans

    def measure_peak(self, steps: int = 2) -> TensorPeak:
        """The peak of the last of `steps` steps (the earlier ones allocate the gradients and optimizer states)."""
        for _ in range(steps - 1):
            self.step()
        gc.collect()  # the garbage of earlier objects would otherwise count as alive in the window
        meter = TensorPeakMeter("cpu", self.foreign)
        with meter.window() as result:
            self.step()
        return result[0]
