"""What a resume may change (harness/resume_check.py), checked in-process on configs composed as train.py composes
them: what shapes the weights, the tokens or the partition is refused with the saved and new values and a command
that resumes; the printed command passes the same check; what may change is recorded. The launches that resume
for real are in tests/test_checkpoint_resume.py."""

import json
import shlex
import shutil
from pathlib import Path

import pytest
import yaml
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from data.config import data_identity
from data.prepare import prepare
from data.prepare_config import PrepareDataConfig
from harness.checkpoint import ResumePoint, resume_point
from harness.context import Resume, RunContext
from harness.job import JobHooks
from harness.resume_check import ResumeCommand, absolute_paths, check_partition, check_resume, override_value
from harness.run_control import resuming_line
from harness.run_dir import register_run_stamp_resolver
from harness.run_layout import layout_of
from parallel.runtime.dist_env import DistEnv
from parallel.runtime.lr_schedule import CosineSegment, lr_factor
from schema import register_schemas
from schema.checks import run_shape, to_run_config
from sweep.job import SweepJob

CONF = Path(__file__).resolve().parents[1] / "conf"
TRAINED = ("data=text", "data.tokenizer=bpe", "data.bpe_vocab_size=1024", "model.vocab_size=1024", "train.steps=20")

register_schemas()
register_run_stamp_resolver()


def _compose(overrides):
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose(config_name="config", overrides=list(overrides))
    return to_run_config(cfg), OmegaConf.to_container(cfg, resolve=True)


def _checkpoint(run_dir: Path, overrides, step=20, world_size=2, stages=2, **meta) -> ResumePoint:
    """The checkpoint a run launched with `overrides` on `world_size` ranks saved after `step`."""
    _, resolved = _compose(overrides)
    path = run_dir / "checkpoints" / f"step_{step:08d}"
    path.mkdir(parents=True)
    meta = {"step": step, "world_size": world_size, "pipeline_stages": stages, "config": resolved, **meta}
    return ResumePoint(path.resolve(), meta)


def _check(point, run_dir, overrides, world_size=2, run_dir_override=None):
    run, resolved = _compose(overrides)
    shape = run_shape(run, world_size, cuda_available=False)
    launcher = ["deepspeed", "--num_gpus", str(world_size), "train.py"]
    return check_resume(
        point, run, resolved, shape, run_dir, ResumeCommand(launcher, list(overrides), run_dir_override)
    )


def test_relaunching_a_bpe_run_without_its_options_is_refused_naming_each(tmp_path):
    """The issue's case: a run trained with BPE and a 1024-token vocabulary, relaunched without those options."""
    point = _checkpoint(tmp_path, TRAINED)
    typed = ("train.steps=45",)
    with pytest.raises(ValueError) as refusal:
        _check(point, tmp_path, typed, run_dir_override=f"hydra.run.dir={tmp_path}")
    message = str(refusal.value)
    for named in (
        "model.vocab_size: saved 1024, this launch 256",
        "data.tokenizer: saved 'bpe', this launch 'bytes'",
        "data.bpe_vocab_size: saved 1024, this launch 4096",
    ):
        assert named in message
    assert "train.steps" not in message.split("To resume it")[0]  # it may change
    assert "train.resume=false train.overwrite=true" in message  # start over: advice that is accepted
    command = message.split("`")[1]
    assert command.startswith(f"deepspeed --num_gpus 2 train.py hydra.run.dir={tmp_path} train.steps=45 ")
    # The printed command resumes: its options pass the same check.
    printed = shlex.split(command)[4:]
    resume = _check(point, tmp_path, printed)
    assert resume.in_place and resume.changed == {"train.steps": [20, 45]}


def test_what_may_change_is_recorded_and_the_learning_rate_re_stretched(tmp_path):
    point = _checkpoint(tmp_path, TRAINED, step=12)
    changed = (
        *TRAINED[:-1],
        "train.steps=40",
        "train.eval_every=5",
        "data.val_fraction=0.05",
        "+recompute=selective",
        "logger=none",
        "parallel.schedule=zb-h1",
        "train.save_every=10",
    )
    resume = _check(point, tmp_path, changed)
    assert resume.changed["train.steps"] == [20, 40]
    assert resume.changed["train.eval_every"] == [0, 5] and resume.changed["parallel.schedule"] == ["1f1b", "zb-h1"]
    assert resume.changed["recompute.mode"] == [None, "selective"]
    assert resume.lr_segment == CosineSegment(12, CosineSegment.fresh(2, 20).progress(12), 40)
    same = _check(point, tmp_path, TRAINED)
    assert same.changed == {} and same.lr_segment == CosineSegment.fresh(2, 20)  # bit-exact: the same schedule


@pytest.mark.parametrize(
    "overrides, named",
    [
        (("train.lr=0.001",), "train.lr: saved 0.0006, this launch 0.001"),
        (("seed=7",), "seed: saved 1234, this launch 7"),
        (("train.micro_batch_size=4",), "train.micro_batch_size: saved 2, this launch 4"),
        (("parallel.zero_stage=1",), "parallel.zero_stage: saved 0, this launch 1"),
        (("model.dropout=0.2",), "model.dropout: saved 0.1, this launch 0.2"),
    ],
)
def test_what_shapes_the_weights_or_tokens_is_refused(tmp_path, overrides, named):
    point = _checkpoint(tmp_path, ())
    with pytest.raises(ValueError, match=named.replace("(", r"\(").replace(")", r"\)")):
        _check(point, tmp_path, overrides)


def test_a_switched_data_source_is_resumed_with_the_group_choice(tmp_path):
    point = _checkpoint(tmp_path, ("data=synthetic",))
    with pytest.raises(ValueError) as refusal:
        _check(point, tmp_path, ("data=text", "data.tokenizer=bpe"))
    command = str(refusal.value).split("`")[1]
    assert "data.name: saved 'synthetic', this launch 'text'" in str(refusal.value)
    assert command.split("train.py ")[1] == "data=synthetic"  # no option of the text source is kept
    _check(point, tmp_path, shlex.split(command)[4:])


def test_a_path_typed_relative_in_one_launch_and_absolute_in_the_other_is_the_same(tmp_path, monkeypatch):
    """Path options are compared resolved from the working directory; another file is still refused."""
    monkeypatch.chdir(tmp_path)
    for name in ("corpus.txt", "other.txt"):
        (tmp_path / name).write_text("some text to train on\n")
    relative = ("data=text", "data.path=corpus.txt", "data.cache_dir=cache")
    point = _checkpoint(tmp_path / "run", relative)
    absolute = ("data=text", f"data.path={tmp_path / 'corpus.txt'}", f"data.cache_dir={tmp_path}/./cache")
    assert _check(point, tmp_path / "run", absolute).changed == {}
    with pytest.raises(ValueError, match=f"data.path: saved 'corpus.txt', this launch '{tmp_path / 'other.txt'}'"):
        _check(point, tmp_path / "run", ("data=text", f"data.path={tmp_path / 'other.txt'}", "data.cache_dir=cache"))


def test_another_grid_or_precision_is_refused_with_the_saved_one(tmp_path):
    point = _checkpoint(tmp_path, (), precision="bf16")
    with pytest.raises(ValueError) as refusal:
        _check(point, tmp_path, ("train.device=cpu",), world_size=1)
    message = str(refusal.value)
    assert "it was written by 2 ranks in 2 pipeline stages, this launch has 1 ranks in 1 stages" in message
    assert "train.precision (resolved): saved 'bf16', this launch 'fp32'" in message
    command = message.split("`")[1]
    assert command.startswith("deepspeed --num_gpus 2 train.py train.device=cpu ")
    assert "train.precision=bf16" in command and "parallel.pipeline_stages=2" in command


def test_a_checkpoint_of_another_run_refused_says_how_to_start_from_scratch(tmp_path):
    point = _checkpoint(tmp_path / "other", ())
    with pytest.raises(ValueError, match="or start from scratch without train.resume"):
        _check(point, tmp_path / "mine", ("model.n_layer=8",))


def test_older_checkpoints_are_checked_against_their_run_directory_config_or_their_model(tmp_path):
    point = _checkpoint(tmp_path, TRAINED)
    saved = point.meta.pop("config")
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(saved))
    with pytest.raises(ValueError, match="data.tokenizer: saved 'bpe'"):
        _check(point, tmp_path, ())
    (tmp_path / "config.yaml").unlink()
    point.meta["model"] = saved["model"]
    with pytest.raises(ValueError, match="model.vocab_size: saved 1024, this launch 256"):
        _check(point, tmp_path, ())
    # Without the saved config, its train.steps is unknown: the schedule is this launch's, and no change is recorded.
    resume = _check(point, tmp_path, ("model.vocab_size=1024", "train.steps=30"))
    assert resume.lr_segment == CosineSegment.fresh(2, 30) and resume.changed == {}


def test_a_moved_stage_boundary_is_refused():
    resume = Resume(Path("/runs/a/checkpoints/step_00000004"), 4, True, saved_partition=[0, 3, 6])
    check_partition(resume, [0, 3, 6])
    check_partition(None, [0, 2, 6])
    with pytest.raises(ValueError, match=r"stages starting at layers \[0, 3, 6\], this launch plans \[0, 2, 6\]"):
        check_partition(resume, [0, 2, 6])


def test_override_values_read_back_as_the_same_value():
    for value, text in [(None, "null"), (True, "true"), (1024, "1024"), (6e-4, "0.0006"), ("bpe", "bpe")]:
        assert override_value(value) == text
    assert override_value([1, 2]) == "[1,2]" and override_value("a b") == "'a b'" and override_value("null") == "'null'"
    assert json.loads(json.dumps(override_value("/data/corpus.txt"))) == "/data/corpus.txt"


MOVING = ("model=tiny", "parallel.pipeline_stages=3", "train.prices=analytic")
"""A balanced partition that moves with the recompute plan: [0, 4, 5, 8] under none, [0, 3, 4, 8] under full(stage)."""


def _layout_parts(overrides, resume=None, job=None):
    run, resolved = _compose(overrides)
    shape = run_shape(run, 3, cuda_available=False)
    env = DistEnv(0, 3, 0, "127.0.0.1", 29500, "torch", 3)
    return layout_of(RunContext(run, resolved, Path("/runs/a"), env, shape, job or JobHooks(), resume)).parts


def test_a_resume_keeps_its_checkpoints_partition_when_the_recompute_plan_changes():
    """docs/preemption.md's promise: +recompute may change on resume. Planned afresh, full(stage) would move a
    boundary (and a device profile built between the launches could too); the checkpoint's partition is kept."""
    changed = (*MOVING, "+recompute=full", "recompute.interval=stage")
    assert _layout_parts(MOVING) == [0, 4, 5, 8] and _layout_parts(changed) == [0, 3, 4, 8]
    resume = Resume(Path("/runs/a/checkpoints/step_00000004"), 4, True, saved_partition=[0, 4, 5, 8])
    assert _layout_parts(changed, resume) == [0, 4, 5, 8]
    # Another parallel.partition_method asks for another partition: planned, then compared (check_partition).
    asked = Resume(resume.checkpoint, 4, True, {"parallel.partition_method": ["uniform", "balanced"]}, None, [0, 3, 6])
    assert _layout_parts(changed, asked) == [0, 3, 4, 8]


def test_a_sweeps_jobs_hold_one_partition_across_recompute_settings():
    """Each job of a sweep under `balanced` takes the boundaries balanced picks for none: like with like."""
    for mode in ((), ("+recompute=full", "recompute.interval=stage"), ("+recompute=selective",)):
        assert _layout_parts((*MOVING, *mode), job=SweepJob()) == [0, 4, 5, 8]
    # The partition itself swept: each method its own boundaries.
    assert _layout_parts((*MOVING, "parallel.partition_method=uniform"), job=SweepJob()) == [0, 3, 6, 8]


def test_a_resume_names_its_wandb_run_only_when_it_logs_to_wandb():
    checkpoint = Path("/runs/a/checkpoints/step_00000004")
    assert resuming_line(checkpoint, 4, "abc123", "none") == f"stagecheck: resuming from {checkpoint} after step 4"
    assert resuming_line(checkpoint, 4, "abc123", "wandb").endswith("after step 4 (W&B run abc123)")


@pytest.mark.parametrize("new_steps", [14, 40])
def test_a_resume_after_skipped_updates_never_raises_the_learning_rate(tmp_path, new_steps):
    """3 of 12 updates skipped (fp16 overflow, nan_policy=skip): the scheduler has applied 9. A re-stretch keyed by
    the step started the new cosine 3 updates ahead of the scheduler: shortened, the next update ran back up the
    cosine above the rate before the resume; extended, it dropped past the old schedule's next rate."""
    point = _checkpoint(tmp_path, TRAINED, step=12, applied_updates=9)
    resume = _check(point, tmp_path, (*TRAINED[:-1], f"train.steps={new_steps}"))

    def old(update):
        return lr_factor(update, 2, 20, 0.1)

    after = lr_factor(10, 2, new_steps, 0.1, resume.lr_segment)  # the first update of the resumed launch
    assert after <= old(9)  # never above the last update's rate
    assert after >= (old(10) if new_steps > 20 else old(12))  # and no drop beyond a few updates' decay


def _prepared(folder: Path, text: str) -> Path:
    corpus = folder.parent / f"{folder.name}.jsonl"
    corpus.write_text("".join(json.dumps({"text": text}) + "\n" for _ in range(40)))
    prepare(PrepareDataConfig(input=str(corpus), out=str(folder)))
    return folder


def test_path_options_are_recorded_absolute(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    _, resolved = _compose(("data=memmap", "data.path=corpus", "train.device_profile=auto"))
    recorded = absolute_paths(resolved)
    assert recorded["data"]["path"] == str(tmp_path / "corpus") and resolved["data"]["path"] == "corpus"
    assert recorded["train"]["device_profile"] == "auto"  # a keyword, not a file


def test_prepared_data_is_compared_by_its_identity_not_only_its_path(tmp_path):
    """The same data.path prepared again from another corpus (or, for checkpoints that recorded it relative, another
    directory's folder of the same name) is refused naming the prepared key that differs."""
    folder = _prepared(tmp_path / "corpus", "the first corpus " * 30)
    options = ("data=memmap", f"data.path={folder}", "model=tiny", "model.vocab_size=257")
    run, _ = _compose(options)
    point = _checkpoint(tmp_path / "run", options, data={"identity": data_identity(run.data)})
    assert _check(point, tmp_path / "run", options).changed == {}
    shutil.rmtree(folder)
    _prepared(folder, "another corpus altogether " * 30)
    with pytest.raises(ValueError, match=r"holds other prepared data than the checkpoint .*prepared_key '"):
        _check(point, tmp_path / "run", options)


def test_start_up_reads_train_resume_as_composed_before_it_is_typed(tmp_path):
    """Start-up looks for the checkpoint before model.init_from is read, on the composed config, where a command
    line's `train.resume=false` may still be the string 'False'."""
    point = _checkpoint(tmp_path, TRAINED)
    (point.path / "stagecheck.json").write_text(json.dumps(point.meta))
    (tmp_path / "checkpoints" / "latest").write_text(point.path.name + "\n")
    for off in ("False", False, "false"):
        assert resume_point(OmegaConf.create({"resume": off}), tmp_path) is None
    assert resume_point(OmegaConf.create({"resume": "auto"}), tmp_path).step == 20
