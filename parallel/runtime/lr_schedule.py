"""Linear warm-up to `train.lr`, then cosine decay to `train.min_lr_ratio * train.lr` at the last step.

Optimizer step s (1-based) trains with lr * s / warmup_steps during warm-up, so no step trains with lr 0.
DeepSpeed's WarmupCosineLR gives lr 0 to the first two steps (it starts at iteration -1, where it returns 0,
and its linear ramp starts at 0/warmup): with a short warm-up those steps are wasted.

A resume that changes train.steps re-stretches the decay from the resumed step (`CosineSegment`): the cosine goes
on from where it was at that step to its floor at the new last step, so the learning rate has no jump. A finished
run that is extended therefore trains its new steps at the floor.

The schedule is keyed by applied updates, as the scheduler counts them: a skipped update (fp16 overflow,
train.nan_policy=skip) does not advance it. So is the re-stretch: from the checkpoint's applied updates
(stagecheck.json's `applied_updates`), not its step; keyed by the step, a run with k skipped updates would resume k
updates behind the segment's start, where its cosine runs back up (a shorter train.steps: a higher rate than
before the resume) or ahead (a longer one: a drop).
"""

import math
from dataclasses import dataclass

from torch.optim import Optimizer
from torch.optim.lr_scheduler import LambdaLR

from parallel.planning.config import OptimConfig


@dataclass(frozen=True)
class CosineSegment:
    """The cosine decay from `start_step`, where it stands at `start_progress` (0: the peak, 1: the floor), to the
    floor at `end_step`; steps counted in applied updates (the scheduler's count). A run's first launch:
    (warmup_steps, 0, train.steps)."""

    start_step: int
    start_progress: float
    end_step: int

    @classmethod
    def fresh(cls, warmup_steps: int, total_steps: int) -> "CosineSegment":
        return cls(warmup_steps, 0.0, total_steps)

    def progress(self, step: int) -> float:
        span = max(1, self.end_step - self.start_step)
        return min(1.0, self.start_progress + (1.0 - self.start_progress) * (step - self.start_step) / span)

    def stretched(self, resumed_step: int, warmup_steps: int, total_steps: int) -> "CosineSegment":
        """The decay a resume with train.steps=`total_steps` follows, `resumed_step` being the checkpoint's applied
        updates: this one when the length is unchanged (an exact resume); from the resumed point's progress to the
        new end otherwise."""
        if total_steps == self.end_step:
            return self
        if resumed_step <= warmup_steps:  # the decay has not begun: it simply spans the new length
            return CosineSegment.fresh(warmup_steps, total_steps)
        return CosineSegment(resumed_step, self.progress(resumed_step), total_steps)


def lr_factor(
    step: int, warmup_steps: int, total_steps: int, min_ratio: float, segment: CosineSegment | None = None
) -> float:
    """Fraction of the peak learning rate that optimizer step `step` (1-based) trains with; `segment`: the decay
    after a re-stretching resume (None: the whole run's)."""
    if step <= warmup_steps:
        return step / warmup_steps
    progress = (segment or CosineSegment.fresh(warmup_steps, total_steps)).progress(step)
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def warmup_cosine(optimizer: Optimizer, train: OptimConfig, segment: CosineSegment | None = None) -> LambdaLR:
    """The scheduler DeepSpeed steps after every applied update (not after a skipped one); LambdaLR passes
    the number of updates applied so far, so the next step is one more."""
    return LambdaLR(
        optimizer,
        lambda applied: lr_factor(applied + 1, train.warmup_steps, train.steps, train.min_lr_ratio, segment),
    )


def apply_current_lr(scheduler: LambdaLR) -> None:
    """After a checkpoint's scheduler state is loaded: the optimizer's learning rate is the one the checkpoint's
    schedule gave its next step; set the one this launch's schedule gives it (they differ after a re-stretch)."""
    lrs = [base * fn(scheduler.last_epoch) for base, fn in zip(scheduler.base_lrs, scheduler.lr_lambdas)]
    for group, lr in zip(scheduler.optimizer.param_groups, lrs):
        group["lr"] = lr
    scheduler._last_lr = lrs
