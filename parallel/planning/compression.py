"""Compressed stashes (`recompute.compress`): what full recompute keeps of each segment, its input, stored in fewer
bits and decompressed when the segment is recomputed. Lossy: the backward runs on the decompressed input, so the
gradients are those of that input, not of the one the forward saw. Pure arithmetic and wording, shared by the memory
model, the plan, the start-up print and the summary (parallel/runtime/compressed_stash.py does it)."""

from collections.abc import Sequence

from parallel.planning.shapes import FP32, Shape, Target
from parallel.planning.stage_plan import StagePlan

FORMAT_WORDS = {
    "bf16": "bfloat16 (rounded to 8 significant bits)",
    "fp8": "float8 e4m3 with one fp32 scale per token (its largest magnitude maps to 448)",
    "int8": "int8 with one fp32 scale per token (its largest magnitude maps to 127, rounded to the nearest step)",
}


def stored_input_bytes(shape: Shape, target: Target, compress: str) -> int:
    """Bytes one segment input (b, s, h) keeps under `compress`."""
    elements, rows = shape.bsh, shape.b * shape.s
    if compress == "bf16":
        return 2 * elements
    if compress in ("fp8", "int8"):
        return elements + rows * FP32
    return elements * target.dtype_bytes


def compress_traffic_bytes(shape: Shape, target: Target, compress: str) -> int:
    """Memory traffic (read + write) of storing one segment input (b, s, h) in `compress` and making it again at its
    recompute, pass by pass as parallel/runtime/compressed_stash.py runs them: bf16 a cast each way; fp8 and int8
    the magnitudes, their per-row largest, the scaling in fp32 (int8 rounded), the cast, and back: the cast to fp32,
    the scale, the cast to the run's dtype."""
    d, elements = target.dtype_bytes, shape.bsh
    if compress == "bf16":
        return 2 * (d + 2) * elements
    to_fp32 = d + FP32 if d != FP32 else 0  # a pass only when the run's dtype is not fp32 already
    pack = 2 * d + d + to_fp32 + 2 * FP32 + (2 * FP32 if compress == "int8" else 0) + FP32 + 1
    unpack = 1 + FP32 + 2 * FP32 + to_fp32
    return (pack + unpack) * elements


def lossy_note(plans: Sequence[StagePlan]) -> str | None:
    """What a layout whose stages run `plans` loses, in one sentence (plan.json, summary.json, the start-up print);
    None: it is exact."""
    compressed = {s: p.compress for s, p in enumerate(plans) if p.compress != "none" and p.segments}
    if not compressed:
        return None
    how = "; ".join(
        f"stage{'s' if len(stages) > 1 else ''} {', '.join(map(str, stages))}: {FORMAT_WORDS[compress]}"
        for compress in sorted(set(compressed.values()))
        for stages in [[s for s, c in compressed.items() if c == compress]]
    )
    return (
        f"LOSSY: full-recompute segment inputs are stored compressed until their recompute ({how}); the gradients "
        f"are those of the decompressed inputs"
    )


def check_compress(compress: str, precision: str) -> None:
    """`recompute.compress` against the run's precision (start-up; the name itself: config.check_compress_name)."""
    if compress == "bf16" and precision != "fp32":
        raise ValueError(
            f"recompute.compress=bf16 stores nothing less under train.precision={precision}: use "
            f"recompute.compress=fp8 or none"
        )
