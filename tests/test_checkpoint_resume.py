"""Checkpoints and exact resume through real 2-rank runs: a run interrupted at step k (SIGTERM to one
rank, or kill -9 in the middle of a save) and resumed gives bit-identical losses for steps k+1..N to an
uninterrupted run, continues the same W&B run without duplicated steps, and never loses its last
complete checkpoint. A resume keeps config.yaml and records itself in resumes.jsonl; one that changes
train.steps re-stretches the learning rate without a jump and its summary keeps the traced bubbles and the
peaks; a refused one leaves every file of the run byte-identical, with advice that is accepted."""

import hashlib
import json
import os
import shlex
import shutil
import signal
import time

import pytest

from harness.checkpoint import LATEST, META
from harness.faults import EXIT_PREEMPTED, TEST_SAVE_DELAY_ENV
from parallel.runtime.lr_schedule import CosineSegment, lr_factor
from tests import wandb_file
from tests.live_runs import start
from tests.runs import TINY, cpu_env, launch, metrics, python_run, summary
from tests.shared_runs import case

pytestmark = pytest.mark.multiproc
STEPS = 8
COMMON = [*TINY, f"train.steps={STEPS}", "train.save_every=2", "train.micro_batches=2", "model.dropout=0.1"]
COMMON += ["train.trace_step=0"]
MODES = {"none": [], "selective": ["+recompute=selective"]}


CASES = {mode: case(*COMMON, *overrides) for mode, overrides in MODES.items()}
# A later job of the same launch: a longer run from the straight run's step-6 checkpoint, traced and metered at the
# default steps (3 and 2), which are behind it.
EXTENDED_STEPS = 12
CASES["extended"] = case(
    *[o for o in COMMON if not o.startswith(("train.steps", "train.trace_step"))],
    f"train.steps={EXTENDED_STEPS}",
    "train.resume={runs}/checkpoint_resume-none/checkpoints/step_00000006",
)


@pytest.fixture(scope="module")
def reference(case_runs):
    """Uninterrupted runs, one per mode: the losses every resumed run must reproduce bit for bit."""
    return case_runs


def _losses(run_dir):
    return [row["loss"] for row in metrics(run_dir)]


def _latest(run_dir) -> str:
    return (run_dir / "checkpoints" / LATEST).read_text().strip()


def _wandb_pieces(run_dir):
    """(run id, logged steps) of each offline piece, in launch order."""
    pieces = []
    for path in wandb_file.find_run_files(run_dir / "wandb"):
        steps = [row["_step"] for row in wandb_file.history(path) if "loss" in row]
        pieces.append((wandb_file.run_info(path)["id"], steps))
    return pieces


def test_uninterrupted_run_keeps_the_last_checkpoints(reference):
    run_dir = reference["none"]
    assert _latest(run_dir) == f"step_{STEPS:08d}"
    kept = sorted(p.name for p in (run_dir / "checkpoints").iterdir() if p.is_dir())
    assert kept == ["step_00000006", "step_00000008"]  # train.keep_checkpoints=2
    meta = json.loads((run_dir / "checkpoints" / "step_00000008" / META).read_text())
    assert meta["step"] == STEPS and meta["data"]["next_step"] == STEPS + 1
    assert (meta["world_size"], meta["pipeline_stages"]) == (2, 2)
    (piece,) = _wandb_pieces(run_dir)
    assert meta["wandb_run_id"] == piece[0]
    files = {p.name for p in (run_dir / "checkpoints" / "step_00000008").iterdir()}
    assert {
        "stagecheck_rank_00000.pt",
        "stagecheck_rank_00001.pt",
        "mp_rank_00_model_states.pt",
        "mp_rank_01_model_states.pt",
        "layer_02-model_states.pt",
    } <= files


def test_sigterm_to_one_rank_saves_exits_75_and_resumes_bit_identical(reference, tmp_path):
    run_dir = tmp_path / "preempted"
    live = start(run_dir, *COMMON)
    try:
        live.wait_until(lambda: live.steps_logged() >= 3, "step 3")
        signalled_at = time.monotonic()
        os.kill(live.rank_pid(0), signal.SIGTERM)  # one rank, not the launcher
        code = live.finish(timeout=120)
    finally:
        live.kill()
    out = live.output()
    assert code == EXIT_PREEMPTED, out[-4000:]
    assert time.monotonic() - signalled_at < 60
    assert "stagecheck: rank 0 got SIGTERM" in out
    assert "stagecheck: preempted (SIGTERM on rank 0)" in out
    k = len(metrics(run_dir))
    assert 3 <= k < STEPS
    assert _latest(run_dir) == f"step_{k:08d}"  # saved at the step boundary where all ranks agreed
    assert not (run_dir / "summary.json").exists()

    config = (run_dir / "config.yaml").read_bytes()
    resumed = launch(run_dir, *COMMON)  # train.resume=auto (the default)
    assert (run_dir / "config.yaml").read_bytes() == config  # how the run was launched, kept
    (record,) = [json.loads(line) for line in (run_dir / "resumes.jsonl").read_text().splitlines()]
    assert (record["from_step"], record["in_place"], record["changed"]) == (k, True, {})
    assert f"resuming from {run_dir / 'checkpoints' / f'step_{k:08d}'} after step {k}" in resumed.stdout
    assert [row["step"] for row in metrics(run_dir)] == list(range(1, STEPS + 1))
    assert _losses(run_dir) == _losses(reference["none"])  # bit-identical, k+1..N included
    assert summary(run_dir)["losses"] == _losses(reference["none"])

    # One W&B run id across both launches; each step logged exactly once (offline: one piece per launch).
    (id1, steps1), (id2, steps2) = _wandb_pieces(run_dir)
    assert id1 == id2
    assert steps1 == list(range(1, k + 1)) and steps2 == list(range(k + 1, STEPS + 1))


def test_kill_during_a_save_keeps_the_previous_checkpoint_and_resume_is_bit_identical(reference, tmp_path):
    run_dir = tmp_path / "killed"
    step4 = run_dir / "checkpoints" / "step_00000004"
    live = start(run_dir, *COMMON, *MODES["selective"], env_extra={TEST_SAVE_DELAY_ENV: "4:10"})
    try:
        # Every rank has written its part of step 4; rank 0 sleeps before the barrier that precedes `latest`.
        live.wait_until(
            lambda: all((step4 / f"stagecheck_rank_0000{r}.pt").exists() for r in (0, 1)), "the step-4 save"
        )
        killed_at = time.monotonic()
        os.kill(live.rank_pid(0), signal.SIGKILL)
        code = live.finish(timeout=120)
        elapsed = time.monotonic() - killed_at
    finally:
        live.kill()
    assert code != 0
    assert elapsed < 60, f"the launcher took {elapsed:.0f} s to exit after a rank died"
    assert _latest(run_dir) == "step_00000002"  # the pointer never moved to the half-done save
    assert (run_dir / "checkpoints" / "step_00000002" / META).exists()
    assert not (step4 / META).exists()
    assert [row["step"] for row in metrics(run_dir)] == [1, 2, 3, 4]

    resumed = launch(run_dir, *COMMON, *MODES["selective"])
    assert "after step 2" in resumed.stdout  # the previous checkpoint loads
    assert [row["step"] for row in metrics(run_dir)] == list(range(1, STEPS + 1))  # 3, 4 not duplicated
    assert _losses(run_dir) == _losses(reference["selective"])
    assert _latest(run_dir) == f"step_{STEPS:08d}"
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir() if p.is_dir()) == [
        "step_00000006",
        "step_00000008",
    ]  # the half-written step 4 was redone, then pruned
    # The resumed launch continues the W&B run of the checkpoint. The killed launch's piece is not read:
    # the launcher killed its W&B service with the rank's process tree, so it may be cut short.
    meta = json.loads((run_dir / "checkpoints" / f"step_{STEPS:08d}" / META).read_text())
    last = wandb_file.find_run_files(run_dir / "wandb")[-1]
    assert wandb_file.run_info(last)["id"] == meta["wandb_run_id"]
    assert [row["_step"] for row in wandb_file.history(last) if "loss" in row] == list(range(3, STEPS + 1))


def test_resume_refusals_name_the_option(reference, tmp_path):
    run_dir = reference["none"]
    fresh = python_run(run_dir, *COMMON, "train.resume=false", check=False, timeout=120)
    assert fresh.returncode == 2
    assert "already holds a run" in fresh.stderr and "train.overwrite=true" in fresh.stderr

    other_topology = python_run(tmp_path / "one-rank", *COMMON, f"train.resume={run_dir}", check=False, timeout=120)
    assert other_topology.returncode == 2
    assert "written by 2 ranks in 2 pipeline stages, this launch has 1 ranks" in other_topology.stderr
    assert "Traceback" not in fresh.stderr + other_topology.stderr
    assert not (tmp_path / "one-rank").exists()


def _hashes(run_dir) -> dict:
    return {
        str(p.relative_to(run_dir)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in run_dir.rglob("*")
        if p.is_file()
    }


def test_a_refused_resume_changes_no_file_and_its_advice_is_accepted(reference, tmp_path):
    """The issue's relaunch: into a finished 2-stage run's directory, longer, with options forgotten (the run's
    train.micro_batches) or changed (the vocabulary). Start-up refuses it on 2 ranks (the launcher's variables,
    before any process group), the files stay byte-identical, and both commands the refusal gives pass start-up."""
    run_dir = tmp_path / "run"
    shutil.copytree(reference["none"], run_dir)
    two_ranks = cpu_env(tmp_path, RANK="0", WORLD_SIZE="2", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT="1")
    before = _hashes(run_dir)
    forgot = python_run(run_dir, *TINY, "train.steps=12", "model.vocab_size=512", check=False, env=two_ranks)
    assert forgot.returncode == 2, forgot.stderr
    (line,) = forgot.stderr.splitlines()
    assert "train.micro_batches: saved 2, this launch 4" in line
    assert "model.vocab_size: saved 256, this launch 512" in line
    assert "train.steps" not in line.split("To resume it")[0]  # it may change
    assert _hashes(run_dir) == before

    resume = shlex.split(line.split("`")[1])
    assert resume[:4] == ["deepspeed", "--num_gpus", "2", "train.py"]
    for accepted in (resume[4:], [f"hydra.run.dir={run_dir}", *TINY, "train.resume=false", "train.overwrite=true"]):
        dry = python_run(None, *accepted, "dry_run=true", check=False, env=two_ranks, tmp=tmp_path)
        assert dry.returncode == 0 and "error" not in dry.stderr, dry.stderr


def test_a_longer_run_from_a_checkpoint_re_stretches_the_lr_and_keeps_every_summary_field(reference):
    extended, straight = reference["extended"], reference["none"]
    rows = metrics(extended)
    assert [r["step"] for r in rows] == list(range(7, EXTENDED_STEPS + 1))
    first = json.loads((straight / "checkpoints" / "step_00000006" / META).read_text())
    train = first["config"]["train"]
    peak, warmup, floor = train["lr"], train["warmup_steps"], train["min_lr_ratio"]
    segment = CosineSegment(**first["lr_schedule"]).stretched(6, warmup, EXTENDED_STEPS)
    expected = [peak * lr_factor(s, warmup, EXTENDED_STEPS, floor, segment) for s in range(7, EXTENDED_STEPS + 1)]
    assert [r["lr"] for r in rows] == pytest.approx(expected, rel=1e-12)
    straight_lr = [r["lr"] for r in metrics(straight)]
    lrs = straight_lr[:6] + [r["lr"] for r in rows]
    assert all(a >= b for a, b in zip(lrs[warmup - 1 :], lrs[warmup:]))  # from the peak down, never up again
    assert rows[0]["lr"] > straight_lr[6]  # not the 8-step schedule's step 7: its decay was re-stretched
    assert rows[-1]["lr"] == pytest.approx(peak * floor)

    (record,) = [json.loads(line) for line in (extended / "resumes.jsonl").read_text().splitlines()]
    assert (record["from_step"], record["in_place"]) == (6, False)
    assert record["changed"] == {"train.steps": [8, EXTENDED_STEPS], "train.trace_step": [0, None]}
    assert record["lr_schedule"] == {"start_step": 6, "start_progress": segment.start_progress, "end_step": 12}
    last = json.loads((extended / "checkpoints" / f"step_{EXTENDED_STEPS:08d}" / META).read_text())
    assert last["lr_schedule"] == record["lr_schedule"] and last["config"]["train"]["steps"] == EXTENDED_STEPS

    # Every field of a straight run's summary, from the launch's own segment: traced and metered after step 6.
    result = summary(extended)
    straight_fields = set(summary(straight)) | {"traced_step", "bubble_fraction_per_stage", "trace_costs"}
    assert straight_fields <= set(result)
    assert (result["resumed_from_step"], result["traced_step"], result["activation_measured_at_step"]) == (6, 9, 7)
    assert len(result["bubble_fraction_per_stage"]) == 2 and all(result["peak_activation_bytes_per_stage"])
    assert (extended / "timeline.png").exists() and summary(straight)["resumed_from_step"] is None
