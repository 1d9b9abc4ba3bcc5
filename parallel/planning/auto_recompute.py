"""Stage-aware automatic recompute: per stage, the cheapest per-block choices that fit a memory budget.

Under 1F1B, stage i keeps the activations of more micro-batches in flight than stage i+1, so each stage
gets its own plan. For a stage with n (identical) blocks the choices are, per block, `none` or one of the
selective combinations, or membership of a full-recompute segment (segments never cross the stage
boundary). The stage fits when its predicted peak (parallel/planning/stage_bytes.py's, the one tensor_peak measures)

    params + grads + optimizer + DeepSpeed's buffers + causal masks + in_flight x (other layers + kept block bytes)
      + the backward's working set  <=  budget - reserve

and the plan minimises the summed recompute cost. The working set is the largest of what the stage's last block
holds in its backward (its choice's, or a full segment's with what the segment remakes; the blocks before it have
less around them) and what no choice changes (the loss's backward; the first stage's embedding backward, which
comes once the micro-batch's blocks are freed): parallel/planning/working_set.py's StageWorking.

Algorithm (exact for this model). Blocks of a stage are identical, so a plan is characterised by m, the
blocks under full recompute, split into k segments (nested or not: nesting costs a forward of each segment's blocks
but its last, and is a candidate only where it lowers the segments' working set and BlockPrices.nesting allows it),
and the multiset of per-block choices of the other n - m blocks (BlockPrices.options: under train.compile only the
options a compiled block was measured with). Memory and cost are additive over blocks, so for every (m, k) we need the
cheapest multiset of n - m per-block choices whose kept bytes stay under what is left. A dynamic programme over the
number of blocks builds the Pareto frontier (kept bytes, cost) of those multisets (each frontier is at most a
few hundred points here); each (m, k) then takes the frontier's cheapest point that fits (a binary
search). The working set is the largest among the chosen blocks', so the search runs once per class of
choices whose working set is at most w, for each w a choice has, with w counted as the blocks' (the
optimum is the cheapest of the classes' optima), and the plan puts its block of the largest working set
last. Enumerating every class, every m <= n and k <= m and every frontier point is exhaustive over the
characterisation, hence optimal; the cost is O(W n^2 C) for the frontiers (W classes, C choices per block)
plus O(W n^2 log F) for the search.
"""

import bisect
import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import NamedTuple

from parallel.planning.block_prices import BlockOption, BlockPrices
from parallel.planning.stage_plan import StagePlan
from parallel.planning.working_set import StageWorking, nested_remade_bytes


@dataclass(frozen=True)
class StageChoice:
    choices: tuple[str, ...]
    """One per block of the stage, in order: `none`, `selective:<modules>`, `full` or `nested`."""
    segments: tuple[tuple[int, int], ...]
    """Block-index ranges [start, stop) of the full-recompute segments (relative to the stage's blocks)."""
    kept_bytes: int
    """What the blocks keep per micro-batch."""
    working_bytes: int
    """The most the blocks' backward holds beyond what they keep: the last block's (working_set.StageWorking), a
    full segment's with what it remakes (0 without blocks)."""
    cost: float
    """Recompute cost of one micro-batch that runs under the choice."""
    micro_batches: int | None = None
    """Run the choice for only this many of the stage's in-flight micro-batches (StagePlan.micro_batches);
    None: for all of them."""
    plain_kept_bytes: int = 0
    """What the blocks keep per micro-batch that runs with no recompute (when `micro_batches` is set)."""
    plain_working_bytes: int = 0
    """`working_bytes` of such a micro-batch (none's)."""
    nested: bool = False
    """The segments are nested (StagePlan.nested): a choice only where that lowers the segments' working set."""
    compress: str = "none"
    """The segments' inputs are stored compressed (StagePlan.compress): only with BlockPrices.stash."""


def _pareto(options: Sequence[BlockOption]) -> list[BlockOption]:
    """Drop choices another choice beats on both bytes and cost: an optimal plan never uses them."""
    kept = []
    for option in sorted(options, key=lambda o: (o.kept_bytes, o.cost)):
        if not kept or option.cost < kept[-1].cost:
            kept.append(option)
    return kept


@functools.lru_cache(maxsize=256)
def _frontiers(n: int, options: tuple[BlockOption, ...]) -> list[list[tuple[int, float, tuple[int, ...]]]]:
    """frontier[r]: Pareto points (kept bytes asc, cost desc, counts per option) of r blocks' choices.
    Cached: the balanced partition asks for the same block counts on every stage."""
    frontier = [[(0, 0.0, (0,) * len(options))]]
    for _ in range(n):
        candidates = sorted(
            (kept + option.kept_bytes, cost + option.cost, counts[:i] + (counts[i] + 1,) + counts[i + 1 :])
            for kept, cost, counts in frontier[-1]
            for i, option in enumerate(options)
        )
        pruned = []
        for point in candidates:
            if not pruned or point[1] < pruned[-1][1]:
                pruned.append(point)
        frontier.append(pruned)
    return frontier


def _classes(table: BlockPrices) -> list[tuple[float, tuple[BlockOption, ...]]]:
    """(w, the Pareto choices whose working set is at most w), for each working set a choice has: a plan's blocks
    hold the largest working set among their choices, so the optimum is the best of the classes' optima."""
    levels = sorted({option.working_bytes for option in table.options})
    return [(w, tuple(_pareto([o for o in table.options if o.working_bytes <= w]))) for w in levels]


def _segment_moment(table: BlockPrices, size: int, nested: bool, compressed: bool, fresh: bool = False) -> float:
    """The working set of a segment of `size` blocks in its backward: it remakes what its blocks keep under none, less
    the input it keeps anyway (a compressed input is a copy: the input is remade beside it); nested, only the blocks'
    inputs and one block's interior (working_set.nested_remade_bytes at its last block). `fresh`: its output gradient
    is a fresh tensor, counted by the caller (BlockOption.fresh_working_bytes)."""
    if not size:
        return -math.inf
    none = table.options[0]
    none_working = none.fresh_working_bytes if fresh else none.working_bytes
    block, segment_input = table.block_bytes, table.segment_input_bytes
    reused = 0 if compressed else segment_input
    if nested:
        return none_working + nested_remade_bytes(size - 1, block, segment_input, reused)
    return none_working + size * block - reused


def _segment_sizes(m: int, k: int) -> list[int]:
    """m blocks in k segments as even as can be (none longer than ceil(m / k)), the longest last."""
    return [m // k] * (k - m % k) + [m // k + 1] * (m % k) if m else []


def _segments_moment(table: BlockPrices, m: int, k: int, nested: bool, compressed: bool, ends_stage: bool) -> float:
    """The segments' largest working set: the last segment's; stored compressed on a stage whose blocks end it
    (`ends_stage`: StageWorking.blocks_end_stage), the one before it holds a fresh gradient of its output, which the
    last block's is not, while the last segment has freed only a compressed input, so it can be larger."""
    sizes = _segment_sizes(m, k)
    if not sizes:
        return -math.inf
    moment = _segment_moment(table, sizes[-1], nested, compressed)
    if compressed and ends_stage and len(sizes) > 1:
        grown = table.segment_input_bytes - table.stash[1]  # the incoming gradient less the freed compressed input
        moment = max(moment, _segment_moment(table, sizes[-2], nested, compressed, fresh=True) + grown)
    return moment


def _segments_cost(table: BlockPrices, m: int, k: int, nested: bool) -> float:
    """m blocks in k segments; nested, each segment's recompute stops before its last block and every block is then
    remade on its own (flops.nested_segment_recompute_flops)."""
    if nested:
        return (2 * m - k) * table.full_block_cost - m * table.segment_discount
    return m * table.full_block_cost - k * table.segment_discount


def _candidates(n: int, table: BlockPrices, ends_stage: bool):
    """Every plan worth considering: (the choices of the other blocks, their frontier, full blocks m, segments k,
    the blocks' largest working set, the segments' kept bytes, the full part's cost, nested, compressed).
    `ends_stage`: StageWorking.blocks_end_stage."""
    stashes = [(False, table.segment_input_bytes)] + ([(True, table.stash[1])] if table.stash else [])
    for level, (w, options) in enumerate(_classes(table)):
        frontiers = _frontiers(n, options)
        for m in range(n + 1):
            if m == n and level:  # every block full: the class of the other blocks does not matter
                continue
            for k in [0] if m == 0 else range(1, m + 1):
                size = math.ceil(m / k) if m else 0
                for compressed, stored in stashes if m else stashes[:1]:
                    plain = _segments_moment(table, m, k, False, compressed, ends_stage)
                    for nested in (False, True) if table.nesting else (False,):
                        segment = _segments_moment(table, m, k, nested, compressed, ends_stage)
                        if nested and (size < 2 or segment >= plain):  # nesting only where it lowers the peak
                            continue
                        moment = max(w if m < n else -math.inf, segment)
                        cost = _segments_cost(table, m, k, nested)
                        if compressed:
                            cost += k * table.compress_cost(table.stash[0])
                        yield options, frontiers[n - m], m, k, moment, k * stored, cost, nested, compressed


class StageFloors(NamedTuple):
    """The smallest footprint of a stage's plans, by what they may use: what the in-flight micro-batches' blocks
    keep, and the backward's working set (StageWorking.bytes). Equal where a technique lowers nothing (compression
    where the table has no stash: it was not allowed)."""

    least: int
    """Any plan."""
    unnested: int
    """Plans without nested segments (compressed ones too)."""
    exact: int
    """Plans without compressed stashes (nested ones too)."""
    today: int
    """Plans with neither."""


def least_stage_bytes(n: int, table: BlockPrices, in_flight: int, working: StageWorking) -> StageFloors:
    """The StageFloors of a stage of n blocks."""
    least = {(nested, compressed): math.inf for nested in (False, True) for compressed in (False, True)}
    for _, frontier, _, _, moment, full_kept, _, nested, compressed in _candidates(n, table, working.blocks_end_stage):
        key = (nested, compressed)
        least[key] = min(least[key], working.bytes(full_kept + frontier[0][0], in_flight, moment))
    return StageFloors(
        int(min(least.values())),
        int(min(least[False, False], least[False, True])),
        int(min(least[False, False], least[True, False])),
        int(least[False, False]),
    )


def choose_stage(
    n: int, table: BlockPrices, in_flight: int, byte_budget: float, working: StageWorking, floor: float = -math.inf
) -> StageChoice | None:
    """The cheapest plan for n blocks whose in-flight micro-batches' kept bytes and working set (working.bytes) fit
    byte_budget, or None; `floor`: a working set the stage's blocks hold whatever the plan (the plain micro-batches'
    of a per-micro-batch plan). Ties go to fewer bytes, then to exact storage."""
    best = None
    candidates = _candidates(n, table, working.blocks_end_stage)
    for options, frontier, m, k, moment, full_kept, full_cost, nested, compressed in candidates:
        moment = max(moment, floor)
        limit = working.kept_limit(byte_budget, in_flight, moment) - full_kept
        index = bisect.bisect_right(frontier, (limit, math.inf)) - 1
        if index < 0:
            continue
        kept, cost, counts = frontier[index]
        key = (full_cost + cost, in_flight * (full_kept + kept), compressed)
        if best is None or key < best[0]:
            best = (key, options, m, k, kept + full_kept, counts, (nested, compressed))
    if best is None:
        return None
    (cost, _, _), options, m, k, kept, counts, segment_kind = best
    return _arranged(table, options, m, k, kept, counts, cost, *segment_kind, working.blocks_end_stage)


def _arranged(
    table: BlockPrices,
    options,
    m: int,
    k: int,
    kept: int,
    counts,
    cost: float,
    nested: bool,
    compressed: bool,
    ends_stage: bool,
) -> StageChoice:
    """The choice's blocks in order, the one with the largest working set last: the stage's last block has the
    least freed around its backward (StageWorking), so there its working set is the stage's, as auto counted it."""
    sizes = _segment_sizes(m, k)
    segment = _segments_moment(table, m, k, nested, compressed, ends_stage)
    others = sorted(
        (option for option, count in zip(options, counts) for _ in range(count)), key=lambda o: o.working_bytes
    )
    moment = max([segment] + [o.working_bytes for o in others])
    segments_last = bool(m) and (not others or segment >= others[-1].working_bytes)
    start = len(others) if segments_last else 0
    bounds, segments = start, []
    for length in sizes:
        segments.append((bounds, bounds + length))
        bounds += length
    choices = [o.choice for o in others]
    choices[start:start] = ["nested" if nested else "full"] * m
    compress = table.stash[0] if compressed else "none"
    return StageChoice(
        tuple(choices), tuple(segments), kept, int(max(moment, 0)), cost, nested=nested, compress=compress
    )


def stage_choices(n: int, table: BlockPrices, ends_stage: bool) -> list[StageChoice]:
    """Every plan of n blocks `choose_stage` weighs (each class, m, k, segment kind and frontier point), arranged as
    it arranges its pick: what a rank of a schedule with virtual stages chooses its chunks' plans among
    (parallel/planning/virtual_auto.py). `ends_stage`: StageWorking.blocks_end_stage."""
    out = []
    for options, frontier, m, k, _, full_kept, full_cost, nested, compressed in _candidates(n, table, ends_stage):
        for kept, cost, counts in frontier:
            out.append(
                _arranged(
                    table, options, m, k, kept + full_kept, counts, full_cost + cost, nested, compressed, ends_stage
                )
            )
    return out


def choose_stage_micro_batches(
    n: int, table: BlockPrices, in_flight: int, micro_batches: int, byte_budget: float, working: StageWorking
) -> StageChoice | None:
    """`choose_stage` with per-micro-batch recompute: for each k of the in-flight micro-batches, the
    cheapest plan for the k recomputed ones while the other in_flight - k keep what `none` keeps (and their
    backward holds none's working set), priced by the recompute of a whole step (k's plan runs on
    StagePlan.recomputes_micro_batch's share of the step's micro-batches). The least recompute time wins; ties go
    to more micro-batches (k = in_flight is choose_stage's own plan)."""
    plain = n * table.block_bytes
    best, best_time = None, None
    for k in range(in_flight, 0, -1):
        floor = table.options[0].working_bytes if k < in_flight and n else -math.inf
        choice = choose_stage(n, table, k, byte_budget - (in_flight - k) * plain, working, floor)
        if choice is None:
            continue
        time = choice.cost * StagePlan(micro_batches=k, in_flight=in_flight).recomputed_count(micro_batches)
        if best_time is None or time < best_time:
            best, best_time = choice, time
            if k < in_flight:
                best = replace(choice, micro_batches=k, plain_kept_bytes=plain, plain_working_bytes=int(max(floor, 0)))
    return best


def to_stage_plan(
    choice: StageChoice, block_positions: Sequence[int], table: BlockPrices, in_flight: int | None = None
) -> StagePlan:
    """The StagePlan (local layer indices) that carries out a StageChoice; `in_flight` (the stage's) is
    needed when the choice recomputes for only some micro-batches."""
    modules = {option.choice: option.modules for option in table.options}
    return StagePlan(
        segments=tuple((block_positions[a], block_positions[b - 1] + 1) for a, b in choice.segments),
        nested=choice.nested,
        compress=choice.compress,
        selective={block_positions[i]: modules[c] for i, c in enumerate(choice.choices) if c.startswith("selective:")},
        micro_batches=choice.micro_batches,
        in_flight=in_flight if choice.micro_batches is not None else None,
    )


@dataclass(frozen=True)
class StageBudget:
    """One stage's side of the budget: what is fixed, and what its blocks chose."""

    stage: int
    budget_bytes: int
    """What the stage may use: recompute.budget_gb - recompute.reserve_gb."""
    in_flight: int
    fixed_bytes: int
    """Parameters, gradients, optimizer state, DeepSpeed's buffers, the causal masks and the other layers'
    in-flight activations (StageMemory.fixed_bytes)."""
    working: StageWorking
    """The stage's side of the backward's working set."""
    choice: StageChoice | None
    least_bytes: int
    """The smallest peak any plan reaches on this stage."""
    least_bytes_unnested: int
    """The smallest peak a plan without nested segments reaches: above `least_bytes` where only nesting reaches it."""
    least_bytes_exact: int
    """The smallest peak a plan without compressed stashes reaches: above `least_bytes` where only
    recompute.compress (lossy, when allowed) reaches it."""
    least_bytes_today: int
    """The smallest peak a plan with neither nesting nor compression reaches."""

    @property
    def predicted_peak_bytes(self) -> int | None:
        """The stage's peak under 1F1B by auto's count: StageMemory.predicted_peak_bytes of the plan, counted by parts
        (with per-micro-batch recompute a bound on it: a recomputed micro-batch may run its backward in the drain,
        with fewer micro-batches in flight than the count assumes)."""
        if self.choice is None:
            return None
        c = self.choice
        k = StagePlan(micro_batches=c.micro_batches).recomputed_in_flight(self.in_flight)
        moment = max(c.working_bytes, c.plain_working_bytes) if k < self.in_flight else c.working_bytes
        plain = (self.in_flight - k) * c.plain_kept_bytes
        return self.fixed_bytes + plain + self.working.bytes(c.kept_bytes, k, moment)
