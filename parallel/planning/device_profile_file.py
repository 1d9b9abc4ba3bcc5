"""A device profile as planning reads it: measured seconds of each kind of kernel as a curve over its size, the
signature of the device that measured them, and the checks that refuse a profile of another device, of an older
format, or one that is damaged.

Written by `python -m parallel.measurement.device_profile`; priced into a block's costs by
parallel/planning/curve_seconds.py. Pure: JSON and arithmetic; the signature of this machine's device is read by
parallel/runtime/device_signature.py.
"""

import bisect
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

FORMAT = 2
"""Bumped whenever the curves change meaning or a curve is added: an older profile is stale and refused.
2: the Llama block's curves (RMSNorm, the rotary embedding, the SwiGLU product, grouped-query attention)."""

CURVES = {
    "matmul": "FLOPs of one (M, K) x (K, N) matmul (2 M K N)",
    "layernorm": "elements normalised (forward)",
    "layernorm_backward": "elements normalised (backward)",
    "gelu": "elements (forward)",
    "gelu_backward": "elements (backward)",
    "dropout": "elements (forward: draw the mask and apply it)",
    "dropout_backward": "elements (backward: apply the kept mask)",
    "add": "elements (a residual add: two reads, one write)",
    "embedding": "elements gathered (token ids x width)",
    "embedding_backward": "elements scattered back into the table's gradient",
    "rmsnorm": "elements normalised by model/rms_norm.py's RMSNorm (forward)",
    "rmsnorm_backward": "elements normalised by RMSNorm (backward)",
    "rotary": "elements rotated by model/rotary.py's apply_rotary (forward)",
    "rotary_backward": "elements rotated (backward)",
    "swiglu": "elements of the SwiGLU product silu(gate) * up (forward)",
    "swiglu_backward": "elements of the SwiGLU product (backward)",
    "loss_chunked": "tokens x width x vocabulary: the fused LM head and loss (forward)",
    "loss_chunked_backward": "tokens x width x vocabulary: the fused LM head and loss (backward)",
    "loss_unfused": "tokens x width x vocabulary: the LM head, then cross-entropy over whole logits (forward)",
    "loss_unfused_backward": "tokens x width x vocabulary (backward)",
    "adamw": "parameters stepped",
}
HEAD_SIZES = (32, 128)
"""Head sizes the attention curves are measured at: at a given number of score elements, attention costs its
matmuls (in proportion to the head size) plus its passes over the scores (not), so a head size between or beyond
them is priced by linear interpolation (DeviceProfile.attention_seconds)."""


GQA_GROUPS = 2
"""Query heads per key/value head of the grouped-query attention curves: the explicit kernel repeats k and v to
every query head and SDPA reads them grouped, so at given score elements the cost hardly depends on the ratio."""


def attention_curve(kernel: str, dropout: bool, head_size: int, grouped: bool = False) -> str:
    """The forward curve of model.attention=`kernel` with dropout on or off, at one of HEAD_SIZES; `grouped`:
    grouped-query attention (fewer key/value heads than query heads, model.arch=llama, which has no dropout)."""
    return f"attention_{kernel}" + ("_gqa" if grouped else "") + ("_dropout" if dropout else "") + f"_hs{head_size}"


CURVES.update(
    {
        attention_curve(kernel, dropout, head_size) + part: f"score elements, b x heads x s x s ({what}, head size "
        f"{head_size})"
        for kernel in ("sdpa", "math")
        for dropout in (False, True)
        for head_size in HEAD_SIZES
        for part, what in (("", "forward"), ("_backward", "backward"))
    }
)
CURVES.update(
    {
        attention_curve(kernel, False, head_size, grouped=True) + part: f"score elements, b x query heads x s x s "
        f"({what}, head size {head_size}, {GQA_GROUPS} query heads per key/value head)"
        for kernel in ("sdpa", "math")
        for head_size in HEAD_SIZES
        for part, what in (("", "forward"), ("_backward", "backward"))
    }
)
"""Every curve a profile holds (the attention kernels' by head size): its name and what its x-axis counts. The
y-axis is seconds."""
LINK_CURVES = {"p2p": "bytes sent one way between two ranks", "allreduce": "bytes all-reduced by two ranks"}
"""Curves measured by two processes; a device measured alone (one GPU) has none, and the link is then analytic."""


CACHE_ENV = "STAGECHECK_PROFILE_DIR"
"""Where profiles are cached, one file per device signature (default: ~/.cache/stagecheck/device_profiles)."""


def cache_dir() -> Path:
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "stagecheck" / "device_profiles")


class ProfileRefused(ValueError):
    """A profile that cannot price this run: its message says why and how to make a good one."""


@dataclass(frozen=True)
class Curve:
    """Seconds as a function of size, from measured (size, seconds) points: linear interpolation between them
    (exact where a kernel costs a launch plus its work at a steady rate; left-one-out on a CPU profile it missed
    by less than log-log interpolation did); above the largest, the largest point's rate (seconds grow in
    proportion); below the smallest, the smallest point's seconds (a kernel's launch cost is its floor)."""

    points: tuple[tuple[float, float], ...]

    @classmethod
    def of(cls, points) -> "Curve":
        """Sorted by size, each point's seconds lowered to the least of any larger size: a larger size never costs
        less, and on a loaded machine noise only adds time (a point measured slow must not make the planner prefer
        larger work)."""
        ordered, least = [], math.inf
        for size, seconds in sorted(((float(x), float(y)) for x, y in points), reverse=True):
            least = min(least, seconds)
            ordered.append((size, least))
        return cls(tuple(reversed(ordered)))

    def __call__(self, size: float) -> float:
        xs = [x for x, _ in self.points]
        if size <= xs[0]:
            return self.points[0][1]
        if size >= xs[-1]:
            return self.points[-1][1] * size / xs[-1]
        i = bisect.bisect_right(xs, size)
        (x0, y0), (x1, y1) = self.points[i - 1], self.points[i]
        return y0 + (size - x0) / (x1 - x0) * (y1 - y0)


@dataclass(frozen=True)
class DeviceSignature:
    """What a profile is valid for: the same device, intra-op threads, torch and precision."""

    device: str
    """`cpu` or `cuda`."""
    device_name: str
    """The GPU's name, or the CPU's model name."""
    threads: int
    """Intra-op threads of the measuring process (a rank's share of the node's cores)."""
    torch: str
    precision: str

    def file_name(self) -> str:
        """The profile's name in the cache folder: readable, and distinct for every signature."""
        name = "".join(c if c.isalnum() else "-" for c in self.device_name).strip("-").lower()
        return f"{self.device}-{name}-{self.threads}t-torch{self.torch.split('+')[0]}-{self.precision}.json"

    def differences(self, other: "DeviceSignature") -> list[str]:
        return [f"{k} {getattr(other, k)!r} (this run: {v!r})" for k, v in vars(self).items() if getattr(other, k) != v]


@dataclass(frozen=True)
class CostSource:
    """Which costs priced a plan (plan.json, the dry run, summary.json)."""

    kind: str
    """`measured` (the run's stage timed at its shape), `profile` (a device profile's curves), `corrected_curves` (a
    profile's curves corrected by the shapes measured on this device) or `analytic` (FLOPs and bytes at realistic
    rates)."""
    path: str | None = None
    created: str | None = None
    """The profile's UTC time of measurement (ISO 8601)."""

    def describe(self) -> str:
        if self.kind == "measured":
            return f"measured at this shape: the stage replay's prices {self.path} (measured {self.created})"
        if self.kind == "profile":
            return f"device profile {self.path} (measured {self.created})"
        if self.kind == "corrected_curves":
            return f"device profile {self.path} (measured {self.created}) corrected by the shapes measured here"
        return "analytic (no device profile: FLOPs and bytes at realistic rates of the target)"


ANALYTIC = CostSource("analytic")


@dataclass(frozen=True)
class DeviceProfile:
    signature: DeviceSignature
    created: str
    curves: dict[str, Curve]
    source: CostSource

    def seconds(self, curve: str, size: float) -> float:
        return self.curves[curve](size)

    def attention_seconds(
        self, kernel: str, dropout: bool, scores: float, head_size: int, backward: bool, grouped: bool = False
    ) -> float:
        """The attention core over `scores` score elements at `head_size` (`grouped`: with fewer key/value heads
        than query heads): linear in the head size between (and beyond) HEAD_SIZES' curves; below the smallest,
        the smallest's."""
        low, high = HEAD_SIZES
        at = [
            self.seconds(attention_curve(kernel, dropout, hs, grouped) + "_backward" * backward, scores)
            for hs in HEAD_SIZES
        ]
        if head_size <= low:
            return at[0]
        return at[0] + (at[1] - at[0]) * (head_size - low) / (high - low)

    @property
    def has_links(self) -> bool:
        return all(name in self.curves for name in LINK_CURVES)


def profile_json(
    signature: DeviceSignature, created: str, points: dict[str, list[tuple[float, float]]], load: tuple = ()
) -> dict:
    """A profile as written to disk. `load`: the machine's 1-minute load average before and after measuring (a CPU
    profile measured beside other work is slower than the device: the file says so; no check reads it)."""
    return {"format": FORMAT, "signature": vars(signature), "created": created, "load": list(load), "curves": points}


def read_profile(path: Path, expected: DeviceSignature) -> DeviceProfile:
    """The profile at `path`, or ProfileRefused saying what is wrong: not readable JSON, an older format (stale),
    a curve missing or malformed (damaged), or measured on another device, thread count, torch or precision
    (foreign)."""
    rebuild = f"rebuild it with `python -m parallel.measurement.device_profile --out {path}`"
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ProfileRefused(f"device profile {path} is unreadable ({error}): {rebuild}") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        found = data.get("format") if isinstance(data, dict) else None
        held = data.get("curves") if isinstance(data, dict) else None
        lacks = [name for name in CURVES if name not in held] if isinstance(held, dict) else []
        raise ProfileRefused(
            f"device profile {path} is stale (format {found!r}, this planner reads {FORMAT}"
            + (f"; it lacks the curves {', '.join(lacks)}" if lacks else "")
            + f"): {rebuild}"
        )
    try:
        signature = DeviceSignature(**data["signature"])
        curves = {name: _curve(points) for name, points in data["curves"].items()}
        created = str(data["created"])
    except (KeyError, TypeError, ValueError) as error:
        raise ProfileRefused(f"device profile {path} is damaged ({error!r}): {rebuild}") from None
    missing = [name for name in CURVES if name not in curves]
    if missing:
        raise ProfileRefused(f"device profile {path} is damaged: it lacks the curves {', '.join(missing)}: {rebuild}")
    differences = expected.differences(signature)
    if differences:
        raise ProfileRefused(
            f"device profile {path} is foreign: it was measured with {'; '.join(differences)}; profile this device "
            f"with `python -m parallel.measurement.device_profile` (it is cached per device signature)"
        )
    return DeviceProfile(signature, created, curves, CostSource("profile", str(path), created))


def _curve(points) -> Curve:
    """A curve of positive, finite (size, seconds) points (at least one)."""
    pairs = [(float(x), float(y)) for x, y in points]
    if not pairs or not all(math.isfinite(v) and v > 0 for pair in pairs for v in pair):
        raise ValueError(f"a curve needs positive, finite (size, seconds) points, not {points!r}")
    return Curve.of(pairs)
