"""Which costs price a run's plan (train.device_profile): this device's cached profile, a named one, or the analytic
model. Every run and dry run on a device finds the same cached profile, by the signature its ranks will have."""

import json
import os
from pathlib import Path

import torch

from harness.context import RunContext
from parallel.planning.block_prices import BlockPrices
from parallel.planning.curve_seconds import profile_prices
from parallel.planning.device_profile_file import (
    DeviceProfile,
    DeviceSignature,
    ProfileRefused,
    cache_dir,
    read_profile,
)
from parallel.planning.shapes import Shape
from parallel.runtime.device_signature import signature_of
from parallel.runtime.dist_env import cuda_device_index
from parallel.runtime.threads import threads_per_rank, usable_cores

PROFILE_COMMAND = "python -m parallel.measurement.device_profile"


def ranks_on_node(ctx: RunContext) -> int:
    """The launcher's ranks on this node; a dry run without a launcher takes all its ranks to share this node."""
    env = ctx.env
    return ctx.topology.world_size if ctx.run.dry_run and env.source == "single" else env.local_world_size


def rank_threads(ctx: RunContext) -> int:
    """The intra-op threads each rank will run (parallel/runtime/threads.py's rule)."""
    given = os.environ.get("OMP_NUM_THREADS")
    if given and given.isdigit():
        return int(given)
    return threads_per_rank(usable_cores(), ranks_on_node(ctx), ctx.env.cpus_per_task)


def expected_signature(ctx: RunContext) -> DeviceSignature | None:
    """The signature a profile must have to price this run; None when the run's device is not on this machine (a
    dry run planned for CUDA here), which then has no cached profile."""
    target = ctx.target
    if target.device == "cuda" and not torch.cuda.is_available():
        return None
    index = 0
    if target.device == "cuda":  # the rank's own GPU: under a per-task binding the one it sees, not its local rank
        index = cuda_device_index(torch.cuda.device_count(), ctx.env.local_rank, ctx.env.local_world_size)
    return signature_of(target.device, target.precision, rank_threads(ctx), index)


def run_profile(ctx: RunContext) -> tuple[DeviceProfile | None, str]:
    """The device profile that prices the run (None: analytic costs) and the start-up line that says which, and
    why. A named profile that cannot price this run raises ProfileRefused (start-up's exit 2)."""
    option = ctx.run.train.device_profile
    if option == "analytic":
        return None, "costs: analytic (train.device_profile=analytic)"
    expected = expected_signature(ctx)
    if option == "auto":
        if expected is None:
            return None, f"costs: analytic: no {ctx.target.device} device here has a cached profile"
        path = cache_dir() / expected.file_name()
        if not path.exists():
            return None, (
                f"costs: analytic: no device profile of this device at {path}; `{PROFILE_COMMAND} --threads "
                f"{expected.threads or 1}` measures one (about a minute on a CPU core) for every later run"
            )
        try:
            profile = read_profile(path, expected)
        except ProfileRefused as refused:
            return None, f"costs: analytic: {refused}"
    else:
        path = Path(option)
        if not path.is_file():
            raise ProfileRefused(
                f"train.device_profile={option!r} is not a file: give a profile written by `{PROFILE_COMMAND}`, "
                "auto (this device's cached one) or analytic"
            )
        profile = read_profile(path, expected or _same_device_anywhere(path, ctx))
    return profile, f"costs: {profile.source.describe()}"


def run_prices(profile: DeviceProfile | None, ctx: RunContext) -> BlockPrices | None:
    """The run's costs from its profile (None: the analytic ones)."""
    if profile is None:
        return None
    return profile_prices(profile, Shape.of(ctx.run.model, ctx.run.train.micro_batch_size), ctx.target)


def _same_device_anywhere(path: Path, ctx: RunContext) -> DeviceSignature:
    """A dry run for a device this machine lacks may be priced by a profile measured on one: it must be that kind
    of device at the run's precision (its name, threads and torch are the profile's own)."""
    try:
        signature = DeviceSignature(**json.loads(path.read_text())["signature"])
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise ProfileRefused(f"device profile {path} is damaged ({error!r})") from None
    target = ctx.target
    return DeviceSignature(target.device, signature.device_name, signature.threads, signature.torch, target.precision)
