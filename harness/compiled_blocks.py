"""train.compile at start-up: what a compiled block keeps at the run's shape, for the plan
(parallel/measurement/compiled_bytes.py measures it; parallel/planning/shapes.py's CompiledBlocks carries it in the
run's Target, so every byte the planner counts for a block is the compiled block's).

Measured once per shape, options and device, like the stage prices: local rank 0 compiles the probe before any process
group exists, into a file beside the measured prices, while the other ranks wait for it, and every rank plans from
that one file's bytes (harness/price_source.py's measure_once); a later run at that shape reads it without compiling.
Bytes, not seconds: the load changes nothing, so ranks on several nodes measure alike.
"""

import json
from dataclasses import replace
from pathlib import Path

from harness.context import RunContext
from harness.price_source import RACED, expected_signature, measure_once, measurement_header, price_file
from parallel.measurement.compiled_bytes import compiled_options, measure_compiled_blocks
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
    for a dry run, or a damaged file)."""
    target = ctx.target
    signature = expected_signature(ctx)
    if signature is None:
        return ctx, f"train.compile: no {target.device} device here to compile a block on: {EAGER}"
    options = compiled_options(ctx.run.recompute)
    path = compiled_file(ctx, signature, options)
    model, size = ctx.run.model, ctx.run.train.micro_batch_size

    def measure() -> dict:
        blocks = measure_compiled_blocks(model, size, target, options)
        return {"kept": blocks.kept, "working": blocks.working, "shared": blocks.shared}

    how = measure_once(path, ctx.env.local_rank, measurement_header(ctx, signature), measure)
    try:
        data = json.loads(path.read_text())
        if "failed" in data:
            return (
                ctx,
                f"train.compile: compiling a block failed ({data['failed']}): delete {path} to try again; {EAGER}",
            )
        compiled = CompiledBlocks(
            Shape.of(model, size),
            target.precision,
            tuple((tuple(modules), int(kept)) for modules, kept in data["kept"]),
            tuple((tuple(modules), int(working)) for modules, working in data["working"]),
            int(data["shared"]),
        )
    except (OSError, ValueError, KeyError, TypeError) as error:
        return ctx, f"train.compile: the compiled block bytes {path} are damaged ({error!r}); {EAGER}"
    kept = ", ".join(f"{'+'.join(modules) or 'none'} {kept:,} bytes" for modules, kept in compiled.kept)
    if compiled.shared:
        kept += f", and {compiled.shared:,} bytes of one storage every block saves, once per stage"
    source = {None: f"cached {path}", RACED: f"measured by another run at the same moment: {path}"}
    line = f"train.compile: the plan counts what a compiled block keeps per micro-batch, {kept} ("
    line += source.get(how, f"measured now by compiling one block per option; cached at {path}") + ")"
    return replace(ctx, shape=replace(ctx.shape, target=replace(target, compiled=compiled))), line
