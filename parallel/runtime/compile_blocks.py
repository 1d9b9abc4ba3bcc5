"""train.compile: each transformer block compiled on its own, as torchtitan's `apply_compile` does (one
`torch.compile(block, fullgraph=True)` per block, after activation checkpointing was applied to it).

A block is compiled after its stage plan was installed (parallel/runtime/recompute.py's `apply_plan`), so a selective
checkpoint inside it (`core_attn`, `mlp`, and `mlp_act` as a checkpoint of the activation with the Linear reading it)
is traced into the block's graph as torch's checkpoint operator, and AOTAutograd's partitioner recomputes what the
compiled backward reads of that region. A full segment checkpoints whole
blocks from outside: its recompute calls the compiled blocks again, with the RNG state restored, so the dropout masks
of inductor's own generator are drawn again identically. `fullgraph=True` makes a graph break an error at the first
step rather than a silent fall back to eager; `dynamic=False`: the micro-batch shape never changes within a run.

What cannot be compiled is refused at start-up (`compile_refusal`), never dropped silently; +recompute=auto chooses
only among what compiles (`compiled_auto`).
"""

from dataclasses import replace

from model import BLOCK_CLASSES
from parallel.planning.config import AutoRecompute, GivenRecompute, SelectiveRecompute
from parallel.planning.virtual_program import SPLIT_BACKWARD


def compile_refusal(schedule: str, recompute) -> str | None:
    """Why train.compile=true cannot run under `schedule` (parallel.schedule) and `recompute` (the recompute group's
    config), as one line naming the option to change; None when it can."""
    if schedule in SPLIT_BACKWARD:
        return (
            f"train.compile=true needs parallel.schedule=1f1b, not {schedule}: its split backward defers each "
            f"Linear's weight gradient from Python inside backward, which a compiled backward graph cannot do "
            f"(PyTorch refuses compiled zero-bubble stages too); use parallel.schedule=1f1b or train.compile=false"
        )
    if schedule != "1f1b":  # interleaved 1F1B: its chunks' compiled blocks are not yet measured (exactness, bytes)
        return (
            f"train.compile=true needs parallel.schedule=1f1b, not {schedule}: compiled blocks are not yet checked "
            f"under the schedules with virtual stages; use parallel.schedule=1f1b or train.compile=false"
        )
    if getattr(recompute, "early", False):
        return (
            "train.compile=true cannot run recompute.early=true: an early recompute is a Python autograd Function "
            "holding its segment, which dynamo cannot trace; set recompute.early=false (+recompute=auto: or null, "
            "which under compile never recomputes early) or train.compile=false"
        )
    if getattr(recompute, "nested", False) or getattr(recompute, "compress", "none") != "none":
        # Neither has been run with compiled blocks: their exactness and their bytes under compile are unmeasured.
        return (
            "train.compile=true cannot run recompute.nested=true or recompute.compress: nested segments and compressed "
            "stashes are not yet checked against compiled blocks; set recompute.nested=false and "
            "recompute.compress=none, or train.compile=false"
        )
    if isinstance(recompute, GivenRecompute):
        # A plan file may hold any per-block choice, layernorm, nesting and stashes included: see the ones below.
        return (
            "train.compile=true cannot run +recompute=plan: a plan file may hold choices that compiled blocks cannot "
            "run; use +recompute=auto with train.compile=true (it plans only what compiles), or train.compile=false"
        )
    if isinstance(recompute, SelectiveRecompute) and "layernorm" in recompute.modules:
        # `mlp_act` compiles as a checkpoint of the activation and its one consumer Linear, whose output backward never
        # reads (parallel/runtime/recompute.py's _discard_output); a norm's consumer is a whole attention or MLP.
        return (
            f"train.compile=true cannot run recompute.modules={list(recompute.modules)}: layernorm discards the norm "
            f"output that a whole attention or MLP reads, which a compiled block could only remake by recomputing "
            f"their matmuls too; compiled selective recompute allows core_attn, mlp_act and mlp, or set "
            f"train.compile=false"
        )
    return None


def compile_blocks(funcs: list) -> None:
    """Compile each block among a stage's layer functions in place (nn.Module.compile keeps the module and its
    parameter names, so checkpoints are those of an eager run)."""
    for block in funcs:
        if isinstance(block, BLOCK_CLASSES):
            block.compile(fullgraph=True, dynamic=False)


def compiled_auto(recompute: AutoRecompute) -> AutoRecompute:
    """+recompute=auto under train.compile: recompute.early=null resolves to false (an early recompute cannot compile:
    compile_refusal). Auto's other choices are held to what compiles by its prices (parallel/planning/block_prices.py:
    only the selective options a compiled block was measured with, and no nested segment)."""
    return replace(recompute, early=False) if recompute.early is None else recompute


def compilable_selective(modules) -> bool:
    """Whether compiled blocks can run selective recompute of `modules` (compile_refusal's rule)."""
    return compile_refusal("1f1b", SelectiveRecompute(modules=list(modules))) is None
