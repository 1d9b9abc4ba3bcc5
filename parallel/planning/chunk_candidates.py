"""A chunk's side of auto per chunk (parallel/planning/virtual_auto.py): the plans it may run
(auto_recompute.stage_choices), what each keeps per micro-batch and allocates in its backward under the schedule's
backward (virtual_memory.micro_batch_bytes), and the candidates no cheaper choice beats on both. Chunks of one
composition (their layers' kinds, and whether they end the pipeline) share one ChunkSide: the chunk boundaries' search
plans chunks of the same few kinds again and again."""

import bisect
import functools
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import numpy as np

from model import BLOCK_CLASSES, LayerRecipe
from parallel.planning.auto_recompute import StageChoice, stage_choices, to_stage_plan
from parallel.planning.memory_model import is_head
from parallel.planning.model_states import largest_parameter
from parallel.planning.partition import StageRange
from parallel.planning.stage_plan import StagePlan
from parallel.planning.stage_planner import StagePlanner
from parallel.planning.stage_price import price_stage
from parallel.planning.virtual_memory import micro_batch_bytes
from parallel.planning.working_set import stage_working

ALL_MICRO_BATCHES = -1
"""`Candidates.recomputed` of a choice that runs every micro-batch: the last of RankWalk.rows' counts per chunk."""


@dataclass(frozen=True)
class Candidates:
    """A chunk's choices worth pricing, and what each keeps per micro-batch it recomputes, its backward's working set
    and its recompute cost per micro-batch of the step."""

    choices: tuple[StageChoice, ...]
    kept: np.ndarray
    work: np.ndarray
    cost: np.ndarray
    recomputed: np.ndarray
    """Per choice: for how many of the chunk's in-flight micro-batches it recomputes (StageChoice.micro_batches; the
    others keep `none`'s bytes), or ALL_MICRO_BATCHES."""

    def subset(self, at: np.ndarray) -> "Candidates":
        """The candidates at indices `at`."""
        choices = tuple(self.choices[i] for i in at)
        return Candidates(choices, self.kept[at], self.work[at], self.cost[at], self.recomputed[at])

    def __add__(self, other: "Candidates") -> "Candidates":
        arrays = (np.concatenate((a, b)) for a, b in zip(self._arrays(), other._arrays()))
        return Candidates(self.choices + other.choices, *arrays)

    def _arrays(self) -> tuple[np.ndarray, ...]:
        return self.kept, self.work, self.cost, self.recomputed


@dataclass(frozen=True)
class ChunkSide:
    """What one chunk brings to its rank's peak whatever its plan, and the plans it may run."""

    positions: tuple[int, ...]
    """Its blocks' local layer indices."""
    fixed: int
    """Its parameters, gradients, optimizer state and causal masks."""
    largest: int
    """Elements of its largest parameter (model_states.largest_parameter)."""
    params: int
    """Its parameters (StageMemory.params)."""
    choices: tuple[StageChoice, ...]
    per_micro_batch: dict[StageChoice, tuple[int, int]]
    """Per choice: what a micro-batch keeps from its forward to its backward, and what its backward allocates on top
    (virtual_memory.micro_batch_bytes of its plan under the schedule's backward, split into B and W or not)."""
    plain: tuple[int, int]
    """What a micro-batch that runs with no recompute keeps, and what its backward allocates on top."""
    early_work: dict[StageChoice, int]
    """Per choice that can recompute early (it recomputes, all its micro-batches, no nested segment, no compressed
    stash): its backward's working set when the recompute ran as a RecomputeEarly right before it (what the recompute
    remade, then `none`'s working set), as virtual_memory.micro_batch_bytes counts it."""
    frontiers: dict[tuple[bool, bool], "Candidates"] = field(default_factory=dict, compare=False, repr=False)
    """`candidates`' answers, computed once."""

    def kept(self, choice: StageChoice) -> int:
        """What the chunk keeps per micro-batch under `choice`."""
        return self.per_micro_batch[choice][0]

    def candidates(self, early: bool, nested: bool = True) -> "Candidates":
        """The choices (nested ones where `nested`) that no other beats: none keeps no more, works no more (`early`:
        recomputed early) and costs no more. A rank's peak grows with a chunk's kept bytes and its working set, so a
        beaten choice never fits where the one beating it does not, nor costs less."""
        key = (early, nested)
        if key not in self.frontiers:
            priced = sorted(
                (c.cost, self.kept(c), self.work(c, early), n, c)
                for n, c in enumerate(self.choices)
                if nested or not c.nested
            )
            # the (kept, work) staircase of the cheaper choices kept so far: kept ascending, work descending
            stair_kept: list[int] = []
            stair_work: list[int] = []
            chosen = []
            for cost, kept, work, _, c in priced:
                i = bisect.bisect_right(stair_kept, kept)
                if i and stair_work[i - 1] <= work:
                    continue  # a cheaper choice keeps no more and works no more
                chosen.append((c, kept, work, cost))
                j = i
                while j < len(stair_kept) and stair_work[j] >= work:
                    j += 1  # beaten by this one from now on
                stair_kept[i:j], stair_work[i:j] = [kept], [work]
            columns = list(zip(*chosen))
            every = np.full(len(chosen), ALL_MICRO_BATCHES)
            self.frontiers[key] = Candidates(
                tuple(columns[0]),
                *(np.array(column, dtype=np.int64) for column in columns[1:3]),
                np.array(columns[3]),
                every,
            )
        return self.frontiers[key]

    def some_micro_batches(self, in_flight: int, micro_batches: int) -> Candidates:
        """Each candidate that recomputes (late: `candidates(False)`) for k = 1 .. `in_flight` - 1 of the
        chunk's in-flight micro-batches, the others running with no recompute (StagePlan.recomputes_micro_batch), as
        auto_recompute.choose_stage_micro_batches weighs them for one stage: its backward holds the larger of its
        plan's working set and none's, and it costs its share of the step's `micro_batches`."""
        late = self.candidates(False)
        out = []
        plain_kept, plain_work = self.plain
        for k in range(1, in_flight):
            share = StagePlan(micro_batches=k, in_flight=in_flight).recomputed_count(micro_batches) / micro_batches
            for choice, cost in zip(late.choices, late.cost):
                if cost > 0:
                    some = replace(choice, micro_batches=k, plain_kept_bytes=plain_kept, plain_working_bytes=plain_work)
                    kept, work, _ = self.parts(some)
                    out.append((some, kept, work, cost * share, k))
        columns = list(zip(*out)) or [()] * 5
        types = (np.int64, np.int64, np.float64, np.int64)
        return Candidates(tuple(columns[0]), *(np.array(c, dtype=t) for c, t in zip(columns[1:], types)))

    def parts(self, choice: StageChoice, early: bool = False) -> tuple[int, int, int]:
        """`choice` (one of `choices`, or of `some_micro_batches`'): what it keeps per micro-batch it recomputes, its
        backward's working set, and its Candidates.recomputed."""
        if choice.micro_batches is None:
            return self.kept(choice), self.work(choice, early), ALL_MICRO_BATCHES
        own = replace(choice, micro_batches=None, plain_kept_bytes=0, plain_working_bytes=0)
        return self.kept(own), max(self.work(own), self.plain[1]), choice.micro_batches

    def work(self, choice: StageChoice, early: bool = False) -> int:
        """Its backward's working set under `choice`; `early`: recomputed early where the choice can be."""
        if early and choice in self.early_work:
            return self.early_work[choice]
        return self.per_micro_batch[choice][1]


@dataclass(frozen=True)
class Composition:
    """What a chunk's memory depends on: its layers' kinds, in order, and whether it ends the pipeline (its loss)."""

    layers: tuple[tuple[type, bool], ...]
    """Per layer: its module class, and whether it runs as the LM head."""
    last: bool
    stage: StageRange = field(compare=False)
    """A chunk of this composition: the one priced, for all of them."""

    @classmethod
    def of(cls, recipes: Sequence[LayerRecipe], stage: StageRange) -> "Composition":
        kinds = tuple((recipes[flat].module_class, is_head(recipes[flat])) for flat in stage.layers)
        return cls(kinds, stage.stop == len(recipes), stage)


def chunk_side(planner: StagePlanner, stage: StageRange, split: bool) -> ChunkSide:
    """`split`: the schedule splits the backward into B and W (RankWalk.split). Chunks of one composition share one
    ChunkSide: the chunk boundaries' search (virtual_choice.py) plans chunks of the same few kinds again and again."""
    return side_of(planner, Composition.of(planner.pricing.recipes, stage), split)


@functools.lru_cache(maxsize=512)
def side_of(planner: StagePlanner, composition: Composition, split: bool) -> ChunkSide:
    """The ChunkSide of every chunk of `composition` (its `stage` priced for all of them)."""
    recipes, pricing, stage = planner.pricing.recipes, planner.pricing, composition.stage
    positions = tuple(local for local, flat in enumerate(stage.layers) if recipes[flat].module_class in BLOCK_CLASSES)
    memory = price_stage(pricing, stage, StagePlan()).memory
    working = stage_working(memory.plain_layers, pricing.shape, pricing.run.target)
    choices = tuple(stage_choices(len(positions), planner.table, working.blocks_end_stage))

    def per_micro_batch(choice: StageChoice, early: bool = False) -> tuple[int, int]:
        plan = to_stage_plan(choice, positions, planner.table)
        kept, work = micro_batch_bytes(recipes, stage, plan, pricing.shape, pricing.run.target, 1, split, early)
        return kept[0], work[0]

    plain = micro_batch_bytes(recipes, stage, StagePlan(), pricing.shape, pricing.run.target, 1, split)
    early_work = {
        c: per_micro_batch(c, early=True)[1]
        for c in choices
        if set(c.choices) - {"none"} and c.micro_batches is None and not c.nested and c.compress == "none"
    }
    return ChunkSide(
        positions,
        sum(memory.states.values()) + memory.causal_masks,
        largest_parameter(recipes, stage.layers, pricing.shape),
        memory.params,
        choices,
        {c: per_micro_batch(c) for c in choices},
        (plain[0][0], plain[1][0]),
        early_work,
    )
