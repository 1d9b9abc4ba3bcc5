"""What a resume may change: a checkpoint's saved configuration against this launch's, checked at start-up,
before any file is written.

The rule: every option must have its saved value, except those in MAY_CHANGE (how long to train, how often
to log, evaluate and save, the recompute plan and the pipeline schedule, the logger, the device, launch
mechanics). Those shape neither the weights nor the tokens nor the partition. The process grid and the precision
are compared as the run resolved them (`parallel.pipeline_stages=null` and `=2` may be the same grid). The layer
partition is the checkpoint's (harness/run_layout.py keeps it) unless parallel.partition_method changes; then the
new method's is compared once the plan is made (`check_partition`). Options naming a file or folder
(PATH_OPTIONS) are compared resolved: `data.path=corpus.txt` and the same file's absolute path are one value.

A changed train.steps re-stretches the learning-rate decay from the resumed step (parallel/runtime/lr_schedule.py).
"""

import os
import re
from pathlib import Path

import yaml

from data.config import data_identity
from harness.checkpoint import ResumePoint
from harness.context import Resume
from harness.relaunch import relaunch_command, with_ranks
from parallel.planning.shapes import RunShape
from parallel.runtime.lr_schedule import CosineSegment
from schema.run import RunConfig

MAY_CHANGE = frozenset(
    {
        "train.steps",
        "train.log_every",
        "train.eval_every",
        "train.eval_batches",
        "train.measure_step",
        "train.gc_interval",
        "train.trace_step",
        "train.peak_tflops",
        "train.save_every",
        "train.keep_checkpoints",
        "train.resume",
        "train.overwrite",
        "train.run_name",  # names the run directory: the run is the checkpoint's either way
        "train.collective_timeout_s",
        "train.nan_policy",
        "train.nan_skip_limit",
        "train.inject_nan_at_steps",
        "train.device",
        "train.device_profile",  # the costs: a resume keeps its partition (harness/run_layout.py)
        "train.device_memory_gb",  # the dry run's verdict only
        "train.precision",  # compared as resolved (auto is bf16 on cuda, fp32 on cpu)
        "parallel.pipeline_stages",  # the grid, compared as resolved
        "parallel.data_parallel_size",
        "parallel.schedule",
        "parallel.partition_method",  # the partition it plans is compared (check_partition)
        "model.init_from",  # read only by a fresh start
        "model.attention",  # kernels of the same computation
        "model.loss_chunk_tokens",
        "data.cache_dir",
        "dry_run",
        "round",  # a sweep's repetition index: training ignores it
    }
)
MAY_CHANGE_GROUPS = ("recompute", "logger")
"""Groups whose every option may change: the recompute plan (exact, the same losses) and where metrics go."""
STARTING = frozenset({"train.resume", "train.overwrite"})
"""Options that say where this launch starts from: a relaunch that continues the run leaves them out."""
NOT_RECORDED = STARTING | {"train.run_name"}
"""Options that say how this launch starts, not how the run trains: not listed as changes."""
PATH_OPTIONS = frozenset(
    {"data.path", "data.val_path", "data.tokenizer_file", "data.cache_dir", "model.init_from", "train.device_profile"}
)
"""Options naming a file or folder: compared resolved against this launch's working directory, so that a path
typed relative in one launch and absolute in the other is the same option."""
PATH_KEYWORDS = frozenset({"auto", "analytic"})
"""train.device_profile's values that name no file."""


def may_change(key: str) -> bool:
    return key in MAY_CHANGE or key.split(".")[0] in MAY_CHANGE_GROUPS


def comparable(key: str, value):
    """`value` as compared: a path option's path resolved (`~` expanded, symlinks followed), anything else as is."""
    if key not in PATH_OPTIONS or not isinstance(value, str) or not value or value in PATH_KEYWORDS:
        return value
    return str(Path(value).expanduser().resolve())


def absolute_paths(resolved: dict) -> dict:
    """The resolved config with each path option (PATH_OPTIONS) absolute, as config.yaml and stagecheck.json record
    it: a later launch from another directory compares the path the run used, not the same words resolved
    elsewhere."""
    out = {group: dict(values) if isinstance(values, dict) else values for group, values in resolved.items()}
    for key in PATH_OPTIONS:
        group, _, name = key.partition(".")
        if isinstance(out.get(group), dict) and name in out[group]:
            out[group][name] = comparable(key, out[group][name])
    return out


def check_data_identity(point: ResumePoint, run: RunConfig, saved: dict) -> None:
    """The tokens this launch reads against those the checkpoint trained on (data/config.py's data_identity)."""
    before = (point.meta.get("data") or {}).get("identity")
    now = data_identity(run.data)
    if before is None or now is None or before == now:
        return
    what = " and ".join(f"{k} {before.get(k)!r} -> {now.get(k)!r}" for k in now if before.get(k) != now.get(k))
    raise ValueError(
        f"data.path={run.data.path!r} holds other prepared data than the checkpoint {point.path} trained on "
        f"(stagecheck_data.json {what}): set data.path to the folder the run trained on (saved: "
        f"{saved.get('data', {}).get('path')!r}), or start a new run in a new hydra.run.dir"
    )


def flatten(tree, prefix: str = "") -> dict:
    """{"a": {"b": 1}} -> {"a.b": 1}; lists and None are values."""
    if not isinstance(tree, dict):
        return {prefix: tree}
    flat = {}
    for key, value in tree.items():
        flat.update(flatten(value, f"{prefix}{key}" if not prefix else f"{prefix}.{key}"))
    return flat


def saved_config(point: ResumePoint) -> dict | None:
    """The configuration the checkpoint's run trained with: stagecheck.json's, else (a checkpoint written before it
    held one) its run directory's config.yaml, with the model from stagecheck.json; None when neither exists."""
    config = point.meta.get("config")
    if config is None:
        path = point.path.parent.parent / "config.yaml"
        config = yaml.safe_load(path.read_text()) if path.is_file() else None
        if config is not None and "model" in point.meta:
            config["model"] = point.meta["model"]
    return config


def check_resume(
    point: ResumePoint, run: RunConfig, resolved: dict, shape: RunShape, run_dir: Path, command: "ResumeCommand"
) -> Resume:
    """This launch continuing from `point`: refused (ValueError naming each differing option with its saved and new
    values, and the command that resumes) when anything that shapes the weights, the tokens or the partition
    differs; else what changed and the learning-rate decay to follow."""
    saved = saved_config(point)
    known = saved is not None
    if not known:  # the oldest checkpoints hold the model only: nothing else can be compared or recorded
        saved = {"model": point.meta["model"]} if "model" in point.meta else {}
    old, new = flatten(saved), flatten(resolved)
    differing = {
        k: [old.get(k), new.get(k)]
        for k in sorted(old.keys() | new.keys())
        if comparable(k, old.get(k)) != comparable(k, new.get(k))
    }
    # An option only one side has was added or removed by an upgrade (a switched data source shows in data.name).
    refused = {k: v for k, v in differing.items() if not may_change(k) and k in old and k in new}
    grid = _grid_differs(point, shape)
    precision = point.meta.get("precision")
    if precision is not None and precision != shape.target.precision:
        refused["train.precision (resolved)"] = [precision, shape.target.precision]
    if refused or grid:
        raise ValueError(command.refusal(point, refused, grid, old, run_dir))
    check_data_identity(point, run, saved)
    segment = point.meta.get("lr_schedule")
    saved_steps = old.get("train.steps", run.train.steps)
    segment = CosineSegment(**segment) if segment else CosineSegment.fresh(run.train.warmup_steps, saved_steps)
    # The schedule counts applied updates (parallel/runtime/lr_schedule.py); older checkpoints did not record them.
    applied = point.meta.get("applied_updates", point.step)
    return Resume(
        point.path,
        point.step,
        point.inside(run_dir),
        {k: v for k, v in differing.items() if known and may_change(k) and k not in NOT_RECORDED},
        segment.stretched(applied, run.train.warmup_steps, run.train.steps),
        point.meta.get("partition"),
        point.meta.get("schedule") or saved.get("parallel", {}).get("schedule", "1f1b"),
    )


def _grid_differs(point: ResumePoint, shape: RunShape) -> str | None:
    """Exact resume needs the same ranks: DeepSpeed's files are per stage and the RNG states per rank."""
    topology = shape.topology
    saved = (point.meta["world_size"], point.meta["pipeline_stages"])
    if saved == (topology.world_size, topology.pipeline_stages):
        return None
    return (
        f"it was written by {saved[0]} ranks in {saved[1]} pipeline stages, this launch has "
        f"{topology.world_size} ranks in {topology.pipeline_stages} stages"
    )


def check_partition(resume: Resume | None, parts: list[int]) -> None:
    """The layer partition this launch planned (each stage's first layer, then one past the last) against the
    checkpoint's: DeepSpeed saves the optimizer state per stage. Only a launch that changed
    parallel.partition_method plans its own (harness/run_layout.py keeps the checkpoint's otherwise)."""
    if resume is None or resume.saved_partition is None or resume.saved_partition == parts:
        return
    raise ValueError(
        f"the checkpoint {resume.checkpoint} has stages starting at layers {resume.saved_partition}, this launch "
        f"plans {parts}: parallel.partition_method changed and moved a stage boundary (DeepSpeed saved the optimizer "
        f"per stage). Resume with the saved parallel.partition_method (config.yaml of its run directory), which keeps "
        f"the checkpoint's partition"
    )


_PLAIN = re.compile(r"[\w./:+\-@]+")


def override_value(value) -> str:
    """A value as a Hydra command-line override spells it."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, list):
        return "[" + ",".join(override_value(v) for v in value) + "]"
    text = str(value)
    return text if _PLAIN.fullmatch(text) and text.lower() not in ("null", "true", "false") else repr(text)


class ResumeCommand:
    """This launch's command line, to print the one that resumes the checkpoint: `launcher` the launcher's words
    and the script as typed (harness/relaunch.py), `overrides` the options as typed (Hydra's task overrides),
    `run_dir_override` the hydra.run.dir one (None when left unset)."""

    def __init__(self, launcher: list[str], overrides: list[str], run_dir_override: str | None):
        self.launcher = launcher
        self.overrides = overrides
        self.run_dir_override = run_dir_override

    def relaunch(self, run_dir: Path, named: bool) -> str:
        """The same command again, continuing in the same run directory: hydra.run.dir is added unless this launch
        typed it or `named` it (train.run_name); train.resume and train.overwrite are left out (auto, the default,
        continues; a typed path or overwrite=true would start from another checkpoint or delete this one)."""
        where = self.run_dir_override or (None if named else f"hydra.run.dir={_shown(run_dir)}")
        kept = [o for o in self.overrides if o.lstrip("+~").partition("=")[0] not in STARTING]
        return relaunch_command(self.launcher, where, kept)

    def refusal(self, point: ResumePoint, refused: dict, grid: str | None, saved: dict, run_dir: Path) -> str:
        lines = [f"{key}: saved {old!r}, this launch {new!r}" for key, (old, new) in refused.items()]
        why = "; ".join(([grid] if grid else []) + lines)
        fixes = {k: v[0] for k, v in refused.items() if not k.endswith("(resolved)")}
        if "train.precision (resolved)" in refused:
            fixes["train.precision"] = refused["train.precision (resolved)"][0]
        if grid:
            fixes["parallel.pipeline_stages"] = point.meta["pipeline_stages"]
        command = self.command(fixes, saved, point.meta["world_size"])
        in_place = point.inside(run_dir)
        fresh = (
            "or start a new run in a new hydra.run.dir (or leave it unset), or start over in this one with "
            "train.resume=false train.overwrite=true (deletes its metrics, summary and checkpoints)"
            if in_place
            else "or start from scratch without train.resume"
        )
        return (
            f"train.resume: the checkpoint {point.path} (step {point.step}) cannot be continued by this launch, "
            f"which differs in what shapes the weights, the tokens or the partition: {why}. To resume it, launch with "
            f"the saved options: `{command}`; {fresh}"
        )

    def command(self, fixes: dict, saved: dict, world_size: int) -> str:
        """This launch's command with each refused option set to its saved value (a switched data source as the
        group choice, `data=NAME`, with the saved source's options)."""
        kept = [o for o in self.overrides if not _touches(o, fixes)]
        if "data.name" in fixes:  # the saved source with its options, none of this launch's source
            name = fixes.pop("data.name")
            fixes = {k: v for k, v in fixes.items() if not k.startswith("data.")}
            fixes.update({k: v for k, v in saved.items() if k.startswith("data.") and k != "data.name"})
            fixes = {"data": name, **fixes}
            kept = [o for o in kept if not o.lstrip("+~").startswith(("data=", "data."))]
        fixed = [f"{k}={override_value(v)}" for k, v in fixes.items()]
        return relaunch_command(with_ranks(self.launcher, world_size), self.run_dir_override, [*kept, *fixed])


def _shown(path: Path) -> str:
    """`path` relative to the working directory when it is below it (how outputs/... is typed), else absolute."""
    relative = os.path.relpath(path)
    return path.as_posix() if relative.startswith("..") else relative


def _touches(override: str, fixes: dict) -> bool:
    """Whether a typed override sets one of the fixed options (a preset such as `model=gpt2` stays: the fixed
    fields override it)."""
    return override.lstrip("+~").partition("=")[0] in fixes
