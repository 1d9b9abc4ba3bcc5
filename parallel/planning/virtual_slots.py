"""The slots a run's virtual-stage programmes are laid out in (parallel/planning/virtual_program.py's Slots): from
measured prices, a forward's, a B's and a W's seconds over the model's layers without recompute, each a whole number
of the cheapest one's; unit slots otherwise.

The papers lay ZB-V out in unit slots (F = B = W), which a GPU's kernels roughly give. On this CPU a chunk's forward
costs about 3 W's and its B 2, and ZB-V's greedy order laid out in unit slots has ranks wait where the order assumed
equal work (docs/virtual_stages.md: by replay of traced steps, 8-11% of ZB-V's step at one shape). Only prices timed
on this device (the stage replay's, or a device profile's curves) set them: the analytic model's ratios between a
forward, a B and a W are calibrated against no device, and unit slots are the papers' choice."""

from collections.abc import Sequence

from parallel.planning.partition import StageRange
from parallel.planning.stage_plan import StagePlan
from parallel.planning.stage_price import StagePricing, price_stage
from parallel.planning.step_sim import StageCosts
from parallel.planning.virtual_program import UNIT_SLOTS, Slots

MAX_SLOTS = 4
"""The most slots one op takes: a programme's steps (and the walk's and the simulator's work) grow with them."""
_PARTS = ("ForwardPass", "BackwardInput", "BackwardWeight")


def priced_slots(costs: Sequence[StageCosts]) -> Slots:
    """Slots in the ratio of the summed forward, B and W seconds of `costs` (rounded, 1 to MAX_SLOTS); unit slots
    where one of them is not priced."""
    seconds = [sum(c.by_instruction()[part] for c in costs) for part in _PARTS]
    least = min(seconds)
    if least <= 0:
        return UNIT_SLOTS
    return Slots(*(min(MAX_SLOTS, max(1, round(s / least))) for s in seconds))


def stage_slots(pricing: StagePricing | None, stages: Sequence[StageRange]) -> Slots:
    """The slots of `stages` (a split of the whole model) priced without recompute by `pricing`, where its prices are
    measured (else unit slots). The sums run over every layer, so any split of the model gives the same ones."""
    if pricing is None or pricing.timing.source != "measured":
        return UNIT_SLOTS
    return priced_slots([price_stage(pricing, stage, StagePlan(), "1f1b").costs for stage in stages])
