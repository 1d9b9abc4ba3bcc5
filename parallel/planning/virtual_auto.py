"""`+recompute=auto` under a schedule with virtual stages: each rank's chunks planned together against the rank's
budget, since they share its memory.

A rank's planned peak is its chunks' states and causal masks, then the larger of its walked activation peak
(parallel/planning/virtual_memory.py's RankWalk, each chunk keeping its other layers' bytes and its blocks' choice's per
micro-batch) with the largest of its chunks' backward working sets on top (working_set.StageWorking, the 1F1B
backward's, counted whenever it runs), and what comes after every backward (ReduceGrads' flattened gradients of all
its chunks, each chunk's optimizer step); it must fit recompute.budget_gb - recompute.reserve_gb.

Per chunk the candidates are auto_recompute.stage_choices (per-block choices, full and nested segments, compressed
stashes where allowed; not per-micro-batch recompute, which the walk does not count), kept, per working set w a chunk's
blocks may hold, as the (kept bytes, cost) Pareto frontier of the choices whose working set is at most w (its class).
For each pair of classes, with each chunk's working set counted as its class's w, the peak grows with either chunk's
kept bytes, so one sweep finds every fitting pair worth having: the first chunk's points by kept bytes ascending, the
second's cheapest point that still fits moving only towards fewer bytes. The least summed cost wins (cost per
micro-batch: every chunk runs every micro-batch), ties to the smaller peak; a class pair, or a point, whose cheapest
pairing cannot beat the best so far is skipped. Exact under that monotonicity, as auto_recompute.choose_stage is;
tests/test_virtual_layout.py checks it against every pair of candidates on a small model.
"""

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

from model import BLOCK_CLASSES
from parallel.planning.auto_recompute import StageChoice, stage_choices, to_stage_plan
from parallel.planning.memory_model import checkpoint_rng_bytes
from parallel.planning.partition import StageRange
from parallel.planning.shapes import gib_text
from parallel.planning.stage_plan import StagePlan
from parallel.planning.stage_planner import StagePlanner
from parallel.planning.stage_price import price_stage
from parallel.planning.virtual_memory import RankWalk, rank_walks
from parallel.planning.virtual_program import UNIT_SLOTS, Slots
from parallel.planning.working_set import StageWorking, early_recompute_copies, stage_working


@dataclass(frozen=True)
class ChunkSide:
    """What one chunk brings to its rank's peak whatever its plan, and the plans it may run."""

    stage: StageRange
    positions: tuple[int, ...]
    """Its blocks' local layer indices."""
    others: int
    """What its other layers keep per micro-batch (its input included)."""
    fixed: int
    """Its parameters, gradients, optimizer state and causal masks."""
    optimizer: int
    """What its optimizer step allocates on top of the states."""
    reduce_grads: int
    """Its gradients as ReduceGrads flattens them, with the rank's other chunks' (StageMemory.reduce_grads)."""
    working: StageWorking
    choices: tuple[StageChoice, ...]
    rng_states: dict[StageChoice, int]
    """Per choice: what its checkpoints keep besides their inputs (memory_model.checkpoint_rng_bytes)."""
    early_work: dict[StageChoice, int]
    """Per choice that can recompute early (it recomputes, all its micro-batches, no nested segment, no compressed
    stash): its backward's working set when the recompute ran as a RecomputeEarly right before it (what the recompute
    remade, then `none`'s working set), as virtual_memory.micro_batch_bytes counts it."""

    def kept(self, choice: StageChoice) -> int:
        """What the chunk keeps per micro-batch under `choice` (virtual_memory.micro_batch_bytes of its plan)."""
        return self.others + choice.kept_bytes + self.rng_states[choice]

    @functools.cached_property
    def classes(self) -> list[tuple[int, list[StageChoice]]]:
        """(w, the (kept asc, cost desc) Pareto frontier of the choices whose working set is at most w), per w."""
        out = []
        for w in sorted({c.working_bytes for c in self.choices}):
            frontier: list[StageChoice] = []
            for c in sorted((c for c in self.choices if c.working_bytes <= w), key=lambda c: (c.kept_bytes, c.cost)):
                if not frontier or c.cost < frontier[-1].cost:
                    frontier.append(c)
            out.append((w, frontier))
        return out

    def bound(self, working_bytes: int) -> float:
        """The moment StageWorking counts for blocks whose working set is `working_bytes` (none without blocks)."""
        return working_bytes if self.positions else -math.inf

    def work(self, choice: StageChoice, moment: float | None = None, early: bool = False) -> int:
        """Its backward's working set under `choice` (`moment`: a bound on its blocks' largest, else the choice's);
        `early`: recomputed early where the choice can be."""
        if early and choice in self.early_work:
            return self.early_work[choice]
        return self.working.bytes(choice.kept_bytes, 0, self.bound(choice.working_bytes) if moment is None else moment)


@dataclass(frozen=True)
class RankBudget:
    """One rank's side of the budget under auto per chunk. BudgetTooSmall reads it as a stage's StageBudget."""

    stage: int
    """The pipeline rank."""
    virtual_stages: tuple[int, ...]
    budget_bytes: int
    choice: tuple[StageChoice, ...] | None
    """Each chunk's plan, in chunk order; None: no pair fits."""
    peak_bytes: int | None
    """The rank's planned peak under `choice`."""
    least_bytes: int
    """The smallest peak any pair of plans reaches on this rank."""
    least_bytes_unnested: int
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
    """A rank's planned peak under any pair of its chunks' choices."""

    def __init__(self, walk: RankWalk, sides: Sequence[ChunkSide]):
        self.walk, self.sides = walk, sides
        self.fixed = sum(side.fixed for side in sides)
        # After every backward: the rank's ReduceGrads flattens every chunk's gradients at once, then each chunk's
        # optimizer step runs its own transient.
        self.optimizer = max(max(side.optimizer for side in sides), sum(side.reduce_grads for side in sides))

    def bytes(
        self,
        choices: Sequence[StageChoice],
        moments: Sequence[float | None] = (None, None),
        early: Sequence[bool] = (False, False),
    ) -> int:
        """`early[c]`: chunk c recomputes early where its choice can (ChunkSide.early_work)."""
        activations = self.walk.peak_bytes([side.kept(c) for side, c in zip(self.sides, choices)])
        work = max(side.work(c, m, e) for side, c, m, e in zip(self.sides, choices, moments, early))
        return self.fixed + max(activations + work, self.optimizer)


@functools.lru_cache(maxsize=512)
def chunk_side(planner: StagePlanner, stage: StageRange) -> ChunkSide:
    """Cached: the chunk boundaries' search (virtual_choice.py) plans the same chunks again and again."""
    recipes, pricing = planner.pricing.recipes, planner.pricing
    run_target = pricing.run.target
    positions = tuple(local for local, flat in enumerate(stage.layers) if recipes[flat].module_class in BLOCK_CLASSES)
    memory = price_stage(pricing, stage, StagePlan()).memory
    working = stage_working(memory.plain_layers, pricing.shape, pricing.run.target)
    choices = tuple(stage_choices(len(positions), planner.table, working.blocks_end_stage))
    plain = len(positions) * planner.table.block_bytes
    nones = [c for c in choices if set(c.choices) <= {"none"}]
    early_work = {}
    for none in nones[:1]:  # a chunk without blocks has nothing to recompute
        none_work = working.bytes(none.kept_bytes, 0, none.working_bytes if positions else -math.inf)
        for c in choices:
            if set(c.choices) - {"none"} and c.micro_batches is None and not c.nested and c.compress == "none":
                copies = early_recompute_copies(to_stage_plan(c, positions, planner.table), pricing.shape, run_target)
                early_work[c] = plain - c.kept_bytes + copies + none_work
    return ChunkSide(
        stage,
        positions,
        sum(layer.bytes for layer in memory.layers if not layer.is_block),
        sum(memory.states.values()) + memory.causal_masks,
        memory.optimizer_step,
        memory.reduce_grads,
        working,
        choices,
        {c: checkpoint_rng_bytes(to_stage_plan(c, positions, planner.table), run_target) for c in choices},
        early_work,
    )


def _least(peak: RankPeak, choices: Sequence[Sequence[StageChoice]], early: Sequence[bool] = (False, False)) -> int:
    """The smallest peak of any pair of `choices[c]` (`early`: as RankPeak.bytes), among each chunk's choices those no
    other beats on both kept bytes and working set. Recomputed early, a choice's backward holds more the less it
    keeps, so that filter keeps nearly every choice: the pairs are then those of the filter without early recompute,
    a budget that fits (a pair reaches it), if not always the smallest."""

    def lowest(options: Sequence[StageChoice]) -> list[StageChoice]:
        out: list[StageChoice] = []
        for c in sorted(options, key=lambda c: (c.kept_bytes, c.working_bytes)):
            if not out or c.working_bytes < out[-1].working_bytes:
                out.append(c)
        return out

    firsts, seconds = (lowest(options) for options in choices)
    return min(peak.bytes((a, b), early=early) for a in firsts for b in seconds)


def choose_rank(
    peak: RankPeak, budget: float, early: Sequence[bool] = (False, False)
) -> tuple[StageChoice, StageChoice] | None:
    """The cheapest pair of the rank's chunks' choices whose planned peak fits `budget` (ties: the smaller peak);
    `early[c]`: chunk c recomputes early where its choice can. What a choice recomputed early adds to its backward
    shrinks as it keeps more, by no more than its kept bytes add to the rank's micro-batches in flight, so the peak
    still grows with either chunk's kept bytes and the sweep below stays exact."""
    first, second = peak.sides
    best: tuple[tuple[float, int], tuple[StageChoice, StageChoice]] | None = None
    # the widest classes first: their frontiers reach the cheapest plans, so the best found early prunes the rest
    for wa, frontier_a in reversed(first.classes):
        for wb, frontier_b in reversed(second.classes):
            if best is not None and frontier_a[-1].cost + frontier_b[-1].cost > best[0][0]:
                continue  # not even the class's cheapest pair beats the best
            bounds = (first.bound(wa), second.bound(wb))
            j = len(frontier_b) - 1
            for a in frontier_a:  # kept bytes ascending: the second chunk's room only shrinks
                if best is not None and a.cost + frontier_b[-1].cost > best[0][0]:
                    continue
                while j >= 0 and peak.bytes((a, frontier_b[j]), bounds, early) > budget:
                    j -= 1
                if j < 0:
                    break
                cost = a.cost + frontier_b[j].cost
                if best is None or cost <= best[0][0]:
                    key = (cost, peak.bytes((a, frontier_b[j]), early=early))
                    if best is None or key < best[0]:
                        best = (key, (a, frontier_b[j]))
    return None if best is None else best[1]


def plan_ranks(
    planner: StagePlanner, stages: Sequence[StageRange], schedule: str, slots: Slots = UNIT_SLOTS
) -> tuple[list[StagePlan], list[RankBudget]]:
    """Each virtual stage's plan (none where its rank fits no pair) and each rank's RankBudget, `stages` being the
    virtual stages in pipeline order, 2 per rank, planned by `planner` (auto, for the virtual stages' run), the
    programmes laid out in `slots`. Under recompute.early=true every chunk that recomputes does it early (but the last
    virtual stage's, nested and compressed ones); under null (auto's default) a rank's chunks do where that fits at no
    more recompute than without (early recompute never lengthens the simulated step: it only moves the recompute
    ahead of the wait for the gradient); under false none does."""
    pricing = planner.pricing
    run = pricing.run
    walks = rank_walks(pricing.recipes, stages, schedule, 2, run.micro_batches, pricing.shape, run.target, slots)
    plans = [StagePlan()] * len(stages)
    budgets = []
    for rank, walk in enumerate(walks):
        sides = [chunk_side(planner, stages[v]) for v in walk.virtual_stages]
        peak = RankPeak(walk, sides)
        wanted = planner.recompute.early
        early = tuple(wanted is not False and v < len(stages) - 1 for v in walk.virtual_stages)
        floor_early = early if wanted is True else (False, False)  # the floor of the setting that must hold
        choice = choose_rank(peak, planner.usable) if wanted is not True else None
        if any(early):
            early_choice = choose_rank(peak, planner.usable, early)
            if early_choice is not None and (choice is None or _cost(early_choice) <= _cost(choice)):
                choice = early_choice
            else:
                early = (False, False)
        unnested = [tuple(c for c in side.choices if not c.nested) for side in sides]
        budgets.append(
            RankBudget(
                rank,
                walk.virtual_stages,
                int(planner.usable),
                choice,
                None if choice is None else peak.bytes(choice, early=early),
                _least(peak, [side.choices for side in sides], floor_early),
                _least(peak, unnested, floor_early),
            )
        )
        for v, side, c, e in zip(walk.virtual_stages, sides, choice or (), early):
            plans[v] = replace(to_stage_plan(c, side.positions, planner.table), early=e and c in side.early_work)
    return plans, budgets


def _cost(choice: tuple[StageChoice, StageChoice]) -> float:
    return sum(c.cost for c in choice)
