"""What a compiled block keeps (train.compile), measured: one block of the run's model compiled at the run's exact
micro-batch shape and precision, once per selective option, as a rank compiles it (parallel/runtime/compile_blocks.py,
after its plan). The planner counts these bytes instead of eager autograd's (parallel/planning/shapes.py's
`CompiledBlocks`), because AOTAutograd's partitioner chooses what a compiled graph saves for backward.

Per option, after one warm-up step (which compiles the forward and backward graphs and gives the parameters their
gradients, as in every step after a run's first):

- kept: every distinct storage the compiled block's forward saves for backward, parameters excluded, its input
  included: the activation meter's count (parallel/measurement/activation_meter.py), which sees a compiled graph's saved
  tensors through the saved-tensor hooks around it, as a rank's meter does; but for `shared`, the storages it saves
  that the process held before the forward began (Llama's rotary angles table, model/rotary.py: every block saves the
  same one, which a stage's meter counts once);
- working: the most live tensor bytes its backward adds to what was alive when it started (the allocator's events:
  parallel/measurement/tensor_peak.py), its output gradient given from outside, as DeepSpeed's gradient buffer is.

Dynamo forgets its graphs before each option and after the last one: every option compiles from nothing, and the
run's own blocks never meet the probe's graphs in dynamo's cache (whose recompile limit nn.Module.compile shares).
"""

import gc
from collections.abc import Sequence
from dataclasses import replace

import torch

from model import BLOCK_CLASSES, GPTConfig, gpt_layers
from parallel.measurement.in_process import LocalStage
from parallel.measurement.tensor_peak import TensorPeakMeter, live_storages
from parallel.planning.config import AutoRecompute, SelectiveRecompute
from parallel.planning.memory_model import selective_combinations
from parallel.planning.partition import stages_of_parts
from parallel.planning.shapes import CompiledBlocks, Shape, Target, option_key
from parallel.planning.stage_plan import StagePlan
from parallel.runtime.compile_blocks import compilable_selective


def compiled_options(recompute) -> tuple[tuple[str, ...], ...]:
    """The block options a compiled run's plan needs (`recompute`: the recompute group's config): none (every block
    under none and full, whose segments recompute compiled blocks, and the micro-batches recompute.micro_batches leaves
    plain) and its selective modules; under +recompute=auto every selective combination compiled blocks can run (auto
    weighs each: without `layernorm`, which compile_refusal refuses)."""
    if isinstance(recompute, SelectiveRecompute):
        return ((), option_key(recompute.modules))
    if isinstance(recompute, AutoRecompute):
        return ((), *(option_key(combo) for combo in selective_combinations() if compilable_selective(combo)))
    return ((),)


def measure_compiled_blocks(
    model: GPTConfig, micro_batch_size: int, target: Target, options: Sequence[Sequence[str]]
) -> CompiledBlocks:
    """The bytes one compiled block keeps and its backward's working set under each option (its recompute.modules, ()
    for none), at `micro_batch_size` sequences of the model's length, on `target`'s device and precision."""
    kept, working, shared = [], [], 0
    for modules in dict.fromkeys(option_key(m) for m in options):
        torch._dynamo.reset()
        block_kept, block_working, block_shared = _measure_block(model, micro_batch_size, target, modules)
        kept.append((modules, block_kept))
        working.append((modules, block_working))
        shared = max(shared, block_shared)  # the same storage under every option
    torch._dynamo.reset()
    gc.collect()
    shape = Shape.of(model, micro_batch_size)
    return CompiledBlocks(shape, target.precision, tuple(kept), tuple(working), shared)


def _measure_block(
    model: GPTConfig, micro_batch_size: int, target: Target, modules: tuple[str, ...]
) -> tuple[int, int, int]:
    """(kept, working, shared) of one compiled block under `modules` (the module docstring)."""
    recipes = gpt_layers(replace(model, n_layer=1), seed=0)
    (block,) = [i for i, recipe in enumerate(recipes) if recipe.module_class in BLOCK_CLASSES]
    plan = StagePlan(selective={0: modules}) if modules else StagePlan()
    stage = LocalStage(recipes, stages_of_parts([block, block + 1])[0], plan, target.precision, compile=True)
    stage.to(target.device)

    def hidden() -> torch.Tensor:  # (B, T, C): a block's input, or its output's gradient
        size = (micro_batch_size, model.seq_len, model.n_embd)
        return torch.randn(size, dtype=target.torch_dtype, device=target.device)

    stage(hidden().requires_grad_()).backward(hidden())  # compiles both graphs; the parameters get their gradients
    x, output_grad = hidden().requires_grad_(), hidden()
    # Storages are told apart by address: no garbage may die in the forward and hand its address to a saved tensor
    # (collected first, and what is held stays referenced until the forward has ended).
    gc.collect()
    held = live_storages(target.device)
    with stage.meter.record(stage_input=x):
        y = stage(x)
    saved = stage.meter.micro_batches[-1]  # {storage address: bytes}
    held.pop(x.untyped_storage().data_ptr())
    shared = sum(nbytes for ptr, nbytes in saved.items() if ptr in held)
    del held
    gc.collect()  # the warm-up's garbage would otherwise count as alive in the window
    meter = TensorPeakMeter(target.device)
    with meter.window() as result:
        y.backward(output_grad)
    peak = result[0]
    return sum(saved.values()) - shared, peak.peak_bytes - peak.baseline_bytes, shared
