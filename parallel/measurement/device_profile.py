"""`python -m parallel.measurement.device_profile`: measure this device once, as functions of shape, for the
planner (parallel/planning/device_profile_file.py's curves): matmul throughput by size; LayerNorm, GELU,
dropout with its RNG, residual adds and the embedding's gather and scatter by elements; the attention core of
each kernel, with and without dropout; the fused and unfused loss; AdamW per parameter; and, between two
processes, point-to-point latency and bandwidth and a two-rank all-reduce.

The profile is written to the cache, one file per device signature (device, its name, intra-op threads, torch,
precision), where every run and dry run on that device finds it (`train.device_profile=auto`), or to `--out`.
Measure with the threads a rank will run: a rank takes its share of the node's cores (parallel/runtime/threads.py),
so 2 ranks on 2 cores want `--threads 1`.

Cost: about a minute on one CPU core (`--quick`: a few seconds, for tests); on a GPU, well under a minute.
"""

import argparse
import json
import sys
from datetime import UTC, datetime
from pathlib import Path

import torch

from parallel.measurement import profile_kernels
from parallel.measurement.kernel_timing import interleaved_seconds
from parallel.measurement.link_profile import link_curves
from parallel.planning.device_profile_file import (
    CURVES,
    DeviceProfile,
    cache_dir,
    profile_json,
    read_profile,
    signature_of,
)
from parallel.planning.shapes import TORCH_DTYPES

FULL = {"rounds": 7, "points": 9, "max_flops": 4e9, "max_elements": 8e6, "max_seq": 1024, "max_tokens": 4096}
QUICK = {"rounds": 3, "points": 3, "max_flops": 1e7, "max_elements": 6e4, "max_seq": 64, "max_tokens": 256}
GPU_SCALE = {"max_flops": 1e3, "max_elements": 1e2, "max_seq": 8, "max_tokens": 16}
"""A GPU's sizes reach further: its kernels leave their launch-bound floor much later than a CPU's."""


def measure(device: str, precision: str, quick: bool = False, links: bool = True) -> dict:
    """The profile of this process's device, as written to disk (device_profile_file.profile_json)."""
    grid = dict(QUICK if quick else FULL)
    if device == "cuda" and not quick:
        grid = {k: v * GPU_SCALE.get(k, 1) for k, v in grid.items()}
    dtype, rounds, points = TORCH_DTYPES[precision], grid["rounds"], grid["points"]
    families = (
        profile_kernels.matmuls(device, dtype, points, grid["max_flops"]),
        profile_kernels.elementwise(device, dtype, points, grid["max_elements"]),
        profile_kernels.attention(device, dtype, points, int(grid["max_seq"])),
        profile_kernels.losses(device, dtype, points, int(grid["max_tokens"])),
        profile_kernels.optimizer(device, dtype, points, grid["max_elements"] * 4),
    )
    curves: dict[str, list[tuple[float, float]]] = {}
    for family in families:  # one family's workloads interleaved: their tensors fit in memory together
        flat = {(name, size): fn for name, by_size in family.items() for size, fn in by_size.items()}
        seconds = interleaved_seconds({f"{n}@{s}": fn for (n, s), fn in flat.items()}, device, rounds)
        for name, size in flat:
            curves.setdefault(name, []).append((size, seconds[f"{name}@{size}"]))
    assert set(curves) == set(CURVES), sorted(set(CURVES) ^ set(curves))
    if links and (device == "cpu" or torch.cuda.device_count() >= 2):
        curves.update(link_curves(device, rounds, points, grid["max_elements"] * 8, torch.get_num_threads()))
    signature = signature_of(device, precision, torch.get_num_threads())
    return profile_json(signature, datetime.now(UTC).isoformat(timespec="seconds"), curves)


def measure_to(path: Path, device: str, precision: str, quick: bool = False, links: bool = True) -> DeviceProfile:
    """Measure this device and write the profile to `path` (atomically), read back as the planner reads it."""
    profile = measure(device, precision, quick, links)
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(path.name + ".tmp")
    temporary.write_text(json.dumps(profile, indent=1))
    temporary.replace(path)
    return read_profile(path, signature_of(device, precision, torch.get_num_threads()))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m parallel.measurement.device_profile", description=__doc__)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--precision", choices=tuple(TORCH_DTYPES), default=None, help="default: bf16 on cuda, fp32")
    parser.add_argument("--threads", type=int, default=None, help="intra-op threads (a rank's share of the cores)")
    parser.add_argument("--out", type=Path, default=None, help="default: the cache file of this device's signature")
    parser.add_argument("--quick", action="store_true", help="few sizes and rounds: checks the plumbing only")
    parser.add_argument("--no-links", action="store_true", help="skip the two-process p2p and all-reduce curves")
    args = parser.parse_args(argv)
    if args.threads is not None:
        if args.threads < 1:
            print(f"--threads={args.threads} is invalid: it must be >= 1", file=sys.stderr)
            return 2
        torch.set_num_threads(args.threads)
    precision = args.precision or ("bf16" if args.device == "cuda" else "fp32")
    out = args.out or cache_dir() / signature_of(args.device, precision, torch.get_num_threads()).file_name()
    profile = measure_to(out, args.device, precision, args.quick, not args.no_links)
    print(f"device profile: wrote {out} ({len(profile.curves)} curves, signature {vars(profile.signature)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
