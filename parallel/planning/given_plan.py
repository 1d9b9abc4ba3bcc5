"""+recompute=plan: the per-stage plan a plan.json holds (a dry run's or a run's: parallel/planning/plan_record.py),
read and checked once at start-up. The layout then takes its stage boundaries and each stage's StagePlan instead of
choosing them (parallel/planning/layout.py, parallel/planning/stage_planner.py), so every rank trains the plan the file
holds, whatever its own prices would choose."""

import functools
import json
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from parallel.planning.config import COMPRESS_FORMATS, RECOMPUTE_MODULES
from parallel.planning.partition import StageRange
from parallel.planning.stage_plan import StagePlan


@dataclass(frozen=True)
class GivenPlan:
    file: str
    parts: tuple[int, ...]
    """Each stage's first layer, then one past the last."""
    plans: tuple[StagePlan, ...]
    """Each stage's plan by local layer index; `in_flight` unset (the run's schedule sets it)."""

    def check_run(self, layers: int, stages: int) -> None:
        """The file plans this run's model (`layers` flat layers) on its `stages` pipeline stages."""
        if len(self.plans) != stages:
            raise ValueError(
                f"recompute.file={self.file} plans {len(self.plans)} pipeline stages and this run has {stages}: set "
                f"parallel.pipeline_stages={len(self.plans)}, or dry-run a plan for {stages} stages"
            )
        if self.parts[-1] != layers:
            raise ValueError(
                f"recompute.file={self.file} plans {self.parts[-1]} layers and this run's model has {layers}: give "
                f"the model the plan was made for, or dry-run a plan for this one"
            )

    def stage_plan(self, stage: StageRange, is_block: Sequence[bool], in_flight: int) -> StagePlan:
        """`stage`'s plan, checked against its layers (`is_block`, by local index), with `in_flight` set where it
        recomputes for some micro-batches only."""
        held = self.parts[stage.stage], self.parts[stage.stage + 1]
        if held != (stage.start, stage.stop):
            raise ValueError(
                f"recompute.file={self.file} plans stage {stage.stage} on layers [{held[0]}, {held[1]}) and this run's "
                f"stage {stage.stage} holds [{stage.start}, {stage.stop}) (a resume keeps its checkpoint's stages): "
                f"give a plan with this run's stage boundaries"
            )
        plan = self.plans[stage.stage]
        in_segments = [i for start, stop in plan.segments for i in range(start, stop)]
        planned = in_segments + list(plan.selective)
        if len(set(planned)) < len(planned) or any(not 0 <= i < len(is_block) or not is_block[i] for i in planned):
            raise ValueError(
                f"recompute.file={self.file}: stage {stage.stage}'s plan recomputes layers that are not blocks of the "
                f"stage, or one block twice: give a plan.json that train.py wrote"
            )
        return replace(plan, in_flight=in_flight if plan.micro_batches is not None else None)


@functools.cache
def read_given_plan(file: str) -> GivenPlan:
    """The plan `file` holds, or a ValueError naming recompute.file and what is wrong with it."""
    path = Path(file)
    if not path.is_file():
        raise ValueError(
            f"recompute.file={file} is not a file: give the plan.json a dry run (dry_run=true) or a run wrote"
        )
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(
            f"recompute.file={file} is not a JSON file ({error}): give a plan.json train.py wrote"
        ) from None
    if not isinstance(data, dict) or not isinstance(data.get("stages"), list) or not data["stages"]:
        raise ValueError(f"recompute.file={file} holds no `stages`: give a plan.json train.py wrote")
    if data.get("virtual"):
        raise ValueError(
            f"recompute.file={file} plans a schedule with virtual stages, which +recompute=plan cannot run yet: "
            f"give a plan dry-run with parallel.schedule=1f1b or zb-h1"
        )
    parts, plans = [0], []
    for index, stage in enumerate(data["stages"]):
        try:
            start, stop = stage["layers"]
            record = stage["plan"]
            plans.append(_stage_plan(record))
        except (KeyError, TypeError, ValueError) as error:
            raise ValueError(
                f"recompute.file={file}: stage {index} has no readable `plan` ({type(error).__name__}: {error}); "
                f"plan.json files written before plans were recorded lack it: dry-run the plan again"
            ) from None
        if start != parts[-1] or stop <= start:
            raise ValueError(f"recompute.file={file}: stage {index}'s layers [{start}, {stop}) do not follow on")
        parts.append(stop)
    return GivenPlan(file, tuple(parts), tuple(plans))


def _stage_plan(record: dict) -> StagePlan:
    """A StagePlan from StagePlan.to_record's data; ValueError where a value is not one a plan can hold."""
    segments = tuple((int(start), int(stop)) for start, stop in record["segments"])
    if any(stop <= start for start, stop in segments):
        raise ValueError(f"empty segment in {segments}")
    selective = {int(index): tuple(modules) for index, modules in record["selective"].items()}
    unknown = {m for modules in selective.values() for m in modules} - set(RECOMPUTE_MODULES)
    if unknown:
        raise ValueError(f"unknown modules {sorted(unknown)}: allowed are {', '.join(RECOMPUTE_MODULES)}")
    if record["compress"] not in COMPRESS_FORMATS:
        raise ValueError(f"compress {record['compress']!r}: allowed are {', '.join(COMPRESS_FORMATS)}")
    micro_batches = record["micro_batches"]
    if micro_batches is not None and (not isinstance(micro_batches, int) or micro_batches < 1):
        raise ValueError(f"micro_batches {micro_batches!r}: a positive integer or null")
    return StagePlan(
        segments=segments,
        nested=bool(record["nested"]),
        compress=record["compress"],
        selective=selective,
        micro_batches=micro_batches,
    )
