"""Recompute at run time: a stage's layers run under its StagePlan (parallel/planning/stage_plan.py).

A stage runs its local layers in order. The plan says which runs of consecutive blocks are
checkpointed as one segment (full recompute) and, for the other blocks, which modules inside them
are recomputed (selective). Everything recomputed is exact: each layer of a keyed forward seeds its dropout stream
as it starts (parallel/runtime/dropout_keys.py), inside the checkpointed function, and non-reentrant checkpoints
restore the RNG state besides, so dropout masks are redrawn identically; the discarded outputs are deterministic.
"""

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, ExitStack, contextmanager, nullcontext
from functools import partial

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint, noop_context_fn

from model import BLOCK_CLASSES, Block, LayerFn, LlamaBlock
from parallel.planning.stage_plan import StagePlan
from parallel.runtime import early_recompute
from parallel.runtime.compressed_stash import CompressedStash
from parallel.runtime.dropout_keys import keyed_layers
from parallel.runtime.early_recompute import DiscardedOutput

# Tensors kept for backward *outside* autograd's saved-tensor hooks: a non-reentrant checkpoint holds
# its inputs by reference, and inside a checkpoint or an output-discarding consumer the innermost hooks
# win, so an outer saved_tensors_hooks meter cannot see them. Each place that keeps such a tensor
# reports it to these observers (parallel/measurement/activation_meter.py); with none registered this costs nothing.
_stored_observers: list[Callable[[torch.Tensor], None]] = []


@contextmanager
def observe_stored(observer: Callable[[torch.Tensor], None]):
    """Call `observer(t)` for every tensor a recompute region keeps for backward while active."""
    _stored_observers.append(observer)
    try:
        yield
    finally:
        _stored_observers.remove(observer)


def note_stored(*tensors) -> None:
    if torch.compiler.is_compiling():
        return  # inside a compiled block every kept tensor is the compiled graph's saved tensor, seen by the hooks
    for observer in _stored_observers:
        for t in tensors:
            if isinstance(t, torch.Tensor):
                observer(t)


# Brackets around each recompute that backward runs (parallel/measurement/trace.py times them); with none registered
# the checkpoints get torch's own no-op contexts.
_recompute_observers: list[Callable[[], AbstractContextManager]] = []


@contextmanager
def observe_recompute(observer: Callable[[], AbstractContextManager]):
    """While active, every recompute runs inside `observer()`: a checkpoint's recompute exactly (its
    recompute context) and an output-discarding one around the producer's forward."""
    _recompute_observers.append(observer)
    try:
        yield
    finally:
        _recompute_observers.remove(observer)


@contextmanager
def _observed_recompute():
    with ExitStack() as stack:
        for observer in _recompute_observers:
            stack.enter_context(observer())
        yield


def _recompute_bracket() -> AbstractContextManager:
    return _observed_recompute() if _recompute_observers else nullcontext()


def _recompute_context_fn():
    """`context_fn` of every checkpoint: (forward context, recompute context)."""
    if not _recompute_observers:
        return noop_context_fn()
    return nullcontext(), _observed_recompute()


def _checkpoint(fn: Callable, *args: torch.Tensor, stash: CompressedStash | None = None) -> torch.Tensor:
    """fn(*args) checkpointed; with `stash`, the inputs it keeps are stored compressed (recompute.compress), and the
    stash reports what it stores."""
    if torch.compiler.is_compiling():
        # Traced into a compiled block (train.compile) as torch's checkpoint operator, which accepts no context_fn
        # but dispatch modes: its recompute runs inside the compiled backward, where no bracket can time it. Start-up
        # refuses a stash under compile (parallel/runtime/compile_blocks.py).
        return checkpoint(fn, *args, use_reentrant=False)
    if stash is None:
        note_stored(*args)
    if early_recompute.registering():  # recompute.early: RecomputeEarly reruns it ahead of backward
        return early_recompute.checkpoint(fn, *args, bracket=_recompute_bracket, stash=stash)
    if stash is None:
        return checkpoint(fn, *args, use_reentrant=False, context_fn=_recompute_context_fn)
    # torch saves a checkpoint's inputs (save_for_backward) before its own hooks take over: only they pass these
    with stash.hooks():
        return checkpoint(fn, *args, use_reentrant=False, context_fn=_recompute_context_fn)


def _run_range(funcs: Sequence[LayerFn], x: torch.Tensor) -> torch.Tensor:
    for fn in funcs:
        x = fn(x)
    return x


def _run_nested(funcs: Sequence[LayerFn], x: torch.Tensor) -> torch.Tensor:
    """A nested segment's body: each block checkpointed again. The segment's own checkpoint discards the blocks'
    inputs in the forward (torch saves a nested checkpoint's inputs through the enclosing one's hooks), its recompute
    keeps only them, and each block's interior is remade just before that block's backward."""
    for fn in funcs:
        x = checkpoint(fn, x, use_reentrant=False, context_fn=_recompute_context_fn)
    return x


# True while a stage runs a micro-batch its plan leaves out (StagePlan.micro_batches): the selective wrappers
# installed at build time then call straight through, so that micro-batch keeps what `none` keeps.
_plain = False


@contextmanager
def _without_recompute():
    global _plain
    previous, _plain = _plain, True
    try:
        yield
    finally:
        _plain = previous


def run_stage(
    funcs: Sequence[LayerFn], plan: StagePlan, x: torch.Tensor, recompute: bool = True, *, first_layer: int
) -> torch.Tensor:
    """Run a stage's layers (flat indices from `first_layer` on), checkpointing the plan's segments; with `recompute`
    false (a micro-batch the plan leaves out), every layer runs as under `none`. In a keyed forward each layer draws
    its dropout masks from its own key (parallel/runtime/dropout_keys.py)."""
    funcs = keyed_layers(funcs, first_layer)
    if not recompute:
        with _without_recompute():
            return _run_range(funcs, x)
    segment_stop = dict(plan.segments)
    stash = CompressedStash(plan.compress, note_stored) if plan.compress != "none" else None
    i = 0
    while i < len(funcs):
        if i in segment_stop:
            stop = segment_stop[i]
            x = _checkpoint(partial(_run_nested if plan.nested else _run_range, funcs[i:stop]), x, stash=stash)
            i = stop
        else:
            x = funcs[i](x)
            i += 1
    return x


def _checkpoint_forward(module: nn.Module) -> None:
    """Recompute this module's forward in backward; only its inputs stay stored."""
    inner = module.forward

    def forward(*args):
        if _plain:
            return inner(*args)
        return _checkpoint(inner, *args)

    module.forward = forward


def _checkpoint_pair(first: nn.Module, second: nn.Module) -> None:
    """Recompute second(first(x)) as one checkpoint that stores only x. `first` passes its input
    through and `second` runs both, so `second` alone never holds `first`'s output."""
    first_forward, second_forward = first.forward, second.forward

    def forward(x: torch.Tensor) -> torch.Tensor:
        if _plain:
            return second_forward(first_forward(x))
        return _checkpoint(lambda t: second_forward(first_forward(t)), x)

    first.forward, second.forward = (lambda x: x), forward


def _discard_output(producer: nn.Module, consumer: nn.Module) -> None:
    """The consumer stores the producer's inputs instead of its output, and the producer's output is
    recomputed (without grad) when backward needs it: Megatron's output-discarding recompute.
    The consumer's own backward then runs on bit-identical values, so gradients are unchanged. Every op of the
    consumer that saves the output (Llama's q, k and v projections all read one norm output) takes one remade output,
    made once per consumer call (a `DiscardedOutput`, as early recompute remakes it) and dropped after its last user."""
    producer_forward, consumer_forward = producer.forward, consumer.forward
    last: dict[str, tuple[torch.Tensor, ...] | torch.Tensor] = {}

    def remember(*inputs: torch.Tensor) -> torch.Tensor:
        if _plain:
            return producer_forward(*inputs)
        last["inputs"], last["output"] = inputs, producer_forward(*inputs)
        return last["output"]

    def consume(*args: torch.Tensor) -> torch.Tensor:
        if _plain:
            return consumer_forward(*args)
        inputs, out = last.pop("inputs"), last.pop("output")
        if torch.compiler.is_compiling():
            # In a compiled block (train.compile: `mlp_act` only) the hooks below cannot be traced. A checkpoint of
            # producer and consumer together stores the producer's inputs, and the partitioner recomputes only what
            # the compiled backward reads: the producer's output, not the consumer's.
            return checkpoint(lambda *i: consumer_forward(producer_forward(*i)), *inputs, use_reentrant=False)
        storage = out.untyped_storage().data_ptr()
        region: list[DiscardedOutput] = []  # one per consumer call, however many ops saved `out`

        def pack(t: torch.Tensor):
            if t.untyped_storage().data_ptr() != storage:
                note_stored(t)
                return t
            note_stored(*inputs)
            if not region:
                # recompute.early: registered, so RecomputeEarly remakes it ahead of backward
                make = early_recompute.discarded_output if early_recompute.registering() else DiscardedOutput
                region.append(make(producer_forward, inputs, _recompute_bracket))
            region[0].users += 1
            return region[0], t.size(), t.stride(), t.storage_offset()

        def unpack(packed):
            if isinstance(packed, torch.Tensor):
                return packed
            remade, size, stride, offset = packed
            return remade.take().as_strided(size, stride, offset)

        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            return consumer_forward(*args)

    producer.forward, consumer.forward = remember, consume


def apply_selective(block: Block | LlamaBlock, modules: Sequence[str]) -> None:
    """gpt2: ln_1, attn, ln_2, mlp, GELU -> c_proj; llama: input_layernorm, self_attn, post_attention_layernorm,
    mlp, SwiGLU product -> down_proj (`mlp_act` discards the product, made again from gate and up). Qwen3's q and k
    norms join `layernorm`: nothing keeps their output (the rotary embedding keeps only its cos and sin), so they
    drop their rstd instead, made again in backward from the projection output they keep."""
    if isinstance(block, LlamaBlock):
        norm_1, attn, norm_2, mlp, act_consumer = (
            block.input_layernorm,
            block.self_attn,
            block.post_attention_layernorm,
            block.mlp,
            block.mlp.down_proj,
        )
    else:
        norm_1, attn, norm_2, mlp, act_consumer = block.ln_1, block.attn, block.ln_2, block.mlp, block.mlp.c_proj
    if "core_attn" in modules:
        _checkpoint_forward(attn.core)
    if "mlp" in modules and "layernorm" in modules:
        # A checkpoint of the MLP alone would hold the norm's output by reference: take the norm into it.
        _checkpoint_pair(norm_2, mlp)
    elif "mlp" in modules:
        _checkpoint_forward(mlp)
    if "mlp_act" in modules:
        _discard_output(mlp.act, act_consumer)
    if "layernorm" in modules:
        for qk_norm in (getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)):
            if qk_norm is not None:
                qk_norm.keep_rstd = False
        _discard_output(norm_1, attn)
        if "mlp" not in modules:
            _discard_output(norm_2, mlp)


def apply_plan(funcs: Sequence[LayerFn], plan: StagePlan) -> None:
    """Install the plan's selective recompute on the stage's built blocks (once, at build time)."""
    for index, modules in plan.selective.items():
        block = funcs[index]
        if not isinstance(block, BLOCK_CLASSES):
            raise TypeError(f"local layer {index} is {type(block).__name__}, not a block")
        apply_selective(block, modules)
