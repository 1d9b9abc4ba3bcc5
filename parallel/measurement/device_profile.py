"""`python -m parallel.measurement.device_profile`: measure this device once, as functions of shape, for the
planner (parallel/planning/device_profile_file.py's curves): matmul throughput by size; LayerNorm, GELU,
dropout with its RNG, residual adds and the embedding's gather and scatter by elements; Llama's RMSNorm, rotary
embedding and SwiGLU product by elements; the attention core of each kernel, with and without dropout, and with
grouped key/value heads; the fused and unfused loss; AdamW per parameter; and, between two processes,
point-to-point latency and bandwidth and a two-rank all-reduce.

The profile is written to the cache, one file per device signature (device, its name, intra-op threads, torch,
precision), where every run and dry run on that device finds it (`train.device_profile=auto`), or to `--out`.
Measure with the threads a rank will run: a rank takes its share of the node's cores (parallel/runtime/threads.py),
so 2 ranks on 2 cores want `--threads 1`. On a CPU, as many processes as the node holds ranks (`--ranks`, default
cores / threads) measure at once, as the ranks of a run compute beside each other.

Cost: about a minute on one CPU core (`--quick`: a few seconds, for tests); on a GPU, well under a minute.
"""

import argparse
import json
import os
import statistics
import sys
from datetime import UTC, datetime
from pathlib import Path

import torch
import torch.multiprocessing as mp

from parallel.measurement import profile_kernels
from parallel.measurement.kernel_timing import interleaved_seconds
from parallel.measurement.link_profile import link_curves
from parallel.planning.device_profile_file import (
    CURVES,
    DeviceProfile,
    cache_dir,
    profile_json,
    read_profile,
)
from parallel.planning.shapes import TORCH_DTYPES
from parallel.runtime.device_signature import signature_of

FULL = {"rounds": 7, "points": 9, "max_flops": 4e9, "max_elements": 8e6, "max_seq": 1024, "max_tokens": 4096}
QUICK = {"rounds": 2, "points": 2, "max_flops": 1e7, "max_elements": 6e4, "max_seq": 64, "max_tokens": 256}
GPU_SCALE = {"max_flops": 1e3, "max_elements": 1e2, "max_seq": 8, "max_tokens": 16}
"""A GPU's sizes reach further: its kernels leave their launch-bound floor much later than a CPU's."""


def size_grid(device: str, quick: bool) -> dict:
    """The ranges a profile measures over on `device` (FULL or QUICK, a GPU's reaching further)."""
    grid = dict(QUICK if quick else FULL)
    if device == "cuda" and not quick:
        grid = {k: v * GPU_SCALE.get(k, 1) for k, v in grid.items()}
    return grid


def compute_curves(device: str, precision: str, quick: bool) -> dict[str, list[tuple[float, float]]]:
    """Every compute curve of this process's device (device_profile_file.CURVES), one size at a time: a size's
    workloads are built, timed side by side and freed before the next, and on CUDA the sizes that would not fit in
    the free memory are skipped (a 24 GB card would not hold the largest at once)."""
    grid = size_grid(device, quick)
    dtype, rounds = TORCH_DTYPES[precision], grid["rounds"]
    curves: dict[str, list[tuple[float, float]]] = {}
    for family in profile_kernels.families(device, dtype, grid["points"], grid):
        free = free_memory(device)
        sizes = profile_kernels.sizes_that_fit(family, free)
        if len(sizes) < len(family.sizes):
            print(
                f"device profile: {family.name}: {len(family.sizes) - len(sizes)} of {len(family.sizes)} sizes "
                f"skipped, over half of the {free / 2**30:.1f} GiB free",
                flush=True,
            )
        for size in sizes:
            flat = {(n, x): fn for n, by_x in family.build(size).items() for x, fn in by_x.items()}
            seconds = interleaved_seconds({f"{n}@{x}": fn for (n, x), fn in flat.items()}, device, rounds)
            for name, x in flat:
                curves.setdefault(name, []).append((x, seconds[f"{name}@{x}"]))
            del flat  # this size's tensors go before the next size's are built
            if device == "cuda":
                torch.cuda.empty_cache()
    assert set(curves) == set(CURVES), sorted(set(CURVES) ^ set(curves))
    return curves


def free_memory(device: str) -> int | None:
    """Bytes free on this process's CUDA device (None on a CPU: no bound)."""
    return torch.cuda.mem_get_info()[0] if device == "cuda" else None


def _rank_curves(rank: int, device: str, precision: str, quick: bool, threads: int, out) -> None:
    torch.set_num_threads(threads)
    out.put(compute_curves(device, precision, quick))


def concurrent_curves(ranks: int, device: str, precision: str, quick: bool) -> dict[str, list[tuple[float, float]]]:
    """compute_curves measured by `ranks` processes at once, each point the median of theirs: ranks on one CPU
    node share its caches and memory bandwidth (and a virtual machine's cores their host), so a rank computes
    slower beside busy neighbours than alone."""
    context = mp.get_context("spawn")
    out = context.SimpleQueue()
    args = (device, precision, quick, torch.get_num_threads(), out)
    mp.start_processes(_rank_curves, args=args, nprocs=ranks, join=True, start_method="spawn")
    measured = [out.get() for _ in range(ranks)]
    return {
        name: [(size, statistics.median(m[name][i][1] for m in measured)) for i, (size, _) in enumerate(points)]
        for name, points in measured[0].items()
    }


def measure(device: str, precision: str, quick: bool = False, links: bool = True, ranks: int = 1) -> dict:
    """The profile of this process's device, as written to disk (device_profile_file.profile_json). `ranks`: how
    many processes compute at once (CPU: the ranks a run puts on this node)."""
    load_before = os.getloadavg()[0]
    if ranks > 1:
        curves = concurrent_curves(ranks, device, precision, quick)
    else:
        curves = compute_curves(device, precision, quick)
    grid = size_grid(device, quick)
    if links and (device == "cpu" or torch.cuda.device_count() >= 2):
        threads = torch.get_num_threads()
        curves.update(link_curves(device, grid["rounds"], grid["points"], grid["max_elements"] * 8, threads))
    signature = signature_of(device, precision, torch.get_num_threads())
    created = datetime.now(UTC).isoformat(timespec="seconds")
    return profile_json(signature, created, curves, (load_before, os.getloadavg()[0]))


def measure_to(
    path: Path, device: str, precision: str, quick: bool = False, links: bool = True, ranks: int = 1
) -> DeviceProfile:
    """Measure this device and write the profile to `path` (atomically), read back as the planner reads it."""
    profile = measure(device, precision, quick, links, ranks)
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
    parser.add_argument(
        "--ranks", type=int, default=None, help="CPU: processes measuring at once (default: cores / threads)"
    )
    parser.add_argument("--out", type=Path, default=None, help="default: the cache file of this device's signature")
    parser.add_argument("--quick", action="store_true", help="few sizes and rounds: checks the plumbing only")
    parser.add_argument("--no-links", action="store_true", help="skip the two-process p2p and all-reduce curves")
    args = parser.parse_args(argv)
    for option in ("threads", "ranks"):
        value = getattr(args, option)
        if value is not None and value < 1:
            print(f"--{option}={value} is invalid: it must be >= 1", file=sys.stderr)
            return 2
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    cores = len(os.sched_getaffinity(0))
    ranks = args.ranks or (max(1, cores // torch.get_num_threads()) if args.device == "cpu" else 1)
    precision = args.precision or ("bf16" if args.device == "cuda" else "fp32")
    out = args.out or cache_dir() / signature_of(args.device, precision, torch.get_num_threads()).file_name()
    profile = measure_to(out, args.device, precision, args.quick, not args.no_links, ranks)
    load = json.loads(out.read_text())["load"]
    print(
        f"device profile: wrote {out} ({len(profile.curves)} curves, signature {vars(profile.signature)}; load "
        f"average {load[0]:.1f} before, {load[1]:.1f} after: other work on the machine slows what it measures)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
