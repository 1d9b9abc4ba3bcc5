"""Bad input fails at start-up: non-zero exit, one message naming the option and the allowed values,
no traceback, and no run directory or file left behind."""

import re
import subprocess
import sys

import pytest
import torch

from harness.run_dir import check_directory_overrides
from tests.runs import REPO, TINY, cpu_env, launch, python_run

CASES = [
    (["+recompute=sometimes"], "recompute=sometimes is unknown: allowed values are auto, full, none, plan, selective"),
    (["model.n_embd=100", "model.n_head=3"], "model.n_embd=100 is not divisible by model.n_head=3"),
    (["parallel.pipeline_stages=3"], "parallel.pipeline_stages=3 does not divide the world size 1"),
    (["train.steps=0"], "train.steps=0 is invalid: it must be a positive integer"),
    (["train.micro_batches=-2"], "train.micro_batches=-2 is invalid"),
    (["train.micro_batch_size=0"], "train.micro_batch_size=0 is invalid"),
    (
        ["parallel.partition_method=random"],
        "parallel.partition_method='random' is unknown: allowed values are balanced, parameters, uniform, type:Block",
    ),
    (["data=text", "data.path=/no/such/corpus"], "data.path='/no/such/corpus' does not exist"),
    (
        ["+recompute=full", "recompute.interval=0"],
        "recompute.interval='0' is invalid: allowed values are a positive integer",
    ),
    (["+recompute=full", "recompute.interval=often"], "recompute.interval='often' is invalid"),
    (
        ["+recompute=selective", "recompute.modules=[attention]"],
        "recompute.modules=['attention'] is invalid: choose one or more of core_attn",
    ),
    (["model.attention=flash9"], "model.attention='flash9' is unknown: allowed values are sdpa, math"),
    (["train.precision=fp8"], "train.precision='fp8' is unknown: allowed values are auto, fp32, bf16, fp16"),
    (["parallel.schedule=foo"], "parallel.schedule='foo' is unknown: allowed values are 1f1b, zb-h1, auto"),
    (
        ["+recompute=none", "recompute.early=true"],
        "recompute.early=true is invalid with +recompute=none: nothing is recomputed under +recompute=none",
    ),
    (
        ["train.compile=true", "+recompute=full", "parallel.schedule=zb-h1"],
        "train.compile=true needs parallel.schedule=1f1b, not zb-h1: its split backward defers",
    ),
    (
        ["parallel.schedule=zb-v", "model.n_layer=1"],
        "parallel.schedule=zb-v splits the model into 2 chunks per rank, 2 in all: model.n_layer=1 is fewer blocks",
    ),
    (
        ["parallel.schedule=interleaved-1f1b", "parallel.chunks=5"],
        "parallel.schedule=interleaved-1f1b splits the model into 5 chunks per rank, 5 in all: model.n_layer=4 is "
        "fewer blocks; use model.n_layer >= 5 or parallel.chunks=null",
    ),
    (
        ["parallel.schedule=v-half", "parallel.chunks=3"],
        "parallel.chunks=3 with parallel.schedule=v-half: a V holds 2 chunks per rank; use parallel.chunks=2 or null",
    ),
    (["parallel.chunks=1"], "parallel.chunks=1 is invalid: use 2 or more chunks per rank, or null"),
    (
        ["+recompute=full", "recompute.micro_batches=0"],
        "recompute.micro_batches=0 is invalid: it must be from 1 to train.micro_batches, or null (all)",
    ),
    (
        ["+recompute=selective", "recompute.micro_batches=5", "train.micro_batches=4"],
        "recompute.micro_batches=5 exceeds train.micro_batches=4: it must be from 1 to 4, or null (all)",
    ),
    (
        ["+recompute=full", "recompute.compress=int4"],
        "recompute.compress='int4' is unknown: allowed values are none, bf16, fp8, int8",
    ),
    (
        ["+recompute=auto", "recompute.compress=bf16", "train.precision=bf16"],
        "recompute.compress=bf16 stores nothing less under train.precision=bf16: use recompute.compress=fp8 or none",
    ),
]
if not torch.cuda.is_available():  # the other CUDA refusals: tests/test_gpu_readiness.py
    CASES.append((["train.device=cuda"], "train.device='cuda' but no CUDA device is visible: use train.device=cpu"))


@pytest.mark.parametrize("overrides, message", CASES, ids=lambda v: " ".join(v) if isinstance(v, list) else None)
def test_bad_input_fails_at_start_up(tmp_path, overrides, message):
    run_dir = tmp_path / "run"
    overridden = {o.split("=")[0] for o in overrides}
    defaults = [o for o in TINY if o.split("=")[0] not in overridden]
    result = python_run(run_dir, *defaults, *overrides, check=False, timeout=120)
    assert result.returncode != 0
    assert message in result.stderr, result.stderr
    assert "Traceback" not in result.stderr + result.stdout
    assert not run_dir.exists()


CONFIG_ERRORS = [
    (["+recompute=selectiv"], "recompute=selectiv is unknown: did you mean recompute=selective? allowed values are "),
    (["model=nosuch"], "model=nosuch is unknown: allowed values are gpt2, gpt2-large,"),
    (["variant=full_one"], "variant=full_one is unknown: did you mean variant=full_1? allowed values are full_1,"),
    (["data=text", "data.tokenzier=bpe"], "data.tokenzier is not an option: did you mean data.tokenizer?"),
    (["trian.steps=3"], "trian is not an option: did you mean train?"),
    (["+train.seeed=3"], "train.seeed is not an option: the options of train are train.steps,"),
    (["recompute=auto"], "recompute=auto chooses a group that is absent by default: did you mean +recompute=auto?"),
    (["+recompte=full"], "recompte is not an option: did you mean recompute?"),
    (["recompute.interval=2"], "recompute.interval needs a recompute mode: add +recompute=full, selective, none or"),
    (["train.steps=many"], "train.steps='many' is invalid: it must be an integer"),
    (["dry_run=maybe"], "dry_run='maybe' is invalid: it must be true or false"),
    (["+train.steps=3"], "+train.steps=... adds an option that exists already: set it without the + (train.steps=...)"),
    (["variant=full_1", "+recompute=selective"], "variant=full_1 and +recompute=selective both choose recompute: keep"),
]


@pytest.mark.parametrize(
    "overrides, message", CONFIG_ERRORS, ids=lambda v: " ".join(v) if isinstance(v, list) else None
)
def test_config_errors_are_one_line_naming_the_key_and_exit_2(tmp_path, overrides, message):
    """An unknown option or key, a wrong type, two choices of one group: one line, exit 2, no internal schema name."""
    run_dir = tmp_path / "run"
    result = python_run(run_dir, *TINY, *overrides, check=False, timeout=120)
    assert result.returncode == 2
    (line,) = result.stderr.splitlines()
    assert line.startswith("stagecheck: error: ") and message in line, line
    assert "_schema" not in line and not run_dir.exists()


def test_stages_exceeding_blocks_fail_before_any_process_group(tmp_path):
    env = cpu_env(tmp_path, RANK="0", WORLD_SIZE="8", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT="1")
    result = python_run(tmp_path / "run", *TINY, "parallel.pipeline_stages=8", check=False, env=env)
    assert result.returncode == 2
    assert "parallel.pipeline_stages=8 exceeds model.n_layer=4" in result.stderr
    assert not (tmp_path / "run").exists()


def test_bad_launcher_environment_names_the_variable(tmp_path):
    env = cpu_env(tmp_path, RANK="3", WORLD_SIZE="2", MASTER_ADDR="127.0.0.1")
    result = python_run(tmp_path / "run", *TINY, check=False, env=env)
    assert result.returncode == 2
    assert "RANK=3 is invalid: it must be in [0, WORLD_SIZE=2)" in result.stderr


def test_an_existing_run_is_never_overwritten(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text('{"step": 1}\n')
    result = python_run(run_dir, *TINY, "train.resume=false", check=False)
    assert result.returncode == 2
    assert "already holds a run" in result.stderr
    assert (run_dir / "metrics.jsonl").read_text() == '{"step": 1}\n'


@pytest.mark.multiproc
def test_bad_input_through_the_deepspeed_launcher(tmp_path):
    run_dir = tmp_path / "run"
    result = launch(run_dir, *TINY, "parallel.pipeline_stages=3", check=False, timeout=180)
    assert result.returncode != 0
    # Once, from rank 0: every rank finds the same error in the same config.
    assert (result.stderr + result.stdout).count("parallel.pipeline_stages=3 does not divide the world size 2") == 1
    assert not run_dir.exists()
    typo = launch(run_dir, *TINY, "train.stpes=3", check=False, timeout=180)
    assert typo.returncode == 2
    assert typo.stderr.count("stagecheck: error: train.stpes is not an option: did you mean train.steps?") == 1
    assert "Traceback" not in typo.stderr + typo.stdout and not run_dir.exists()


def test_a_file_or_a_path_under_one_as_the_output_directory_is_refused(tmp_path):
    file = tmp_path / "notes.txt"
    file.write_text("mine\n")
    for override, message in [
        (f"hydra.run.dir={file}", f"hydra.run.dir='{file}' is a file: choose a directory"),
        (f"++hydra.run.dir={file}/run", f"hydra.run.dir='{file}/run' is under '{file}', which is a file: choose"),
        (f"hydra.sweep.dir='{file}'", f"hydra.sweep.dir='{file}' is a file: choose a directory"),
    ]:
        with pytest.raises(ValueError, match=re.escape(message)):
            check_directory_overrides(["model=tiny", override])
    for fine in (f"hydra.run.dir={tmp_path}", f"hydra.run.dir={tmp_path}/new/run", "hydra.run.dir=${oc.env:X}/run"):
        check_directory_overrides([fine])  # a directory, one Hydra makes, one only Hydra can resolve
    check_directory_overrides([f"data.path={file}"])  # other options are not directories to make


@pytest.mark.parametrize("script", ["train.py", "generate.py", "export_hf.py"])
def test_a_file_as_the_run_directory_ends_each_command_before_hydra_runs(tmp_path, script):
    """Hydra itself would end in a FileExistsError traceback while making the directory."""
    file = tmp_path / "notes.txt"
    file.write_text("mine\n")
    run = [sys.executable, script, f"hydra.run.dir={file}"]  # refused before any other option is read
    result = subprocess.run(run, cwd=REPO, env=cpu_env(tmp_path), capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    refusal = f"hydra.run.dir='{file}' is a file: choose a directory (or leave hydra.run.dir unset)"
    assert result.stderr == f"stagecheck: error: {refusal}\n"
    assert file.read_text() == "mine\n" and list(tmp_path.iterdir()) == [file]
