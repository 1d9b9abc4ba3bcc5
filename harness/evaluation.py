"""Held-out evaluation inside the step loop: DeepSpeed's `PipelineEngine.eval_batch` across all stages on
fixed, seeded batches of the data's val split, leaving training exactly as it was.

Every rank calls `evaluate_if_due(step)` after each step's `train_batch` (after the step's timing and
activation metering, so neither counts eval forwards). When due (every train.eval_every steps and the last
step) it is a collective over all ranks and returns {"val_loss", "val_ppl"}, the same value on every rank.

Why training stays bit-identical with eval on and off: eval_batch runs in eval mode under no_grad (no dropout
draws, no autograd state, no gradients, no optimizer or scheduler step, no micro-step or global-step count), it
restores the engine's training data iterator itself, and every state `train_batch` reads before writing is
reset by `train_batch` (`total_loss`, `_compute_loss`, the module's mode) or overwritten before it is read (the
pipe buffers: same shapes, so the receive buffers and the activation metadata already exchanged stay valid).
What is left, the RNG streams and the module's mode between the eval and the next step, `kept_training_state`
puts back.
"""

import math
import random
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import torch

from data import TokenSource
from harness.context import RunContext


@contextmanager
def kept_training_state(module: torch.nn.Module, device: str):
    """Every RNG stream (torch CPU and CUDA, numpy, Python) and the module's train/eval mode come back as they
    were: dropout and a source's sampling draw from them, and an eval must not shift their streams."""
    cpu = torch.get_rng_state()
    cuda = torch.cuda.get_rng_state_all() if device == "cuda" else None
    numpy_state = np.random.get_state()
    python_state = random.getstate()
    training = module.training
    try:
        yield
    finally:
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)
        np.random.set_state(numpy_state)
        random.setstate(python_state)
        module.train(training)


class Evaluator:
    """The val loss of the pipeline on train.eval_batches fixed batches."""

    def __init__(self, ctx: RunContext, engine, source: TokenSource | None):
        self.engine = engine
        self.source = source
        """The first and last stages' token source (inputs and labels); None on the stages in between."""
        self.train = ctx.run.train
        self.seed = ctx.run.seed
        self.seq_len = ctx.run.model.seq_len
        self.device = ctx.target.device
        self.dp_rank = engine.grid.get_data_parallel_rank()
        self.dp_size = ctx.topology.data_parallel_size

    def due(self, step: int) -> bool:
        every = self.train.eval_every
        return every > 0 and (step % every == 0 or step == self.train.steps)

    def evaluate_if_due(self, step: int) -> dict:
        """{"val_loss", "val_ppl"} at a due step (a collective: every rank calls it at every step), else {}."""
        if not self.due(step):
            return {}
        with kept_training_state(self.engine.module, self.device):
            # eval_batch averages its micro-batches and the data-parallel ranks, and broadcasts to every stage.
            losses = [
                float(self.engine.eval_batch(self._micro_batches(batch), num_micro_batches=self.train.micro_batches))
                for batch in range(self.train.eval_batches)
            ]
        val_loss = sum(losses) / len(losses)
        return {"val_loss": val_loss, "val_ppl": perplexity(val_loss)}

    def _micro_batches(self, batch: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]] | None:
        """Eval batch `batch` of this data-parallel rank: val indices no other rank or batch uses, a pure function
        of (seed, index), so every evaluation of the run sees the same tokens."""
        if self.source is None:
            return None
        m = self.train.micro_batches
        first = (batch * self.dp_size + self.dp_rank) * m
        return iter(
            [
                self.source.val_batch(self.seed, first + micro, self.train.micro_batch_size, self.seq_len)
                for micro in range(m)
            ]
        )


def perplexity(loss: float) -> float:
    """exp(loss); inf for a diverged run whose loss overflows exp."""
    try:
        return math.exp(loss)
    except OverflowError:
        return math.inf


def val_summary(records: list[dict]) -> dict:
    """summary.json's `val_loss` (the last evaluation) and `val_losses` (every evaluation); {} with eval off."""
    history = [{"step": r["step"], "val_loss": r["val_loss"]} for r in records if "val_loss" in r]
    if not history:
        return {}
    return {"val_loss": history[-1]["val_loss"], "val_losses": history}
