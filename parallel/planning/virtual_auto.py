"""`+recompute=auto` under a schedule with virtual stages: each rank's chunks planned together against the rank's
budget, since they share its memory.

A rank's planned peak is its chunks' states and causal masks, then the larger of its walked activation peak
(parallel/planning/virtual_memory.py's RankWalk, each chunk keeping what its plan keeps per micro-batch) with the
largest of its chunks' backward working sets on top (virtual_memory.micro_batch_bytes of the chunk's plan, the
schedule's B under a split backward, counted whenever it runs), and what comes after every backward (the rank's
ReduceGrads and optimizer step over all its chunks' parameters: model_states.rank_step_bytes); it must fit
recompute.budget_gb - recompute.reserve_gb. That bounds the walk `virtual_plan` reports, which counts each working
set only inside its own backward.

Per chunk the candidates are parallel/planning/chunk_candidates.py's (auto_recompute.stage_choices: per-block choices,
full and nested segments, compressed stashes where allowed; not per-micro-batch recompute, which the walk does not
count). Every combination of the rank's
chunks' candidates (one per chunk) is priced at once (`RankPeak.grid_peaks`: the walk's few linear moments, the largest
backward working set on top, as arrays with one axis per chunk), and the least summed cost that fits wins (cost per
micro-batch: every chunk runs every micro-batch), ties to the smaller peak. Exact: no combination is left out,
whatever early recompute does to a choice's working set (recomputed early, a choice's backward holds more the less
it keeps, so no frontier of kept bytes and cost would be safe); tests/test_virtual_layout.py checks it against
RankPeak.bytes of every combination on a small model.
"""

import functools
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import numpy as np

from parallel.planning.auto_recompute import StageChoice, to_stage_plan
from parallel.planning.chunk_candidates import Candidates, ChunkSide, Composition, side_of
from parallel.planning.model_states import rank_step_bytes
from parallel.planning.partition import StageRange
from parallel.planning.shapes import RunShape, gib_text
from parallel.planning.stage_plan import StagePlan
from parallel.planning.stage_planner import StagePlanner
from parallel.planning.virtual_memory import RankWalk, rank_walks
from parallel.planning.virtual_program import UNIT_SLOTS, Slots


@dataclass(frozen=True)
class RankBudget:
    """One rank's side of the budget under auto per chunk. BudgetTooSmall reads it as a stage's StageBudget."""

    stage: int
    """The pipeline rank."""
    virtual_stages: tuple[int, ...]
    budget_bytes: int
    choice: tuple[StageChoice, ...] | None
    """Each chunk's plan, in chunk order; None: no combination fits."""
    peak_bytes: int | None
    """The rank's planned peak under `choice`."""
    least_bytes: int | None
    """The smallest peak any combination of its chunks' plans reaches on this rank; None: not asked for
    (plan_ranks' `floors`)."""
    least_bytes_unnested: int | None
    """The smallest without nested segments."""

    def line(self) -> str:
        """The dry run's and the start-up print's line."""
        plans = " + ".join(_counted(c.choices) for c in self.choice)
        return (
            f"rank {self.stage} (virtual stages {', '.join(map(str, self.virtual_stages))}): {plans} | planned peak "
            f"{gib_text(self.peak_bytes)} of {gib_text(self.budget_bytes)} GiB | floor {gib_text(self.least_bytes)} GiB"
        )


def _counted(choices: Sequence[str]) -> str:
    counts: dict[str, int] = {}
    for choice in choices:
        counts[choice] = counts.get(choice, 0) + 1
    return "[" + (", ".join(f"{n} x {c}" for c, n in counts.items()) or "no blocks") + "]"


class RankPeak:
    """A rank's planned peak under any combination of its chunks' choices."""

    def __init__(self, walk: RankWalk, sides: Sequence[ChunkSide], run: RunShape):
        self.walk, self.sides = walk, sides
        self.fixed = sum(side.fixed for side in sides)
        # after every backward: the rank's ReduceGrads and optimizer step, over all its chunks' parameters at once
        self.optimizer = rank_step_bytes(
            [side.largest for side in sides],
            [side.params for side in sides],
            run.target,
            run.zero_stage,
            run.topology.data_parallel_size,
        )

    def bytes(self, choices: Sequence[StageChoice], early: Sequence[bool] | None = None) -> int:
        """`early[c]`: chunk c recomputes early where its choice can (ChunkSide.early_work); None: none does."""
        early = early or [False] * len(self.sides)
        activations = self.walk.peak_bytes([side.kept(c) for side, c in zip(self.sides, choices)])
        work = max(side.work(c, e) for side, c, e in zip(self.sides, choices, early))
        return self.fixed + max(activations + work, self.optimizer)

    def grid_peaks(self, kept: Sequence[np.ndarray], work: Sequence[np.ndarray]) -> np.ndarray:
        """`bytes` of every combination of the chunks' options (chunk c's keep `kept[c]` per micro-batch and work
        `work[c]`), one axis per chunk: [i, j, ...] for the first's option i, the second's option j, .... The walk's
        peak is the largest of its linear moments (RankWalk.rows), each such an array here."""
        axes = len(kept)
        kept = [_along(k, axis, axes) for axis, k in enumerate(kept)]
        activations = np.zeros([k.size for k in kept], dtype=np.int64)
        for counts, held in self.walk.rows:
            moment = sum(n * k for n, k in zip(counts, kept)) + held
            np.maximum(activations, moment, out=activations)
        largest_work = functools.reduce(np.maximum, (_along(w, axis, axes) for axis, w in enumerate(work)))
        return self.fixed + np.maximum(activations + largest_work, self.optimizer)

    def candidates_peaks(self, candidates: Sequence[Candidates]) -> np.ndarray:
        """`grid_peaks` of the chunks' candidates (`candidates[c]`: chunk c's), with the working sets they were chosen
        by."""
        return self.grid_peaks([c.kept for c in candidates], [c.work for c in candidates])


def _along(values: np.ndarray, axis: int, axes: int) -> np.ndarray:
    """`values` as an array of `axes` axes that varies along `axis` only (for broadcasting)."""
    return values.reshape([-1 if a == axis else 1 for a in range(axes)])


def _least(peak: RankPeak, early: Sequence[bool], nested: bool = True) -> int:
    """The smallest peak of any combination of the chunks' choices (nested ones where `nested`; `early`: as
    RankPeak.bytes)."""
    return int(peak.candidates_peaks([side.candidates(e, nested) for side, e in zip(peak.sides, early)]).min())


def choose_rank(peak: RankPeak, budget: float, early: Sequence[bool]) -> tuple[StageChoice, ...] | None:
    """The cheapest combination of the rank's chunks' choices (one each) whose planned peak fits `budget` (ties: the
    smaller peak); `early[c]`: chunk c recomputes early where its choice can. Two shortcuts keep it exact: each
    chunk's cheapest choice, where it is the only one that cheap and together they fit, is the answer; and a choice
    that cannot fit whatever the other chunks choose (`_may_fit`) is no candidate."""
    candidates = [side.candidates(e) for side, e in zip(peak.sides, early)]
    cheapest = [np.flatnonzero(c.cost == c.cost.min()) for c in candidates]
    if all(len(at) == 1 for at in cheapest):
        choice = tuple(c.choices[at[0]] for c, at in zip(candidates, cheapest))
        if peak.bytes(choice, early) <= budget:
            return choice
    candidates = _may_fit(peak, candidates, budget)
    if any(not c.choices for c in candidates):
        return None
    peaks = peak.candidates_peaks(candidates)
    summed = sum(_along(c.cost, axis, len(candidates)) for axis, c in enumerate(candidates))
    costs = np.where(peaks <= budget, summed, np.inf)
    least = costs.min()
    if least == np.inf:
        return None
    at = np.unravel_index(np.where(costs == least, peaks, np.iinfo(np.int64).max).argmin(), peaks.shape)
    return tuple(c.choices[i] for c, i in zip(candidates, at))


def _may_fit(peak: RankPeak, candidates: Sequence[Candidates], budget: float) -> list[Candidates]:
    """Each chunk's candidates less those whose peak exceeds `budget` even with every other chunk at its least kept
    bytes and working set (a lower bound of any combination holding them: the walk's moments count micro-batches
    in flight, never negative)."""
    least_kept = [c.kept.min(keepdims=True) for c in candidates]
    least_work = [c.work.min(keepdims=True) for c in candidates]
    out = []
    for i, c in enumerate(candidates):
        kept = [c.kept if j == i else k for j, k in enumerate(least_kept)]
        work = [c.work if j == i else w for j, w in enumerate(least_work)]
        out.append(c.subset(np.flatnonzero(peak.grid_peaks(kept, work).reshape(-1) <= budget)))
    return out


def plan_ranks(
    planner: StagePlanner,
    stages: Sequence[StageRange],
    schedule: str,
    chunks: int,
    slots: Slots = UNIT_SLOTS,
    floors: bool = True,
) -> tuple[list[StagePlan], list[RankBudget]]:
    """Each virtual stage's plan (none where its rank fits no combination) and each rank's RankBudget, `stages` being
    the virtual stages in pipeline order, `chunks` per rank, planned by `planner` (auto, for the virtual stages' run),
    the programmes laid out in `slots`. Under recompute.early=true every chunk that recomputes does it early (but the
    last virtual stage's, nested and compressed ones); under null (auto's default) a rank's chunks do where that fits
    at no more recompute than without (early recompute never lengthens the simulated step: it only moves the recompute
    ahead of the wait for the gradient); under false none does. `floors`: each RankBudget's smallest peaks too (a
    search that only asks whether a rank fits leaves them out: each prices every combination of the candidates)."""
    pricing = planner.pricing
    run = pricing.run
    walks = rank_walks(pricing.recipes, stages, schedule, chunks, run.micro_batches, pricing.shape, run.target, slots)
    plans = [StagePlan()] * len(stages)
    budgets = []
    for rank, walk in enumerate(walks):
        compositions = tuple(Composition.of(pricing.recipes, stages[v]) for v in walk.virtual_stages)
        sides = [side_of(planner, composition, walk.split) for composition in compositions]
        peak = RankPeak(walk, sides, run)
        early = tuple(planner.recompute.early is not False and v < len(stages) - 1 for v in walk.virtual_stages)
        late = (False,) * chunks
        floor_early = early if planner.recompute.early is True else late  # the floor of the setting that must hold
        choice, early = _rank_choice(_RankKey(planner, compositions, walk.split, walk.rows, early, peak))
        budgets.append(
            RankBudget(
                rank,
                walk.virtual_stages,
                int(planner.usable),
                choice,
                None if choice is None else peak.bytes(choice, early=early),
                _least(peak, floor_early) if floors else None,
                _least(peak, floor_early, nested=False) if floors else None,
            )
        )
        for v, side, c, e in zip(walk.virtual_stages, sides, choice or (), early):
            plans[v] = replace(to_stage_plan(c, side.positions, planner.table), early=e and c in side.early_work)
    return plans, budgets


@dataclass(frozen=True)
class _RankKey:
    """What a rank's choice depends on: its chunks' compositions under the schedule's backward, its walk's moments and
    which chunks may recompute early (a search of the chunk boundaries meets the same rank again and again)."""

    planner: StagePlanner
    compositions: tuple[Composition, ...]
    split: bool
    rows: tuple[tuple[tuple[int, ...], int], ...]
    early: tuple[bool, ...]
    peak: RankPeak = field(compare=False)
    """The rank's peak for this key (any rank of the key: all price alike)."""


@functools.lru_cache(maxsize=4096)
def _rank_choice(key: _RankKey) -> tuple[tuple[StageChoice, ...] | None, tuple[bool, ...]]:
    """The rank's choice and which of its chunks recompute early (plan_ranks' rules)."""
    peak, planner, early = key.peak, key.planner, key.early
    late = (False,) * len(early)
    choice = choose_rank(peak, planner.usable, late) if planner.recompute.early is not True else None
    if any(early):
        early_choice = choose_rank(peak, planner.usable, early)
        if early_choice is not None and (choice is None or _cost(early_choice) <= _cost(choice)):
            return early_choice, early
    return choice, late


def _cost(choice: tuple[StageChoice, ...]) -> float:
    return sum(c.cost for c in choice)
