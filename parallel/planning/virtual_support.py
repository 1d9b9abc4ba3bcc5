"""What the runtime of the virtual-stage schedules (parallel/runtime/virtual_engine.py) runs so far, and which
resumes may change the schedule, each as one refusal line naming the option to change, or None: pure, so that
start-up can read it before DeepSpeed loads."""

from parallel.planning.config import GivenRecompute, RecomputeConfig
from parallel.planning.virtual_program import V_SHAPED, VIRTUAL_SCHEDULES
from parallel.planning.virtual_schedules import virtual_schedule

CHUNKS = 2
"""Model chunks per rank that train.py runs (the V shapes hold 2; the engine interleaves more)."""


def virtual_refusal(schedule: str, recompute: RecomputeConfig, precision: str, zero_stage: int) -> str | None:
    if isinstance(recompute, GivenRecompute):
        return (
            f"+recompute=plan is not supported with parallel.schedule={schedule} yet (a plan file holds one stage per "
            f"rank): use parallel.schedule=1f1b, zb-h1 or auto"
        )
    if precision == "fp16":
        return f"train.precision=fp16 is not supported with parallel.schedule={schedule} yet: use bf16 or fp32"
    if zero_stage > 1:
        return f"parallel.zero_stage={zero_stage} is not supported with parallel.schedule={schedule} yet: use 0"
    return None


def virtual_run_refusal(
    schedule: str,
    recompute: RecomputeConfig,
    precision: str,
    zero_stage: int,
    micro_batches: int,
    ranks: int,
    blocks: int,
) -> str | None:
    """train.py's refusal of a run under `schedule` (one of VIRTUAL_SCHEDULES) on `ranks` pipeline ranks, or None."""
    refusal = virtual_refusal(schedule, recompute, precision, zero_stage)
    if refusal:
        return refusal
    if blocks < CHUNKS * ranks:
        return (
            f"parallel.schedule={schedule} splits the model into {CHUNKS} chunks per rank, {CHUNKS * ranks} in all: "
            f"model.n_layer={blocks} is fewer blocks; use model.n_layer >= {CHUNKS * ranks} or fewer pipeline stages"
        )
    try:
        virtual_schedule(schedule, micro_batches, ranks, CHUNKS)
    except ValueError as error:
        return f"train.micro_batches={micro_batches} with parallel.schedule={schedule}: {error}"
    return None


def placement_name(schedule: str) -> str:
    """Where a schedule puts the layers: one stage per rank (1f1b, zb-h1; `auto` chooses among them), interleaved
    chunks, or a V."""
    if schedule not in VIRTUAL_SCHEDULES:
        return "one stage per rank"
    return "a V (rank r: chunks r and 2p - 1 - r)" if schedule in V_SHAPED else "interleaved (rank r: r, r + p)"


def schedule_change_refusal(saved: str, new: str) -> str | None:
    """A resume that changes parallel.schedule from `saved` (the schedule the checkpoint ran) to `new`: allowed when
    the layers stay on their ranks (DeepSpeed saved each rank's weights and optimizer state as that rank held them),
    else one line. `auto` keeps the checkpoint's placement (harness/run_layout.py)."""
    if new == "auto" or placement_name(saved) == placement_name(new):
        return None
    return (
        f"parallel.schedule={new} cannot resume a checkpoint trained under parallel.schedule={saved}: it places the "
        f"layers {placement_name(new)}, the checkpoint's ranks hold them {placement_name(saved)} (DeepSpeed saved "
        f"each rank's weights and optimizer state); resume with parallel.schedule="
        + " or ".join(s for s in ("1f1b", "zb-h1", *VIRTUAL_SCHEDULES) if placement_name(s) == placement_name(saved))
    )
