"""What the runtime of the virtual-stage schedules (parallel/runtime/virtual_engine.py) runs so far, and which
resumes may change the schedule, each as one refusal line naming the option to change, or None: pure, so that
start-up can read it before DeepSpeed loads."""

from parallel.planning.config import GivenRecompute, RecomputeConfig
from parallel.planning.virtual_program import V_CHUNKS, V_SHAPED, VIRTUAL_SCHEDULES
from parallel.planning.virtual_schedules import virtual_schedule

MOST_CHUNKS = 4
"""The most chunks per rank the planner tries for interleaved-1f1b when parallel.chunks is null: each count is one
more search of the chunk boundaries at start-up (parallel.chunks names more)."""


def chunk_choices(schedule: str, chunks: int | None, blocks: int, ranks: int) -> tuple[int, ...]:
    """The chunks per rank `schedule` may run with (parallel.chunks, else: a V's 2; interleaved-1f1b's 2 to
    MOST_CHUNKS, each chunk at least one of the `blocks`), fewest first; (2,) where the blocks allow no more; none
    for a V and parallel.chunks other than 2."""
    if schedule in V_SHAPED:
        return (V_CHUNKS,) if chunks in (None, V_CHUNKS) else ()
    if chunks is not None:
        return (chunks,)
    return tuple(range(V_CHUNKS, max(V_CHUNKS, min(MOST_CHUNKS, blocks // ranks)) + 1))


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
    chunks: int | None = None,
) -> str | None:
    """train.py's refusal of a run under `schedule` (one of VIRTUAL_SCHEDULES) on `ranks` pipeline ranks with
    `chunks` per rank (parallel.chunks), or None."""
    refusal = virtual_refusal(schedule, recompute, precision, zero_stage)
    if refusal:
        return refusal
    choices = chunk_choices(schedule, chunks, blocks, ranks)
    if not choices:
        return f"parallel.chunks={chunks} with parallel.schedule={schedule}: a V holds {V_CHUNKS} chunks per rank"
    fewest = choices[0]
    if blocks < fewest * ranks:
        instead = "parallel.chunks=null" if chunks is not None else "fewer pipeline stages"
        return (
            f"parallel.schedule={schedule} splits the model into {fewest} chunks per rank, {fewest * ranks} in all: "
            f"model.n_layer={blocks} is fewer blocks; use model.n_layer >= {fewest * ranks} or {instead}"
        )
    try:
        virtual_schedule(schedule, micro_batches, ranks, fewest)
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
