"""Held-out evaluation in real launches: it leaves training bit-identical (dropout on, 2 stages), the same seed
gives the same val loss (also on 2 stages x 2 data-parallel with ZeRO-1), the last step is always evaluated,
the outputs hold the values, the run ends on its summary line, and bad eval options fail at start-up."""

import math
import re

import pytest

from schema.training import TrainConfig
from sweep.report.loading import Job
from sweep.report.table import rows
from tests import wandb_file
from tests.runs import TINY, launch, metrics, python_run, summary
from tests.shared_runs import case

pytestmark = pytest.mark.multiproc
# Eval at step 3 (train.eval_every) and at the last step, 4, which is not a multiple of it.
RUN = [*TINY, "model.seq_len=32", "model.dropout=0.1", "train.steps=4", "train.micro_batches=2", "train.trace_step=0"]
EVAL = ["train.eval_every=3", "train.eval_batches=2"]
# The deepspeed launcher's own lines ("Process N exits successfully") come after the ranks have exited.
LAUNCHER_LINE = re.compile(r"^\[\S+ \S+\] \[\w+\] \[launch\.py:")


ZERO1 = [*RUN, *EVAL, "parallel.pipeline_stages=2", "parallel.zero_stage=1", "logger=none"]
CASES = {
    "no_eval": case(*RUN, "logger=none"),
    # 2 stages x 2 data-parallel with ZeRO-1, run twice with the same seed (two jobs of the 4-rank launch)
    "zero1-a": case(*ZERO1, nproc=4),
    "zero1-b": case(*ZERO1, nproc=4),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory, case_runs):
    """The eval run is a launch of its own: its output must end on its summary line."""
    root = tmp_path_factory.mktemp("eval")
    return {
        "eval": launch(root / "eval", *RUN, *EVAL, timeout=300),
        "dirs": {"eval": root / "eval", "no_eval": case_runs["no_eval"]},
    }


@pytest.fixture(scope="module")
def zero1_runs(case_runs):
    return case_runs["zero1-a"], case_runs["zero1-b"]


def test_eval_leaves_training_bit_identical(runs):
    with_eval, without = summary(runs["dirs"]["eval"]), summary(runs["dirs"]["no_eval"])
    assert len(with_eval["losses"]) == 4
    assert with_eval["losses"] == without["losses"]
    assert with_eval["tied_weight_sha256_per_rank"] == without["tied_weight_sha256_per_rank"]
    assert "val_loss" not in without and "val_losses" not in without


def test_val_loss_every_eval_every_steps_and_at_the_last_step(runs):
    records = metrics(runs["dirs"]["eval"])
    evaluated = [r["step"] for r in records if "val_loss" in r]
    assert evaluated == [3, 4]
    for r in records:
        if "val_loss" in r:
            assert math.isfinite(r["val_loss"]) and r["val_ppl"] == pytest.approx(math.exp(r["val_loss"]))
    s = summary(runs["dirs"]["eval"])
    assert s["val_losses"] == [{"step": r["step"], "val_loss": r["val_loss"]} for r in records if "val_loss" in r]
    assert s["val_loss"] == s["val_losses"][-1]["val_loss"]
    # Evaluations see the same batches, so the val loss moves only with the weights.
    assert s["val_losses"][0]["val_loss"] != s["val_losses"][1]["val_loss"]
    stdout = runs["eval"].stdout
    assert f"step 3/4 | loss {records[2]['loss']:.4f}" in stdout and f"| val {records[2]['val_loss']:.4f}" in stdout


def test_wandb_logs_the_val_loss(runs):
    run_dir = runs["dirs"]["eval"]
    (wandb_path,) = wandb_file.find_run_files(run_dir / "wandb")
    logged = {r["_step"]: r["val_loss"] for r in wandb_file.history(wandb_path) if "val_loss" in r}
    assert logged == {v["step"]: v["val_loss"] for v in summary(run_dir)["val_losses"]}
    assert wandb_file.summary(wandb_path)["val_loss"] == summary(run_dir)["val_loss"]


def test_the_run_ends_on_its_summary_line(runs, shared_runs):
    run_dir = runs["dirs"]["eval"]
    lines = [line for line in runs["eval"].stdout.splitlines() if line.strip() and not LAUNCHER_LINE.match(line)]
    last = lines[-1]
    s = summary(run_dir)
    assert last.startswith("stagecheck: done | ")
    assert f"| loss {s['losses'][-1]:.4f} | val {s['val_loss']:.4f} | {s['tokens_per_s']:,.0f} tok/s" in last
    peaks = " / ".join(f"{b / 2**20:.2f} MiB" for b in s["peak_activation_bytes_per_stage"])
    assert f"| peak activations per stage {peaks} |" in last
    assert f"| run dir {run_dir} |" in last
    (offline_run,) = (run_dir / "wandb").glob("offline-run-*")
    assert last.endswith(f"| wandb sync {offline_run}")
    assert sum(line.startswith("stagecheck: done") for line in lines) == 1
    no_eval = [line for line in shared_runs.case_output().splitlines() if "stagecheck: done" in line]
    assert "| val " not in next(line for line in no_eval if line.endswith(f"| run dir {runs['dirs']['no_eval']}"))


def test_val_loss_is_the_same_for_the_same_seed_on_2_stages_x_2_data_parallel_zero1(zero1_runs):
    a, b = (summary(run_dir) for run_dir in zero1_runs)
    assert (a["pipeline_stages"], a["data_parallel_size"]) == (2, 2)
    assert all(math.isfinite(loss) for loss in a["losses"])
    assert [v["step"] for v in a["val_losses"]] == [3, 4]
    assert all(math.isfinite(v["val_loss"]) for v in a["val_losses"])
    assert a["val_losses"] == b["val_losses"]
    assert a["losses"] == b["losses"]


def test_the_sweep_report_has_a_val_loss_column(runs):
    jobs = [Job(name, path, summary=summary(path)) for name, path in runs["dirs"].items()]
    columns, table = rows(jobs)
    by_job = {row[0]: dict(zip(columns, row)) for row in table}
    assert by_job["eval"]["val_loss"] == summary(runs["dirs"]["eval"])["val_loss"]
    assert by_job["no_eval"]["val_loss"] is None


@pytest.mark.parametrize(
    "option, message",
    [
        ({"eval_every": -1}, "train.eval_every=-1 is invalid: it must be steps >= 1, or 0 for no eval"),
        ({"eval_batches": 0}, "train.eval_batches=0 is invalid: it must be an integer >= 1"),
    ],
    ids=["eval_every", "eval_batches"],
)
def test_bad_eval_counts_are_refused(option, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        TrainConfig(**option)


def test_eval_without_a_held_out_split_fails_at_start_up(tmp_path):
    tokens = tmp_path / "train.bin"
    tokens.write_bytes(bytes(4096))  # 2048 uint16 zeros
    run_dir = tmp_path / "run"
    overrides = ["data=memmap", f"data.path={tokens}", "data.vocab_size=256", "train.eval_every=10"]
    defaults = [o for o in TINY if not o.startswith("data=")]
    result = python_run(run_dir, *defaults, *overrides, check=False, timeout=120)
    assert result.returncode == 2
    message = "train.eval_every=10 needs a held-out split, and this data has none: set data.val_path=FILE"
    assert f"stagecheck: error: {message}" in result.stderr, result.stderr
    assert "Traceback" not in result.stderr + result.stdout
    assert not run_dir.exists()
