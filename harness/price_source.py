"""Which prices a run's plan (train.prices, train.device_profile): the run's stage measured at its shape, a device
profile's kernel curves (this device's cached profile, or a named one), or the analytic model. Every run and dry run
on a device finds the same cached profile and measured prices, by the signature its ranks will have.

Measured prices are one set for every rank: ranks that timed the stage each for themselves would get different
seconds and could choose different plans (a deadlock once they run). Local rank 0 measures, before any process group
exists, into the cache file for the run's shape and device; the other ranks wait for that file and read it, and rank
0 reads it back too, so every rank plans from the same bytes of one file. Ranks on several nodes would each have a
local rank 0 and a cache of their own: such a launch is priced by the curves, as is a shape this device cannot build.
What fits (bytes) never depends on the prices, so start-up validation is the same whatever they are.
"""

import hashlib
import json
import os
import time
from collections.abc import Callable
from dataclasses import asdict
from datetime import UTC, datetime
from pathlib import Path

import torch

from harness.context import RunContext
from harness.files import write_json_once
from harness.prediction_check import read_residuals, residuals_path
from parallel.measurement.stage_prices import measure_stage_prices, refusal
from parallel.planning.block_prices import BlockPrices, MeasuredSeconds, measured_prices, with_residuals
from parallel.planning.curve_seconds import (
    corrected,
    curve_corrections,
    link_seconds,
    op_counts,
    profile_prices,
    profile_seconds,
)
from parallel.planning.device_profile_file import (
    CostSource,
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


def run_prices(ctx: RunContext) -> tuple[BlockPrices | None, str]:
    """The prices the run's plan is made with (None: the analytic ones) and the start-up line that says which, and
    why (train.prices). A named profile that cannot price this run raises ProfileRefused (start-up's exit 2)."""
    option = ctx.run.train.prices
    if option == "analytic":
        return None, "costs: analytic (train.prices=analytic)"
    profile, line = run_profile(ctx)
    shape = Shape.of(ctx.run.model, ctx.run.train.micro_batch_size)
    curves = None if profile is None else profile_prices(profile, shape, ctx.target)
    if option == "curves":
        return curves, line
    if option == "corrected":
        if ctx.env.world_size > 1 and not ctx.run.dry_run:
            raise ProfileRefused(
                "train.prices=corrected prices dry runs and one-rank runs only (the ranks of a launch would read the "
                "measured shapes at different moments): use train.prices=measured, curves or analytic"
            )
        if profile is None:
            return None, line  # analytic, and why
        fixed, how = corrected_curves(ctx, profile, shape, held_out=True)
        return (fixed, how) if fixed is not None else (curves, f"{line}, uncorrected: no other shape measured here")
    measured, why = measured_prices_of(ctx, profile)
    if measured is not None:
        return measured, why
    if profile is not None:
        fixed, how = corrected_curves(ctx, profile, shape)
        if fixed is not None:
            return fixed, f"{why}; {how}"
    return curves, f"{why}; {line}"


PRICE_CACHE_ENV = "STAGECHECK_PRICE_DIR"
"""Where measured prices are cached, one file per device signature and shape (default:
~/.cache/stagecheck/stage_prices)."""
WAIT_S = 1800.0
"""How long a rank waits for local rank 0's measurement."""
PRICES_FORMAT = 3
"""The measured seconds' fields (MeasuredSeconds): 2 added the loads, ReduceGrads' own work and clipping; 3 ZB-H1's B
as the replay times it."""


def price_cache_dir() -> Path:
    return Path(os.environ.get(PRICE_CACHE_ENV) or Path.home() / ".cache" / "stagecheck" / "stage_prices")


def price_file(ctx: RunContext, signature: DeviceSignature) -> Path:
    """The cache file of this run's shape on this device: its signature's name and a digest of everything the probe
    builds (the model but its depth, the micro-batch size), whether its optimizer step clips, whether its blocks are
    compiled (priced from compiled instructions: a file of their own) and the file's format (a file of an earlier
    format is measured anew, not read as damaged)."""
    shape = {
        **asdict(ctx.run.model),
        "n_layer": None,
        "micro_batch_size": ctx.run.train.micro_batch_size,
        "clips": ctx.run.train.grad_clip > 0,
        "format": PRICES_FORMAT,
    }
    if ctx.run.train.compile:
        shape["compile"] = True
    digest = hashlib.sha256(json.dumps(shape, sort_keys=True, default=str).encode()).hexdigest()[:16]
    return price_cache_dir() / f"{Path(signature.file_name()).stem}-{digest}.json"


def measured_prices_of(ctx: RunContext, profile: DeviceProfile | None) -> tuple[BlockPrices | None, str]:
    """The run's stage measured at its shape (from the cache, or measured now by local rank 0 while the others wait),
    or None and why it is not."""
    env, run, target = ctx.env, ctx.run, ctx.target
    if env.world_size > env.local_world_size and not run.dry_run:
        return None, "costs: not measured: the ranks span several nodes, whose own measurements could differ"
    signature = expected_signature(ctx)
    if signature is None:
        return None, f"costs: not measured: no {target.device} device here"
    reason = refusal(run.model, ctx.shape, _memory_bytes() // ranks_on_node(ctx))
    if reason is not None:
        return None, f"costs: not measured: {reason}"
    path = price_file(ctx, signature)
    how = measure_once(
        path, env.local_rank, measurement_header(ctx, signature), lambda: _measure(ctx, signature, profile)
    )
    try:
        data = json.loads(path.read_text())
        if "failed" in data:
            return None, f"costs: not measured: timing the stage failed ({data['failed']}): delete {path} to try again"
        seconds = MeasuredSeconds(**data["seconds"])
        created, replays, wall_s = str(data["created"]), int(data["replays"]), float(data["wall_s"])
        residuals, runs = read_residuals(path)
        seconds = with_residuals(seconds, residuals)
    except (OSError, ValueError, KeyError, TypeError) as error:
        return None, f"costs: not measured: the measured prices {path} or their residuals are damaged ({error!r})"
    if how is None:
        line = f"costs: measured at this shape by {replays} stage replays in {wall_s:.1f} s (cached {path}, {created})"
    elif how == RACED:
        line = f"costs: measured at this shape by another run at the same moment: its prices {path}"
    else:
        compiled = " (compiled, but for selective layernorm and ZB-H1's)" if run.train.compile else ""
        line = (
            f"costs: measured at this shape: one block per recompute option{compiled} (none, each selective part, "
            f"full; 1F1B's and ZB-H1's backward), the embeddings and the head, {replays} stage replays in "
            f"{wall_s:.1f} s; cached at {path}"
        )
    if runs:
        line += f", scaled by the residuals {runs} earlier run(s) measured ({residuals_path(path)})"
    shape = Shape.of(run.model, run.train.micro_batch_size)
    return measured_prices(shape, target, seconds, CostSource("measured", str(path), created)), line


def corrected_curves(
    ctx: RunContext, profile: DeviceProfile, shape: Shape, held_out: bool = False
) -> tuple[BlockPrices | None, str]:
    """The profile's curves corrected by what the stages measured on this device taught (curve_seconds'
    curve_corrections: every cached shape of the profile's signature and the run's architecture, but `shape` itself
    where `held_out`), or None. A launch of several ranks is not corrected: its ranks would read the cache at
    different moments, and a file written between them (another run's measurement) would give them different
    prices."""
    if ctx.topology.world_size > 1 and not ctx.run.dry_run:
        return None, ""
    pairs = []
    for path in sorted(price_cache_dir().glob(f"{Path(profile.signature.file_name()).stem}-*.json")):
        if path.name.endswith(".residuals.json"):
            continue  # read with its prices
        try:
            data = json.loads(path.read_text())
            measured_shape = Shape(**data["shape"])
            seconds = with_residuals(MeasuredSeconds(**data["seconds"]), read_residuals(path)[0])
        except (OSError, ValueError, KeyError, TypeError):
            continue  # a damaged file teaches nothing (planning its own shape says so)
        if held_out and measured_shape == shape:
            continue
        if measured_shape.arch == shape.arch and not data.get("compiled"):  # the curves time eager kernels
            curves = profile_seconds(profile, measured_shape, ctx.target)
            pairs.append((seconds, curves, op_counts(measured_shape, ctx.target)))
    if not pairs:
        return None, ""
    own = profile_seconds(profile, shape, ctx.target)
    seconds = corrected(own, op_counts(shape, ctx.target), curve_corrections(pairs))
    source = CostSource("corrected_curves", profile.source.path, profile.source.created)
    return measured_prices(shape, ctx.target, seconds, source), (
        f"costs: the curves of {profile.source.describe()}, corrected by {len(pairs)} "
        f"{'other ' if held_out else ''}shape(s) measured on this device"
    )


def measurement_header(ctx: RunContext, signature: DeviceSignature) -> dict:
    """What every cached measurement file of this run's shape on this device begins with."""
    return {
        "format": PRICES_FORMAT,
        "signature": vars(signature),
        "shape": vars(Shape.of(ctx.run.model, ctx.run.train.micro_batch_size)),
        "created": datetime.now(UTC).isoformat(timespec="seconds"),
    }


def _measure(ctx: RunContext, signature: DeviceSignature, profile: DeviceProfile | None) -> dict:
    """The stage's prices, timed on the rank's own intra-op threads."""
    shape = Shape.of(ctx.run.model, ctx.run.train.micro_batch_size)
    transfer, link_rate = (None, None) if profile is None else link_seconds(profile, shape, ctx.target)
    threads = torch.get_num_threads()
    torch.set_num_threads(signature.threads or threads)
    try:
        measured = measure_stage_prices(ctx.run.model, ctx.shape, transfer, link_rate, ctx.run.train.compile)
    finally:
        torch.set_num_threads(threads)
    return {
        "replays": measured.replays,
        "wall_s": measured.wall_s,
        "seconds": vars(measured.seconds),
        "compiled": ctx.run.train.compile,  # the curves' corrections learn from eager prices only
    }


MEASURED, RACED = "measured", "raced"
"""How measure_once found a file that was not there: this process wrote it, or another run wrote it first."""


def measure_once(path: Path, local_rank: int, record: dict, measure: Callable[[], dict]) -> str | None:
    """A measurement cached in one file that every rank reads alike: when `path` is missing, local rank 0 runs
    `measure()` and writes its fields into `record` (or `failed` with the error: the waiting ranks must learn it too,
    and read it alike) while the other ranks wait for the file. Returns MEASURED, RACED (another run wrote it at the
    same moment: its content stands) or None (it was there)."""
    if path.exists():
        return None
    if local_rank != 0:
        _wait_for(path)
        return None
    try:
        record.update(measure())
    except Exception as error:
        record["failed"] = f"{type(error).__name__}: {error}"
    record["load"] = list(os.getloadavg())
    path.parent.mkdir(parents=True, exist_ok=True)
    return MEASURED if write_json_once(path, record) else RACED


def _wait_for(path: Path) -> None:
    """Until local rank 0 has written the file (it measures before any process group exists, so no collective can
    carry it)."""
    deadline = time.monotonic() + WAIT_S
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"local rank 0 wrote no measurement to {path} within {WAIT_S:.0f} s")
        time.sleep(0.2)


def _memory_bytes() -> int:
    """The machine's memory: every rank reads the same (the memory free at this moment would differ between ranks, and
    a rank that refused to measure would plan from other prices)."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _same_device_anywhere(path: Path, ctx: RunContext) -> DeviceSignature:
    """A dry run for a device this machine lacks may be priced by a profile measured on one: it must be that kind
    of device at the run's precision (its name, threads and torch are the profile's own)."""
    try:
        signature = DeviceSignature(**json.loads(path.read_text())["signature"])
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise ProfileRefused(f"device profile {path} is damaged ({error!r})") from None
    target = ctx.target
    return DeviceSignature(target.device, signature.device_name, signature.threads, signature.torch, target.precision)
