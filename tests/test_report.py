"""The sweep report from fixture job directories (real summaries of a 2-stage tiny sweep, with round
throughputs): the table's figures, the figure file, the W&B report run, and the command line."""

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from model import GPTConfig
from parallel.planning.config import FullRecompute, NoRecompute
from parallel.planning.layout import build_layout
from parallel.planning.run_plan import plan_run
from parallel.planning.shapes import MIB, RunShape, Target, Topology
from sweep.report import write_report
from sweep.report.loading import load_jobs
from sweep.report.table import rows
from tests import wandb_file

FIXTURE = Path(__file__).resolve().parent / "fixtures" / "sweep_report"
REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def sweep(tmp_path, monkeypatch):
    for name, sub in (
        ("WANDB_CONFIG_DIR", ".wandb-config"),
        ("WANDB_CACHE_DIR", ".wandb-cache"),
        ("WANDB_DATA_DIR", ".wandb-data"),
    ):
        monkeypatch.setenv(name, str(tmp_path / sub))
    monkeypatch.setenv("WANDB_MODE", "offline")
    target = tmp_path / "sweep-fixture"
    shutil.copytree(FIXTURE, target)
    return target


def fixture_summary(num: str) -> dict:
    return json.loads((FIXTURE / num / "summary.json").read_text())


def table_row(markdown: str, job: str) -> list[str]:
    (line,) = [row for row in markdown.splitlines() if row.startswith(f"| {job} |")]
    return [cell.strip() for cell in line.strip("|").split("|")]


def test_report_table_from_fixture_summaries(sweep):
    out = write_report(sweep, wandb=False)
    markdown = out["markdown"].read_text()
    assert "4 jobs in" in markdown and "3 done, 1 failed" in markdown
    none, full, selective = (table_row(markdown, n) for n in "012")
    assert none[:3] == ["0", "none", "-"] and full[:3] == ["1", "full", "interval 1"]
    assert selective[:3] == ["2", "selective", "core_attn"]
    # tokens/s and the time overhead against none (fixture step times 1, 4/3 and 10/9 s)
    assert [none[3], full[3], selective[3]] == ["1,000", "750", "900"]
    assert [none[4], full[4], selective[4]] == ["+0.0%", "+33.3%", "+11.1%"]
    # activation bytes per stage (MiB), measured and predicted, and their agreement
    act = fixture_summary("1")["activation_bytes_per_stage"]
    assert full[5] == " / ".join(f"{b / MIB:.3g}" for b in act) == full[6]
    assert full[7] == "0.0%"
    # saving of peak activation memory against none, per stage
    peak_none = fixture_summary("0")["peak_activation_bytes_per_stage"]
    peak_full = fixture_summary("1")["peak_activation_bytes_per_stage"]
    assert full[9] == " / ".join(f"{(1 - f / n) * 100:.1f}%" for f, n in zip(peak_full, peak_none))
    # peak tensors: measured (none in these CPU summaries: the resident set they hold is never shown) and predicted
    assert full[10] == "n/a"
    assert all(cell != "n/a" for cell in full[11].split(" / "))  # planned from config.yaml
    assert "the job's plan.json (1 jobs)" in markdown and "planned here from the job's config.yaml (2 jobs)" in markdown
    assert "## Failed jobs" in markdown and "- job 3 (none): stagecheck: error: parallel.pipeline_stages=3" in markdown
    assert "largest error 0.00% over 3 jobs" in markdown


def test_report_rows_hold_plain_values_for_wandb(sweep):
    columns, table = rows(load_jobs(sweep))
    by_job = {row[0]: dict(zip(columns, row)) for row in table}
    assert by_job["1"]["time_overhead_vs_none"] == pytest.approx(1 / 3)
    assert by_job["0"]["saving_vs_none_per_stage"] == [0.0, 0.0]
    assert by_job["3"]["status"] == "failed" and by_job["3"]["tokens_per_s"] is None
    assert by_job["2"]["predicted_peak_tensor_bytes_per_stage"] == [
        s["predicted_peak_bytes"] for s in json.loads((FIXTURE / "2" / "plan.json").read_text())["stages"]
    ]


def test_report_png_is_drawn(sweep):
    import matplotlib.image

    png = write_report(sweep, wandb=False)["png"]
    height, width, _ = matplotlib.image.imread(png).shape
    assert width > 1000 and height > 700


def test_plan_only_and_incomplete_jobs_are_reported(sweep):
    (sweep / "4").mkdir()
    shutil.copy(FIXTURE / "2" / "plan.json", sweep / "4" / "plan.json")  # a dry-run job: plan.json only
    (sweep / "5").mkdir()  # a job that never got far
    markdown = write_report(sweep, wandb=False)["markdown"].read_text()
    assert "1 planned only (dry run), 1 incomplete" in markdown
    planned = table_row(markdown, "4")
    assert planned[1:4] == ["selective", "core_attn", "n/a"] and planned[6] != "n/a"


def test_a_plan_json_that_is_no_plan_counts_as_none(sweep):
    """A plan.json of another layout (or not JSON) leaves the job without a plan: no crash, no predictions."""
    (sweep / "4").mkdir()
    (sweep / "4" / "plan.json").write_text(json.dumps({"stages": [{"activation_bytes_per_microbatch": 1}]}))
    (sweep / "5").mkdir()
    (sweep / "5" / "plan.json").write_text("{not json")
    jobs = {job.num: job for job in load_jobs(sweep)}
    assert jobs["4"].plan is None and jobs["4"].status == "incomplete"
    assert jobs["5"].plan is None and jobs["5"].status == "incomplete"
    assert "0 planned only (dry run), 2 incomplete" in write_report(sweep, wandb=False)["markdown"].read_text()


def finished(run_file: Path) -> bool:
    try:
        return "exit" in {r.WhichOneof("record_type") for r in wandb_file.read_records(run_file)}
    except wandb_file.CorruptWandbFile:  # a block still being written
        return False


def test_report_is_logged_to_wandb_in_the_sweep_group(sweep):
    out = write_report(sweep)  # the logger config comes from the sweep's multirun.yaml (offline)
    (run_file,) = wandb_file.find_run_files(out["wandb_dir"])
    # In-process, W&B's service may still be writing the file after finish() returns: wait for it.
    deadline = time.monotonic() + 30
    while not finished(run_file):
        assert time.monotonic() < deadline, f"{run_file} has no exit record"
        time.sleep(0.5)
    info = wandb_file.run_info(run_file)
    assert (info["group"], info["job_type"], info["name"]) == ("sweep-fixture", "report", "sweep-fixture-report")
    logged = {k for record in wandb_file.history(run_file) for k in record}
    assert {"report", "report_png"} <= logged


def test_report_command_line(sweep, tmp_path):
    done = subprocess.run(
        [sys.executable, "report.py", str(sweep), "--no-wandb"], cwd=REPO, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    assert (sweep / "report.md").exists() and (sweep / "report.png").exists()
    (tmp_path / "empty").mkdir()
    refused = subprocess.run(
        [sys.executable, "report.py", str(tmp_path / "empty"), "--no-wandb"], cwd=REPO, capture_output=True, text=True
    )
    assert refused.returncode == 2 and "holds no job directories" in refused.stderr


def test_auto_jobs_of_a_second_multirun_join_the_report(sweep):
    """`-m +recompute=auto recompute.budget_gb=... hydra.sweep.subdir=auto_${hydra.job.num}` into the same
    sweep directory: the report lists the auto jobs after the uniform ones, with their plan."""
    shutil.copytree(FIXTURE.parent / "sweep_report_auto" / "auto_0", sweep / "auto_0")
    jobs = load_jobs(sweep)
    assert [job.num for job in jobs] == ["0", "1", "2", "3", "auto_0"]
    auto = jobs[-1]
    assert auto.mode == "auto" and auto.plan_source == "config.yaml"
    planned = [s.activation_bytes_per_microbatch for s in auto.plan.stages]
    assert planned == auto.summary["activation_bytes_per_stage"]
    markdown = write_report(sweep, wandb=False)["markdown"].read_text()
    assert table_row(markdown, "auto_0")[1:3] == ["auto", "budget 0.0135 GiB"]


def dry_run_sweep(root: Path, partition: str) -> Path:
    """A dry-run sweep as `train.py -m dry_run=true` leaves it: multirun.yaml and one plan.json per job, no
    config.yaml, no summary.json (the plans made in-process by the planner the dry run calls)."""
    cfg = GPTConfig(n_layer=6, n_head=4, n_embd=128, seq_len=128, dropout=0.1)
    run = RunShape(Topology(2), Target("cpu", "fp32"), micro_batches=4, micro_batch_size=2)
    for num, recompute in enumerate((NoRecompute(), FullRecompute(interval="1"))):
        plan = plan_run(cfg, recompute, build_layout(cfg, recompute, run, partition, 1234), run)
        (root / str(num)).mkdir(parents=True)
        (root / str(num) / "plan.json").write_text(json.dumps(plan.to_json()))
    (root / "multirun.yaml").write_text(yaml.safe_dump({"parallel": {"partition_method": partition}}))
    return root


def column(markdown: str, name: str, job: str) -> str:
    (header,) = [row for row in markdown.splitlines() if row.startswith("| job |")]
    names = [cell.strip() for cell in header.strip("|").split("|")]
    return table_row(markdown, job)[names.index(name)]


def test_a_dry_run_sweep_shows_each_plans_step_time_and_blocks_and_draws_its_figure(tmp_path):
    sweep = dry_run_sweep(tmp_path / "dry", "balanced")
    out = write_report(sweep, wandb=False)
    markdown = out["markdown"].read_text()
    assert "2 planned only (dry run)" in markdown
    for job in load_jobs(sweep):
        assert column(markdown, "step time pred.", job.num) == f"{job.plan.predicted_step_time_s * 1e3:,.1f}"
        assert column(markdown, "blocks/stage", job.num) == "/".join(str(s.blocks) for s in job.plan.stages)
        assert column(markdown, "step time", job.num) == "n/a"  # nothing measured
    assert out["png"] is not None and out["png"].exists() and "![memory per stage" in markdown


def test_blocks_per_stage_are_shown_only_where_the_partition_can_move(tmp_path):
    fixed = write_report(dry_run_sweep(tmp_path / "fixed", "type:Block"), wandb=False)["markdown"].read_text()
    assert "blocks/stage" not in fixed
    columns, table = rows(load_jobs(tmp_path / "fixed"))
    assert [row[columns.index("blocks_per_stage")] for row in table] == [[3, 3], [3, 3]]


def test_the_figure_plots_peak_tensor_bytes_not_the_cpu_resident_set(sweep):
    """On CPU, peak_memory_bytes_per_stage is the resident set (the interpreter and its libraries: no plan predicts
    it); the figure's memory panel takes the measured peak tensor bytes, which the planner predicts."""
    jobs = {job.num: job for job in load_jobs(sweep)}
    assert jobs["0"].summary["peak_memory_kind"] == "cpu_max_rss" and jobs["0"].measured_peak_tensors() is None
    summary = fixture_summary("0") | {"measured_peak_tensor_bytes_per_stage": [5 * MIB, 4 * MIB]}
    (sweep / "0" / "summary.json").write_text(json.dumps(summary))
    assert load_jobs(sweep)[0].measured_peak_tensors() == [5 * MIB, 4 * MIB]


def _set(sweep: Path, num: str, summary: dict | None = None, config: dict | None = None) -> None:
    """Change one fixture job's summary.json and config.yaml fields."""
    if summary:
        data = json.loads((sweep / num / "summary.json").read_text()) | summary
        (sweep / num / "summary.json").write_text(json.dumps(data))
    if config:
        data = yaml.safe_load((sweep / num / "config.yaml").read_text()) | config
        (sweep / num / "config.yaml").write_text(yaml.safe_dump(data))


def test_one_round_is_flagged_and_repeated_rounds_give_the_spread(sweep):
    """The issue's case: single measurements shown as overheads with no spread and no warning."""
    single = write_report(sweep, wandb=False)["markdown"].read_text()
    assert "## Throughput over rounds" in single and "| full/1 | 1 | 750 | n/a | +33.3% | n/a | one round" in single
    assert "Warning: each setting ran once" in single and "-m round=0,1,2" in single
    # a second round of none and full: none at 800 tokens/s (busier), full at 875
    for num, copy, step in (("0", "4", 1.25), ("1", "5", 8 / 7)):
        shutil.copytree(sweep / num, sweep / copy)
        _set(sweep, copy, {"step_time_s": step, "tokens_per_s": 1000 / step}, {"round": 1})
    markdown = write_report(sweep, wandb=False)["markdown"].read_text()
    assert "Warning: each setting ran once" not in markdown
    # full against each round's none: +33.3% and -8.6%; the rounds' spread is 25% (none's 1,000 against 800)
    assert "| full/1 | 2 | 812 | 16.7% | +12.4% | -8.6% .. +33.3% | within noise (25.0% spread) |" in markdown
    assert column(markdown, "round", "5") == "1" and column(markdown, "overhead", "5") == "-8.6%"


def test_a_stage_is_never_compared_with_another_partitions_and_the_same_plan_is_noise(sweep):
    # full on other stage boundaries than none's: its stage 0 holds other layers, no per-stage saving
    _set(
        sweep,
        "1",
        {
            "layout": [
                {"stage": 0, "layers": [0, 3], "choices": ["full"]},
                {"stage": 1, "layers": [3, 8], "choices": ["full"] * 3},
            ]
        },
    )
    # selective that trained exactly what none did (an auto budget that needed no recompute would)
    _set(sweep, "2", {"layout": fixture_summary("0")["layout"]})
    markdown = write_report(sweep, wandb=False)["markdown"].read_text()
    assert column(markdown, "saving", "1") == "n/a"
    assert column(markdown, "overhead", "2") == "+11.1% (same plan as none: noise)"
    assert "| selective/core_attn | 1 | 900 | n/a | +11.1% | n/a | noise: the same plan as none |" in markdown
