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
full and nested segments, compressed stashes where allowed; under recompute.per_micro_batch also each of them for k of
the micro-batches the chunk holds in flight at once, the others keeping none's bytes). Every combination of the rank's
chunks' candidates (one per chunk) is priced at once (`RankPeak.grid_peaks`: the walk's few linear moments, the largest
backward working set on top, as arrays with one axis per chunk), and the least summed cost that fits wins (each
candidate's recompute cost per micro-batch of the step), ties to the smaller peak. Exact: no combination is left out,
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
    in_flight: tuple[int, ...]
    """Per chunk: the most micro-batches it holds in flight (what a choice for some of them counts from)."""

    def line(self) -> str:
        """The dry run's and the start-up print's line."""
        plans = " + ".join(_counted(c, n) for c, n in zip(self.choice, self.in_flight))
        return (
            f"rank {self.stage} (virtual stages {', '.join(map(str, self.virtual_stages))}): {plans} | planned peak "
            f"{gib_text(self.peak_bytes)} of {gib_text(self.budget_bytes)} GiB | floor {gib_text(self.least_bytes)} GiB"
        )


def _counted(choice: StageChoice, in_flight: int) -> str:
    counts: dict[str, int] = {}
    for block in choice.choices:
        counts[block] = counts.get(block, 0) + 1
    some = "" if choice.micro_batches is None else f" for {choice.micro_batches} of {in_flight} in flight"
    return "[" + (", ".join(f"{n} x {c}" for c, n in counts.items()) or "no blocks") + some + "]"


class RankPeak:
    """A rank's planned peak under any combination of its chunks' choices."""

    def __init__(self, walk: RankWalk, sides: Sequence[ChunkSide], run: RunShape, per_micro_batch: bool = False):
        """`per_micro_batch`: recompute.per_micro_batch (the chunks may also recompute for some of their in-flight
        micro-batches)."""
        self.walk, self.sides = walk, sides
        self.micro_batches, self.per_micro_batch = run.micro_batches, per_micro_batch
        self.fixed = sum(side.fixed for side in sides)
        # after every backward: the rank's ReduceGrads and optimizer step, over all its chunks' parameters at once
        self.optimizer = rank_step_bytes(
            [side.largest for side in sides],
            [side.params for side in sides],
            run.target,
            run.zero_stage,
            run.topology.data_parallel_size,
        )
        # per chunk, (rows, k): how many of its micro-batches in flight at each of the walk's rows a plan for k of
        # them recomputes (the last column: all of them; the only one without per-micro-batch recompute)
        self.rows = walk.rows_by_micro_batch if per_micro_batch else walk.rows
        self.counts = [np.array([counts[c] for counts, _ in self.rows], dtype=np.int64) for c in range(len(sides))]
        self.held = [held for _, held in self.rows]

    def candidates(self, early: Sequence[bool], some: bool = False) -> list[Candidates]:
        """Per chunk: its candidates (ChunkSide.candidates; `early[c]`: chunk c recomputes early where its choice can)
        and, with `some` and per-micro-batch recompute, those for k of its in-flight micro-batches
        (ChunkSide.some_micro_batches, never early: early recompute remakes every micro-batch)."""
        out = [side.candidates(e) for side, e in zip(self.sides, early)]
        if not (some and self.per_micro_batch):
            return out
        most = self.walk.moments.most_in_flight
        out = [c + side.some_micro_batches(p, self.micro_batches) for c, side, p in zip(out, self.sides, most)]
        return [self._undominated(chunk, c) for chunk, c in enumerate(out)]

    def _undominated(self, chunk: int, candidates: Candidates) -> Candidates:
        """`candidates` less those another keeps no more at any of the walk's rows, works no more and costs no more
        (ties: the first): the rank's peak grows with each, so a beaten one never fits where its better does not."""
        terms = self.terms(chunk, candidates)
        order = np.lexsort((candidates.work, terms.sum(axis=1), candidates.cost))
        kept: list[int] = []
        for i in order:
            if kept:
                at = np.array(kept)
                beaten = (terms[at] <= terms[i]).all(axis=1) & (candidates.work[at] <= candidates.work[i])
                if beaten.any():
                    continue
            kept.append(i)
        return candidates.subset(np.array(sorted(kept), dtype=np.int64))

    def bytes(self, choices: Sequence[StageChoice], early: Sequence[bool] | None = None) -> int:
        """The rank's planned peak under `choices`, one per chunk; `early[c]`: chunk c recomputes early where its
        choice can (ChunkSide.early_work); None: none does."""
        early = early or [False] * len(self.sides)
        parts = [side.parts(c, e) for side, c, e in zip(self.sides, choices, early)]
        return self.fixed + max(self._activations(parts) + max(work for _, work, _ in parts), self.optimizer)

    def activation_bytes(self, choices: Sequence[StageChoice]) -> int:
        """The rank's walked activations between instructions under `choices` (`bytes` adds the working set)."""
        return self._activations([side.parts(c) for side, c in zip(self.sides, choices)])

    def _activations(self, parts: Sequence[tuple[int, int, int]]) -> int:
        """The largest of the walk's rows with each chunk's ChunkSide.parts (a scalar `terms`: bytes asks it for one
        combination, often, where numpy's overhead would dominate)."""
        plain = [side.plain[0] for side in self.sides]
        return max(
            [0]
            + [
                held + sum(n[k] * kept + (n[-1] - n[k]) * p for n, (kept, _, k), p in zip(counts, parts, plain))
                for counts, held in self.rows
            ]
        )

    def terms(self, chunk: int, candidates: Candidates) -> np.ndarray:
        """(candidates, rows): what chunk `chunk`'s micro-batches in flight keep at each of the walk's rows under each
        of its `candidates` (those a candidate does not recompute keep none's bytes)."""
        counts = self.counts[chunk]
        recomputed = counts[:, candidates.recomputed].T
        return recomputed * candidates.kept[:, None] + (counts[:, -1] - recomputed) * self.sides[chunk].plain[0]

    def grid_peaks(self, terms: Sequence[np.ndarray], work: Sequence[np.ndarray]) -> np.ndarray:
        """The planned peak of every combination of the chunks' options (chunk c's keep `terms[c]` at each of the
        walk's rows, RankPeak.terms, and work `work[c]`), one axis per chunk: [i, j, ...] for the first's option i, the
        second's option j, .... The walk's peak is the largest of its rows."""
        axes = len(terms)
        activations = np.zeros([t.shape[0] for t in terms], dtype=np.int64)
        for row, held in enumerate(self.held):
            moment = sum(_along(t[:, row], axis, axes) for axis, t in enumerate(terms)) + held
            np.maximum(activations, moment, out=activations)
        largest_work = functools.reduce(np.maximum, (_along(w, axis, axes) for axis, w in enumerate(work)))
        return self.fixed + np.maximum(activations + largest_work, self.optimizer)

    def candidates_peaks(self, candidates: Sequence[Candidates]) -> np.ndarray:
        """`grid_peaks` of the chunks' candidates (`candidates[c]`: chunk c's), with the working sets they were chosen
        by."""
        return self.grid_peaks([self.terms(c, cs) for c, cs in enumerate(candidates)], [c.work for c in candidates])


def _along(values: np.ndarray, axis: int, axes: int) -> np.ndarray:
    """`values` as an array of `axes` axes that varies along `axis` only (for broadcasting)."""
    return values.reshape([-1 if a == axis else 1 for a in range(axes)])


def _least(peak: RankPeak, early: Sequence[bool], nested: bool = True) -> int:
    """The smallest peak of any combination of the chunks' choices (nested ones where `nested`; `early`: as
    RankPeak.bytes). Recomputing for some micro-batches never keeps less than for all: those are left out."""
    return int(peak.candidates_peaks([side.candidates(e, nested) for side, e in zip(peak.sides, early)]).min())


def choose_rank(
    peak: RankPeak, budget: float, early: Sequence[bool], some: bool = False
) -> tuple[tuple[StageChoice, ...], float] | None:
    """The cheapest combination of the rank's chunks' choices (one each) whose planned peak fits `budget` (ties: the
    smaller peak), and its recompute cost per micro-batch of the step; `early[c]`: chunk c recomputes early where its
    choice can; `some`: RankPeak.candidates'. Two shortcuts keep it exact: each chunk's cheapest choice, where it is
    the only one that cheap and together they fit, is the answer; and a choice that cannot fit whatever the other
    chunks choose (`_may_fit`) is no candidate."""
    candidates = peak.candidates(early, some)
    cheapest = [np.flatnonzero(c.cost == c.cost.min()) for c in candidates]
    if all(len(at) == 1 for at in cheapest):
        choice = tuple(c.choices[at[0]] for c, at in zip(candidates, cheapest))
        if peak.bytes(choice, early) <= budget:
            return choice, float(sum(c.cost.min() for c in candidates))
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
    return tuple(c.choices[i] for c, i in zip(candidates, at)), float(least)


def _may_fit(peak: RankPeak, candidates: Sequence[Candidates], budget: float) -> list[Candidates]:
    """Each chunk's candidates less those whose peak exceeds `budget` even with every other chunk at its least at each
    of the walk's rows and its least working set (a lower bound of any combination holding them)."""
    terms = [peak.terms(c, cs) for c, cs in enumerate(candidates)]
    least_terms = [t.min(axis=0, keepdims=True) for t in terms]
    least_work = [c.work.min(keepdims=True) for c in candidates]
    out = []
    for i, c in enumerate(candidates):
        mine = [terms[i] if j == i else t for j, t in enumerate(least_terms)]
        work = [c.work if j == i else w for j, w in enumerate(least_work)]
        out.append(c.subset(np.flatnonzero(peak.grid_peaks(mine, work).reshape(-1) <= budget)))
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
        peak = RankPeak(walk, sides, run, planner.recompute.per_micro_batch)
        early = tuple(planner.recompute.early is not False and v < len(stages) - 1 for v in walk.virtual_stages)
        late = (False,) * chunks
        floor_early = early if planner.recompute.early is True else late  # the floor of the setting that must hold
        choice, early = _rank_choice(_RankKey(planner, compositions, walk.split, peak.rows, early, peak))
        budgets.append(
            RankBudget(
                rank,
                walk.virtual_stages,
                int(planner.usable),
                choice,
                None if choice is None else peak.bytes(choice, early=early),
                _least(peak, floor_early) if floors else None,
                _least(peak, floor_early, nested=False) if floors else None,
                walk.moments.most_in_flight,
            )
        )
        for v, side, c, e, most in zip(walk.virtual_stages, sides, choice or (), early, walk.moments.most_in_flight):
            plan = to_stage_plan(c, side.positions, planner.table, most)
            plans[v] = replace(plan, early=e and c in side.early_work)
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
    """The rank's choice and which of its chunks recompute early (plan_ranks' rules). Recomputing for some micro-batches
    (never early) is weighed only where early recompute is not chosen: it may recompute less than an early choice but
    in the wait that early recompute fills, which the rank's own peak cannot tell."""
    peak, planner, early = key.peak, key.planner, key.early
    late = (False,) * len(early)
    choice = choose_rank(peak, planner.usable, late) if planner.recompute.early is not True else None
    if any(early):
        early_choice = choose_rank(peak, planner.usable, early)
        if early_choice is not None and (choice is None or early_choice[1] <= choice[1]):
            return early_choice[0], early
    if choice is not None and peak.per_micro_batch:
        choice = choose_rank(peak, planner.usable, late, some=True)
    return (None if choice is None else choice[0]), late
