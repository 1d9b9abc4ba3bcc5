"""Linear warm-up to `train.lr`, then cosine decay to `train.min_lr_ratio * train.lr` at the last step.

Optimizer step s (1-based) trains with lr * s / warmup_steps during warm-up, so no step trains with lr 0.
DeepSpeed's WarmupCosineLR gives lr 0 to the first two steps (it starts at iteration -1, where it returns 0,
and its linear ramp starts at 0/warmup): with a short warm-up those steps are wasted.
"""

import math

from torch.optim import Optimizer
from torch.optim.lr_scheduler import LambdaLR

from parallel.planning.config import OptimConfig


def lr_factor(step: int, warmup_steps: int, total_steps: int, min_ratio: float) -> float:
    """Fraction of the peak learning rate that optimizer step `step` (1-based) trains with."""
    if step <= warmup_steps:
        return step / warmup_steps
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def warmup_cosine(optimizer: Optimizer, train: OptimConfig) -> LambdaLR:
    """The scheduler DeepSpeed steps after every applied update (not after a skipped one); LambdaLR passes
    the number of updates applied so far, so the next step is one more."""
    return LambdaLR(
        optimizer, lambda applied: lr_factor(applied + 1, train.warmup_steps, train.steps, train.min_lr_ratio)
    )
