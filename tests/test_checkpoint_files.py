"""The checkpoint directory's rules without training: what counts as complete, what `latest` may name,
what pruning keeps, and how metrics.jsonl is cut back on resume."""

import json
import random

import numpy as np
import pytest
import torch

from harness.checkpoint import (
    LATEST,
    META,
    latest_checkpoint,
    prune,
    read_checkpoint,
    resume_point,
    rng_state,
    set_rng_state,
    tag_for,
)
from harness.metrics import MetricsLog
from harness.run_dir import check_run_dir, set_aside_earlier_attempt, starts_again
from schema.training import TrainConfig


def _make(root, step, complete=True):
    path = root / tag_for(step)
    path.mkdir(parents=True)
    (path / "mp_rank_00_model_states.pt").write_bytes(b"x")
    if complete:
        (path / META).write_text(json.dumps({"step": step, "world_size": 2, "pipeline_stages": 2}))
    return path


def test_latest_names_the_checkpoint_and_incomplete_ones_are_not_loadable(tmp_path):
    root = tmp_path / "checkpoints"
    _make(root, 2)
    _make(root, 4, complete=False)  # killed mid-save
    assert latest_checkpoint(tmp_path) is None  # no pointer yet: nothing to resume
    (root / LATEST).write_text("step_00000002\n")
    point = latest_checkpoint(tmp_path)
    assert point.step == 2 and point.inside(tmp_path)
    assert read_checkpoint(tmp_path).path == point.path  # a run directory works as train.resume=PATH
    with pytest.raises(ValueError, match="is not a complete stagecheck checkpoint"):
        read_checkpoint(root / "step_00000004")


def test_prune_keeps_latest_and_the_newest_before_it(tmp_path):
    root = tmp_path / "checkpoints"
    for step in (2, 4, 6, 8):
        _make(root, step)
    _make(root, 10, complete=False)
    (root / LATEST).write_text("step_00000006")  # e.g. resumed from an explicit older checkpoint
    prune(root, keep=2)
    assert sorted(p.name for p in root.iterdir() if p.is_dir()) == ["step_00000004", "step_00000006"]


def test_resume_modes(tmp_path):
    root = tmp_path / "checkpoints"
    _make(root, 2)
    (root / LATEST).write_text("step_00000002")
    assert resume_point(TrainConfig(resume="auto"), tmp_path).step == 2
    assert resume_point(TrainConfig(resume="false"), tmp_path) is None
    assert resume_point(TrainConfig(resume=str(root / "step_00000002")), tmp_path / "elsewhere").step == 2
    assert not resume_point(TrainConfig(resume=str(root)), tmp_path).inside(tmp_path / "elsewhere")


def test_run_dir_with_outputs_needs_a_checkpoint_or_overwrite(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n')
    with pytest.raises(ValueError, match="already holds a run .* train.overwrite=true"):
        check_run_dir(tmp_path)
    check_run_dir(tmp_path, continuing=True)
    check_run_dir(tmp_path, overwrite=True)


def test_a_run_killed_before_its_first_checkpoint_starts_again_keeping_its_files(tmp_path):
    """train.resume=auto in a directory with outputs but no complete checkpoint (a preemption before the first
    one): the run starts again, its earlier attempts' files set aside under earlier_attempts/N/, every relaunch."""
    for attempt in (1, 2):
        (tmp_path / "metrics.jsonl").write_text(f'{{"step": {attempt}}}\n')
        (tmp_path / "config.yaml").write_text(f"attempt: {attempt}\n")
        (tmp_path / "checkpoints" / "step_00000004").mkdir(parents=True)  # a save that was cut short
        assert starts_again("auto", overwrite=False, resuming=False, run_dir=tmp_path)
        check_run_dir(tmp_path, continuing=True)
        aside = set_aside_earlier_attempt(tmp_path)
        assert aside == tmp_path / "earlier_attempts" / str(attempt)
        assert (aside / "metrics.jsonl").read_text() == f'{{"step": {attempt}}}\n'
        assert (aside / "checkpoints" / "step_00000004").is_dir()
        assert not (tmp_path / "metrics.jsonl").exists() and not (tmp_path / "checkpoints").exists()
    assert not starts_again("auto", overwrite=False, resuming=False, run_dir=tmp_path)  # nothing left to set aside
    (tmp_path / "summary.json").write_text("{}")
    assert not starts_again("false", overwrite=False, resuming=False, run_dir=tmp_path)
    assert not starts_again("auto", overwrite=True, resuming=False, run_dir=tmp_path)  # overwrite deletes instead
    assert not starts_again("auto", overwrite=False, resuming=True, run_dir=tmp_path)  # a checkpoint to continue


def test_metrics_resume_drops_steps_after_the_checkpoint(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": s, "loss": float(s)}) + "\n" for s in range(1, 6)))
    log = MetricsLog(tmp_path, total_steps=8, print_every=100, wandb=None, resume_step=3)
    assert [r["step"] for r in log.records] == [1, 2, 3]
    log.log_step({"step": 4, "loss": 4.5, "lr": 0.0, "tokens_per_s": 1.0, "step_time_s": 1.0})
    log.close()
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [1, 2, 3, 4]
    with pytest.raises(FileExistsError):
        MetricsLog(tmp_path, total_steps=8, print_every=100, wandb=None)  # fresh runs never truncate


def test_rng_states_round_trip(tmp_path):
    state = rng_state()
    torch.save(state, tmp_path / "rng.pt")
    expected = (random.random(), np.random.rand(), torch.rand(3))
    random.random(), np.random.rand(), torch.rand(3)  # move every stream on
    set_rng_state(torch.load(tmp_path / "rng.pt", weights_only=False))
    again = (random.random(), np.random.rand(), torch.rand(3))
    assert again[0] == expected[0] and again[1] == expected[1] and torch.equal(again[2], expected[2])
