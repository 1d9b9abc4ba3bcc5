"""Loading DeepSpeed's checkpoint into an engine (DeepSpeed's PipelineEngine or the virtual stages' plain engine).
DeepSpeed is not imported here: the trainer's checkpoint code, which start-up and the dry run load, calls this."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import deepspeed


def load_engine_checkpoint(engine: deepspeed.DeepSpeedEngine, load_dir: str, tag: str) -> dict:
    """Weights, optimizer, LR scheduler and engine counters from `load_dir`/`tag`; returns DeepSpeed's client state.

    DeepSpeed 0.19.8 with bf16 and ZeRO stage 0 (BF16_Optimizer) saves the optimizer in bf16_zero_pp_rank_* files,
    but its load_checkpoint hands BF16_Optimizer the dict of the model-states file, which it indexes by data-parallel
    rank: KeyError 0. So everything but the optimizer is loaded first, then the optimizer (and its fp32 master weights)
    from the files it was saved to, as ZeRO's own load does."""
    bf16_zero0 = engine.bfloat16_enabled() and not engine.zero_optimization()
    load_path, client = engine.load_checkpoint(
        load_dir, tag=tag, load_optimizer_states=not bf16_zero0, load_lr_scheduler_states=True
    )
    if load_path is None:
        raise RuntimeError(f"DeepSpeed could not load the checkpoint {load_dir}/{tag}")
    if bf16_zero0 and not engine._load_zero_checkpoint(load_dir, tag, load_optimizer_states=True):
        raise RuntimeError(f"DeepSpeed found no bf16 optimizer state in {load_dir}/{tag}")
    return client
