"""train.compile at start-up: what a compiled block keeps at the run's shape, for the plan
(parallel/measurement/compiled_bytes.py measures it; parallel/planning/shapes.py's CompiledBlocks carries it in the
run's Target, so every byte the planner counts for a block is the compiled block's).

Measured once per shape, options and device, like the stage prices: local rank 0 compiles the probe before any process
group exists, into a file beside the measured prices, while the other ranks wait for it, and every rank plans from
that one file's bytes (harness/price_source.py's measure_once); a later run at that shape reads it without compiling.
Bytes, not seconds: the load changes nothing, so ranks on several nodes measure alike. +recompute=auto needs every
option it weighs (parallel/measurement/compiled_bytes.py's compiled_options: six compiles), and is refused without
them rather than planned from eager bytes.
"""

import json
import time
from dataclasses import replace
from pathlib import Path

from harness.context import RunContext
from harness.price_source import RACED, expected_signature, measure_once, measurement_header, price_file
from parallel.measurement.compiled_bytes import compiled_options, measure_compiled_blocks
from parallel.planning.config import AutoRecompute
from parallel.planning.device_profile_file import DeviceSignature
from parallel.planning.shapes import CompiledBlocks, Shape

EAGER = "the plan counts eager autograd's bytes, which a compiled block does not keep (docs/compile.md)"


def compiled_file(ctx: RunContext, signature: DeviceSignature, options: tuple[tuple[str, ...], ...]) -> Path:
    """Beside the measured prices of this shape and device, one file per set of options."""
    names = "_".join("+".join(modules) or "none" for modules in options)
    prices = price_file(ctx, signature)
    return prices.parent / "compiled_blocks" / f"{prices.stem}-{names}.json"


def with_compiled_blocks(ctx: RunContext) -> tuple[RunContext, str]:
    """`ctx` whose target carries what one compiled block keeps at the run's shape under each option its plan needs,
    and the start-up line that says where that came from (or why the plan counts eager bytes: no such device here,
    for a dry run, or a damaged file). +recompute=auto is refused (ValueError) without them: it would weigh eager
    bytes, and options that do not compile."""
    target = ctx.target
    auto = isinstance(ctx.run.recompute, AutoRecompute)
    signature = expected_signature(ctx)
    if signature is None:
        return _eager(ctx, f"no {target.device} device here to compile a block on", auto)
    options = compiled_options(ctx.run.recompute)
    path = compiled_file(ctx, signature, options)
    model, size = ctx.run.model, ctx.run.train.micro_batch_size

    def measure() -> dict:
        start = time.perf_counter()
        blocks = measure_compiled_blocks(model, size, target, options)
        return {
            "kept": blocks.kept,
            "working": blocks.working,
            "shared": blocks.shared,
            "wall_s": time.perf_counter() - start,
        }

    how = measure_once(path, ctx.env.local_rank, measurement_header(ctx, signature), measure)
    try:
        data = json.loads(path.read_text())
        if "failed" in data:
            return _eager(ctx, f"compiling a block failed ({data['failed']}): delete {path} to try again", auto)
        compiled = CompiledBlocks(
            Shape.of(model, size),
            target.precision,
            tuple((tuple(modules), int(kept)) for modules, kept in data["kept"]),
            tuple((tuple(modules), int(working)) for modules, working in data["working"]),
            int(data["shared"]),
        )
        wall_s = data.get("wall_s")  # absent from files written before it was recorded
    except (OSError, ValueError, KeyError, TypeError) as error:
        return _eager(ctx, f"the compiled block bytes {path} are damaged ({error!r})", auto)
    kept = ", ".join(f"{'+'.join(modules) or 'none'} {kept:,} bytes" for modules, kept in compiled.kept)
    if compiled.shared:
        kept += f", and {compiled.shared:,} bytes of one storage every block saves, once per stage"
    measured = f"{len(options)} option(s) compiled" + ("" if wall_s is None else f" in {float(wall_s):.1f} s")
    source = {
        None: f"cached {path}, {measured}",
        RACED: f"measured by another run at the same moment: {path}",
    }
    line = f"train.compile: the plan counts what a compiled block keeps per micro-batch, {kept} ("
    line += source.get(how, f"measured now by compiling one block per option: {measured}; cached at {path}") + ")"
    return replace(ctx, shape=replace(ctx.shape, target=replace(target, compiled=compiled))), line


def _eager(ctx: RunContext, why: str, auto: bool) -> tuple[RunContext, str]:
    """No compiled bytes: a fixed plan counts eager autograd's, with the start-up line saying why; auto is refused."""
    if auto:
        raise ValueError(
            f"train.compile=true with +recompute=auto needs what a compiled block keeps under each option, measured at "
            f"start-up: {why}; use a fixed recompute mode (none, full, selective) or train.compile=false"
        )
    return ctx, f"train.compile: {why}: {EAGER}"
