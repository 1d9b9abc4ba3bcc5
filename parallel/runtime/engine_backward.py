"""A backward run outside `DeepSpeedEngine.backward` (a pipeline stage's output backward, a deferred weight
gradient, a chunk's backward), wrapped as DeepSpeed's PipelineEngine wraps a non-last stage's backward, so that the
engine's optimizer accumulates it as it accumulates any other."""

from collections.abc import Iterator
from contextlib import contextmanager

import deepspeed
from deepspeed.runtime.bf16_optimizer import BF16_Optimizer


@contextmanager
def engine_backward(engine: deepspeed.DeepSpeedEngine) -> Iterator[None]:
    """The backward run inside, under `engine`'s bookkeeping: with DeepSpeed's bf16 optimizer the 16-bit gradients
    hold only this backward's (cleared before it) and are added into its accumulated gradients after it, once; and the
    post-backward hook of a ZeRO-style optimizer (BF16_Optimizer is one) does not run its epilogue for this graph."""
    bf16 = isinstance(engine.optimizer, BF16_Optimizer)
    if bf16:
        engine.optimizer.clear_lp_grads()
    engine._running_engine_backward = True
    try:
        yield
    finally:
        engine._running_engine_backward = False
    if bf16 and not engine._config.bfloat16_config.immediate_grad_update:
        engine.optimizer.update_hp_grads(clear_lp_grads=False)
