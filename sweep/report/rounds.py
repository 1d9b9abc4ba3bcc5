"""Throughput over a sweep's rounds (`-m round=0,1,2 ...`): per setting, the median tokens/s, its spread, and the
overhead against the `none` job of each round; an overhead is called noise when it lies within the spread the
rounds show, or when the setting trained exactly what `none` did. One round gives no spread: the report says so
rather than present a single measurement as a difference."""

import statistics
from dataclasses import dataclass

from sweep.report.loading import Job
from sweep.report.table import baseline_of, baselines, same_plan, shape_key


@dataclass(frozen=True)
class SettingRounds:
    variant: str
    jobs: tuple[Job, ...]
    tokens_per_s: tuple[float, ...]
    """One per round, in round order."""
    overheads: tuple[float, ...]
    """Step time against the `none` job of the same round (and shape) - 1, one per round that has one."""
    noise: float | None
    """The largest relative spread of the rounds' tokens/s (max / min - 1), this setting's or its `none`'s; None
    with one round."""
    same_as_none: bool

    @property
    def median_tokens_per_s(self) -> float:
        return statistics.median(self.tokens_per_s)

    @property
    def spread(self) -> float | None:
        """max / min - 1 of the rounds' tokens/s; None with one round."""
        if len(self.tokens_per_s) < 2:
            return None
        return max(self.tokens_per_s) / min(self.tokens_per_s) - 1.0

    @property
    def median_overhead(self) -> float | None:
        return statistics.median(self.overheads) if self.overheads else None

    @property
    def verdict(self) -> str:
        overhead = self.median_overhead
        if self.variant == "none" or overhead is None:
            return ""
        if self.same_as_none:
            return "noise: the same plan as none"
        if self.noise is None:
            return "one round: spread unknown"
        if abs(overhead) <= self.noise:
            return f"within noise ({self.noise:.1%} spread)"
        return "beyond the spread"


def setting_rounds(jobs: list[Job]) -> list[SettingRounds]:
    """Every setting (recompute variant at one shape and partition) that trained, with its rounds."""
    done = [j for j in jobs if j.status == "done" and j.tokens_per_s]
    groups: dict[tuple, list[Job]] = {}
    for job in done:
        groups.setdefault((shape_key(job), job.variant, job.partition()), []).append(job)
    base = baselines(jobs)
    nones = {key[0]: members for key, members in groups.items() if key[1] == "none"}
    out = []
    for (shape, variant, _), members in groups.items():
        members.sort(key=lambda j: j.round)
        overheads, alike = [], []
        for job in members:
            none = baseline_of(job, base)
            if none is not None and job.step_time_s and none.step_time_s:
                overheads.append(job.step_time_s / none.step_time_s - 1.0)
            alike.append(same_plan(job, none))
        spreads = [_spread(members)] + ([_spread(nones[shape])] if shape in nones else [])
        known = [s for s in spreads if s is not None]
        out.append(
            SettingRounds(
                variant,
                tuple(members),
                tuple(j.tokens_per_s for j in members),
                tuple(overheads),
                max(known) if known else None,
                bool(alike) and all(alike),
            )
        )
    return out


def _spread(jobs: list[Job]) -> float | None:
    speeds = [j.tokens_per_s for j in jobs if j.tokens_per_s]
    return max(speeds) / min(speeds) - 1.0 if len(speeds) > 1 else None
