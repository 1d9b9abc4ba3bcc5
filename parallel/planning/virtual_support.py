"""What the multi-rank runtime of the virtual-stage schedules (parallel/runtime/virtual_engine.py) runs so far, as
one refusal line naming the option to change, or None: pure, so that start-up can read it before DeepSpeed loads."""

from parallel.planning.config import AutoRecompute, RecomputeConfig


def virtual_refusal(schedule: str, recompute: RecomputeConfig, precision: str, zero_stage: int) -> str | None:
    if isinstance(recompute, AutoRecompute) or recompute.early:
        return (
            f"parallel.schedule={schedule} runs +recompute=none, full or selective without recompute.early so far "
            f"(auto per chunk and early recompute are not wired yet)"
        )
    if precision != "fp32":
        return f"train.precision={precision} is not supported with parallel.schedule={schedule} yet: use fp32"
    if zero_stage > 1:
        return f"parallel.zero_stage={zero_stage} is not supported with parallel.schedule={schedule} yet: use 0"
    return None
