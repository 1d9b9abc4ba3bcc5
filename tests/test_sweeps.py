"""Sweeps: every shipped Hydra sweep and W&B sweep file composes, job by job, exactly as train.py composes;
real 2-rank multiruns run their jobs in the same ranks, mark a failed job and go on, and end with one report."""

import itertools
from pathlib import Path

import pytest
import yaml
from hydra import compose, initialize_config_dir
from hydra.core.override_parser.overrides_parser import OverridesParser

from harness.run_dir import register_run_stamp_resolver
from schema import register_schemas
from schema.checks import to_run_config, topology
from tests import wandb_file, wandb_sweep
from tests.runs import TINY, launch_multirun, summary

REPO = Path(__file__).resolve().parents[1]
CONF = REPO / "conf"
SWEEPS = sorted(p.stem for p in (CONF / "sweep").glob("*.yaml"))
VARIANTS = sorted(p.stem for p in (CONF / "variant").glob("*.yaml"))
WANDB_SWEEPS = sorted((REPO / "launch").glob("wandb_sweep_*.yaml"))

register_schemas()
register_run_stamp_resolver()


def compose_cfg(*overrides: str, hydra_node: bool = False):
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides), return_hydra_config=hydra_node)


def check_job(*overrides: str, world: int = 2):
    """One job's config, validated as start-up validates it (typed schemas, then the topology)."""
    run = to_run_config(compose_cfg(*overrides))
    topology(run, world)
    return run


def sweep_jobs(name: str) -> list[list[str]]:
    """The jobs Hydra's basic sweeper runs for `-m +sweep=NAME`: the cartesian product of its params."""
    params = compose_cfg(f"+sweep={name}", hydra_node=True).hydra.sweeper.params
    parsed = OverridesParser.create().parse_overrides([f"{k}={v}" for k, v in params.items()])
    axes = [[f"{o.get_key_element()}={value}" for value in o.sweep_string_iterator()] for o in parsed]
    return [list(job) for job in itertools.product(*axes)]


# ---- composition (no launch) -------------------------------------------------------------------------------


def test_shipped_sweeps_and_variants_exist():
    assert {"recompute_modes", "memory_vs_seq_len", "memory_vs_micro_batch"} <= set(SWEEPS)
    assert {"none", "full_1", "full_stage", "selective_core_attn"} <= set(VARIANTS)
    assert [p.name for p in WANDB_SWEEPS] == [f"wandb_sweep_{name}.yaml" for name in SWEEPS]


@pytest.mark.parametrize("variant", VARIANTS)
def test_every_variant_composes_to_its_recompute_config(variant):
    recompute = check_job(f"variant={variant}").recompute
    mode, _, setting = variant.partition("_")
    assert recompute.mode == mode
    if mode == "full":
        assert recompute.interval == setting
    if mode == "selective":
        assert "+".join(recompute.modules) in {setting, "core_attn+mlp_act+layernorm"}


def test_variant_and_recompute_cannot_both_be_given():
    with pytest.raises(Exception, match="Multiple values for recompute"):
        compose_cfg("variant=full_1", "+recompute=selective")


@pytest.mark.parametrize("name", SWEEPS)
def test_every_job_of_every_shipped_sweep_composes(name):
    jobs = sweep_jobs(name)
    assert len(jobs) >= 4
    for job in jobs:
        run = check_job(f"+sweep={name}", *job)
        assert run.recompute.mode in ("none", "full", "selective")
    sweep = compose_cfg(f"+sweep={name}", hydra_node=True).hydra.sweep.dir
    assert sweep.startswith(f"multirun/{name}-")


def test_memory_sweeps_vary_what_they_say():
    seq = {check_job("+sweep=memory_vs_seq_len", *job).model.seq_len for job in sweep_jobs("memory_vs_seq_len")}
    assert seq == {128, 256, 512}
    runs = [check_job("+sweep=memory_vs_micro_batch", *job) for job in sweep_jobs("memory_vs_micro_batch")]
    assert {r.train.micro_batch_size for r in runs} == {1, 2, 4, 8}
    assert {r.train.micro_batches for r in runs} == {4}  # the count stays fixed


@pytest.mark.parametrize("path", WANDB_SWEEPS, ids=lambda p: p.stem)
def test_wandb_sweep_file_is_valid_and_every_combination_composes(path):
    config = yaml.safe_load(path.read_text())
    assert wandb_sweep.schema_violations(config) == []
    hydra_sweep = sweep_jobs(path.stem.removeprefix("wandb_sweep_"))
    combos = wandb_sweep.grid(config)
    assert len(combos) == len(hydra_sweep)  # the same jobs as the Hydra sweep of the same name
    for params in combos:
        argv = wandb_sweep.agent_command(config, params)
        assert argv[:5] == ["/usr/bin/env", "deepspeed", "--num_gpus", "2", "train.py"]
        overrides = argv[5:]
        assert all("=" in o and not o.startswith("-") for o in overrides), overrides
        run = check_job(*overrides)
        assert run.logger.mode == "online"
        if "model.seq_len" in params:
            assert run.model.seq_len == params["model.seq_len"]


def test_schema_check_rejects_what_wandb_rejects():
    good = {"method": "grid", "parameters": {"variant": {"values": ["none"]}}}
    assert wandb_sweep.schema_violations(good) == []
    bad = [
        {"parameters": {"variant": {"values": ["none"]}}},  # no method
        {"method": "grid", "parameters": {"+variant": {"values": ["none"]}}},  # name W&B refuses
        {"method": "sweep", "parameters": {"a": {"values": [1]}}},  # unknown method
        {"method": "grid", "parameters": {"a": {"min": 0, "max": 1}}},  # not a finite grid
        {"method": "grid", "parameters": {"a": {"values": []}}},  # empty values
        {"method": "grid", "parameters": {"a": {"values": [1]}}, "comand": []},  # typo at the top level
        {"method": "grid", "parameters": {"a": {"values": [1]}}, "command": ["${argz}"]},
    ]
    for config in bad:
        assert wandb_sweep.schema_violations(config), config


# ---- real multiruns ----------------------------------------------------------------------------------------


@pytest.mark.multiproc
def test_multirun_runs_three_modes_in_the_same_ranks_and_reports(tmp_path):
    sweep = tmp_path / "sweep"
    result = launch_multirun(sweep, *TINY, "train.steps=2", "train.trace_step=0", "+recompute=none,full,selective")
    jobs = sorted(p.name for p in sweep.iterdir() if p.is_dir() and p.name.isdigit())
    assert jobs == ["0", "1", "2"]
    summaries = {n: summary(sweep / n) for n in jobs}
    assert [summaries[n]["recompute"] for n in jobs] == ["none", "full", "selective"]
    for n in jobs:  # each job directory holds what a single run's does
        assert {"config.yaml", "metrics.jsonl", "summary.json", "wandb"} <= {p.name for p in (sweep / n).iterdir()}
        assert not (sweep / n / "FAILED").exists()
    # a fresh engine per job: the same seed gives the same (bit-identical) losses in every mode
    assert summaries["0"]["losses"] == summaries["1"]["losses"] == summaries["2"]["losses"]
    assert "still referenced" not in result.stderr  # the previous job's engine was freed
    # W&B: one group (the sweep directory's name), the mode as job_type, model and stages as tags
    infos = [wandb_file.run_info(p) for n in jobs for p in wandb_file.find_run_files(sweep / n / "wandb")]
    assert [i["job_type"] for i in infos] == ["none", "full", "selective"]
    assert {i["group"] for i in infos} == {"sweep"}
    assert all({"model:4L-128h", "stages:2"} <= set(i["tags"]) for i in infos)
    # one report, also logged to W&B in the sweep's group
    report = (sweep / "report.md").read_text()
    assert report.count("\n| 0 | none") == 1 and "| 1 | full | interval 1 |" in report and "| 2 | selective |" in report
    assert (sweep / "report.png").stat().st_size > 10_000
    (report_run,) = wandb_file.find_run_files(sweep / "wandb")
    assert (wandb_file.run_info(report_run)["group"], wandb_file.run_info(report_run)["job_type"]) == (
        "sweep",
        "report",
    )


@pytest.mark.multiproc
def test_failing_jobs_are_marked_and_the_sweep_goes_on(tmp_path):
    sweep = tmp_path / "sweep"
    # jobs 0, 1: 3 stages on 2 ranks fail start-up validation on every rank; job 2: a NaN loss at step 1
    # stops it on every rank together (train.nan_policy=stop); job 3 runs after them
    result = launch_multirun(
        sweep,
        *TINY,
        "train.steps=2",
        "train.trace_step=0",
        "logger=none",
        "parallel.pipeline_stages=3,2",
        "train.inject_nan_at_steps=[1],[]",
        check=False,
    )
    assert result.returncode == 2, result.stderr[-3000:]  # the first failed job's exit code
    for job in ("0", "1"):
        failed = (sweep / job / "FAILED").read_text()
        assert "parallel.pipeline_stages=3 does not divide the world size 2" in failed
        assert failed.count("\n") == 1  # written once (rank 0), though every rank failed
        assert not (sweep / job / "summary.json").exists()
    assert "non-finite loss or gradients" in (sweep / "2" / "FAILED").read_text()
    assert not (sweep / "2" / "summary.json").exists()
    assert summary(sweep / "3")["pipeline_stages"] == 2 and not (sweep / "3" / "FAILED").exists()
    assert "3 job(s) failed: 0 (exit 2), 1 (exit 2), 2 (exit 3)" in result.stderr
    report = (sweep / "report.md").read_text()
    assert "## Failed jobs" in report and "- job 0 (none): stagecheck: error: parallel.pipeline_stages=3" in report
    assert "| 3 | none |" in report


def test_a_finished_job_is_one_with_the_same_config_but_for_how_it_was_launched(tmp_path):
    """sweep/job.py's finished_in, which a relaunched sweep (and hydra/launcher=slurm) uses to skip a job: summary.json,
    no FAILED, and config.yaml equal to the job's config but for train.resume and train.overwrite."""
    from omegaconf import OmegaConf

    from sweep.job import FAILED, finished_in

    def job(*overrides: str):
        return compose_cfg(*TINY, "train.steps=2", *overrides)

    (tmp_path / "config.yaml").write_text(OmegaConf.to_yaml(OmegaConf.to_container(job(), resolve=True)))
    assert not finished_in(tmp_path, job())  # no summary.json: it did not finish
    (tmp_path / "summary.json").write_text("{}")
    assert finished_in(tmp_path, job())
    assert finished_in(tmp_path, job("train.overwrite=true", "train.resume=false"))
    assert not finished_in(tmp_path, job("train.steps=3"))  # another config: continued from its checkpoint
    assert not finished_in(tmp_path, job("+recompute=full"))
    (tmp_path / FAILED).write_text("rank 1 failed\n")
    assert not finished_in(tmp_path, job())


@pytest.mark.multiproc
def test_a_failure_inside_training_ends_the_sweep_and_a_relaunch_finishes_it(tmp_path):
    """Job 1 fails at step 3 and the sweep stops there (a documented limit: sweep/job.py). Relaunched into its
    directory, the sweep skips job 0 (finished with this config), continues job 1 from its step-2 checkpoint
    (train.resume=auto; its FAILED kept as FAILED.1) and runs job 2."""
    from tests.runs import cpu_env

    sweep = tmp_path / "sweep"
    jobs = [*TINY, "train.steps=2,4,3", "train.save_every=2", "train.trace_step=0", "logger=none", "+recompute=full"]
    env = cpu_env(tmp_path, STAGECHECK_TEST_FAIL="1:3")  # rank 1 raises at step 3: job 0 has only 2
    result = launch_multirun(sweep, *jobs, check=False, env=env, timeout=300)
    assert result.returncode != 0
    assert "rank 1 failed: RuntimeError: injected failure" in (sweep / "1" / "FAILED").read_text()
    assert not (sweep / "2").exists()
    finished = (sweep / "0" / "summary.json").stat().st_mtime_ns

    again = launch_multirun(sweep, *jobs, timeout=300)
    assert f"stagecheck: sweep job 0 already finished in {sweep / '0'}: skipped" in again.stdout
    assert (sweep / "0" / "summary.json").stat().st_mtime_ns == finished
    assert "injected failure" in (sweep / "1" / "FAILED.1").read_text()
    assert not (sweep / "1" / "FAILED").exists()
    assert f"resuming from {sweep / '1' / 'checkpoints' / 'step_00000002'}" in again.stdout + again.stderr
    assert [len(summary(sweep / job)["losses"]) for job in ("0", "1", "2")] == [2, 4, 3]
    assert "job(s) failed" not in again.stderr
    report = (sweep / "report.md").read_text()
    assert all(f"| {job} | full" in report for job in ("0", "1", "2")) and "## Failed jobs" not in report
