"""evaluate.py: lm-eval's tasks (the shipped tasks/ and a user's folder, all local) on a model in this process
(harness/eval_model.py) and on its Hugging Face export through lm-eval's own `hf` model, with the same numbers; the
results folder, its W&B file and the summary line; bad input. The 2-stage checkpoint's evaluation against its
export's is in tests/test_prepare_data.py, which owns that run."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from data import MemmapDataConfig, open_tokenizer
from harness.eval_model import CheckpointLM
from harness.hf.export import write_hf_dir
from harness.lm_evaluation import evaluate, run_tasks
from model import GPT, GPTConfig
from schema.scripts import EvaluateConfig
from tests import wandb_file
from tests.runs import REPO, cpu_env
from tests.test_prepare_data import (
    RUN_DOCUMENTS,
    RUN_VOCAB,
    byte_level_bpe,
    metaspace_bpe,
    run_prepare,
    write_jsonl,
)

TASKS = ["stagecheck_mc", "stagecheck_gen", "stagecheck_val_ppl"]


def read_samples(out: Path, task: str) -> list[dict]:
    return [json.loads(line) for line in (out / f"samples_{task}.jsonl").read_text().splitlines()]


def assert_same_evaluation(ours: Path, theirs: Path, tasks: list[str]) -> dict:
    """Every sample's loglikelihoods within 1e-4, the same greedy flags and generated text, and the same accuracy;
    returns our results."""
    for task in tasks:
        for mine, hf in zip(read_samples(ours, task), read_samples(theirs, task), strict=True):
            assert mine["doc"] == hf["doc"]
            for a, b in zip(mine["resps"], hf["resps"], strict=True):
                if isinstance(a[0], str):  # generate_until: the text
                    assert a == b, task
                else:  # loglikelihood: [logprob, greedy] (rolling: the logprob alone)
                    a, b = (a[0], b[0]) if isinstance(a[0], list) else (a, b)
                    assert a[0] == pytest.approx(b[0], abs=1e-4, rel=0), task
                    assert a[1:] == b[1:], task
    results = json.loads((ours / "results.json").read_text())["results"]
    hf_results = json.loads((theirs / "results.json").read_text())["results"]
    for task in tasks:
        for key, value in results[task].items():
            if key.startswith(("acc,", "acc_norm,", "exact_match,")):
                assert value == hf_results[task][key], (task, key)
            elif key.endswith("perplexity,none") or key.startswith("bits_per_byte,"):
                assert value == pytest.approx(hf_results[task][key], rel=1e-5), (task, key)
    return results


@pytest.fixture(scope="module", params=["byte-level", "metaspace"])
def tiny(request, tmp_path_factory) -> dict:
    """A random tiny GPT with a byte-level BPE (no BOS) or a Metaspace BPE whose post-processor puts <s> first, its
    prepared corpus, and its Hugging Face export."""
    root = tmp_path_factory.mktemp("tiny")
    hf = byte_level_bpe(RUN_DOCUMENTS, RUN_VOCAB) if request.param == "byte-level" else metaspace_bpe(RUN_DOCUMENTS)
    hf.save(str(root / "tokenizer.json"))
    corpus = write_jsonl(root / "corpus.jsonl", RUN_DOCUMENTS)
    run_prepare(corpus, root / "prepared", tokenizer=str(root / "tokenizer.json"), val_count=4, workers=1)
    tokenizer = open_tokenizer(MemmapDataConfig(path=str(root / "prepared")))
    # A model vocabulary padded past the tokenizer's, as runs pad it.
    config = GPTConfig(n_layer=2, n_head=2, n_embd=32, seq_len=32, vocab_size=tokenizer.vocab_size + 20, dropout=0.0)
    model = GPT(config, seed=3).eval()
    write_hf_dir(model, tokenizer, root / "hf")
    return {"root": root, "model": model, "tokenizer": tokenizer}


def test_the_in_process_model_and_lm_evals_hf_model_agree(tiny, tmp_path):
    options = dict(tasks=TASKS, val_data=str(tiny["root"] / "prepared"), limit=3, device="cpu", batch_size=2)
    hf_out = tmp_path / "hf_eval"
    hf_line = evaluate(EvaluateConfig(pretrained=str(tiny["root"] / "hf"), out=str(hf_out), **options))
    # The model in memory, as evaluate.py wraps a consolidated checkpoint.
    ours_out = tmp_path / "ours"
    config = EvaluateConfig(checkpoint="in memory", out=str(ours_out), **options)
    model = CheckpointLM(tiny["model"], tiny["tokenizer"], config.batch_size, config.seed)
    line = run_tasks(config, model, None, {"checkpoint": "in memory"}, "cpu")
    assert_same_evaluation(ours_out, hf_out, TASKS)
    assert [len(read_samples(ours_out, task)) for task in TASKS] == [3, 3, 3]
    assert re.match(r"stagecheck: eval done \| stagecheck_mc/acc [0-9.]+ \|", line) and f"out {ours_out}" in line
    assert line.split(" | ")[1:-3] == hf_line.split(" | ")[1:-3]  # the same metrics
    # The tasks as run: copies whose data files are absolute paths inside the copy, and the held-out documents.
    copied = (ours_out / "tasks" / "stagecheck" / "stagecheck_mc.yaml").read_text()
    assert f"test: {ours_out / 'tasks' / 'stagecheck' / 'data' / 'python_choice.jsonl'}" in copied
    documents = (ours_out / "tasks" / "stagecheck" / "data" / "val_documents.jsonl").read_text().splitlines()
    assert len(documents) == 4 and all(json.loads(d)["text"] in RUN_DOCUMENTS for d in documents)
    assert len(wandb_file.find_run_files(ours_out)) == 1  # its summary is read where evaluate.py ran as a command


def test_a_users_task_folder_with_its_own_data(tiny, tmp_path):
    folder = tmp_path / "my_tasks"
    (folder / "files").mkdir(parents=True)
    (folder / "files" / "lines.jsonl").write_text(json.dumps({"text": "def function_1(value):"}) + "\n")
    (folder / "mine.yaml").write_text(
        "task: my_ppl\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: files/lines.jsonl\n"
        "output_type: loglikelihood_rolling\ntest_split: test\ndoc_to_text: ''\ndoc_to_target: '{{text}}'\n"
        "metric_list:\n  - metric: bits_per_byte\n"
    )
    out = tmp_path / "out"
    line = evaluate(
        EvaluateConfig(pretrained=str(tiny["root"] / "hf"), out=str(out), tasks=["my_ppl"], task_dir=str(folder))
    )
    assert "my_ppl/bits_per_byte" in line and (out / "tasks" / "user" / "files" / "lines.jsonl").exists()


BAD = [
    ({}, "checkpoint=None and pretrained=None: give exactly one"),
    ({"checkpoint": "r", "pretrained": "h"}, "give exactly one"),
    ({"checkpoint": "r", "tasks": []}, "tasks=[] is empty"),
    ({"checkpoint": "r", "tasks": ["stagecheck_val_ppl"]}, "val_data=None is not set: stagecheck_val_ppl needs"),
    ({"checkpoint": "r", "batch_size": 0}, "batch_size=0 is invalid"),
    ({"checkpoint": "r", "wandb_mode": "on"}, "wandb_mode='on' is unknown: allowed values are offline, online"),
    ({"checkpoint": "r", "task_dir": "/no/such"}, "task_dir='/no/such' is not a folder"),
    ({"pretrained": "/no/such", "out": "x"}, "pretrained='/no/such' holds no config.json"),
]


@pytest.mark.parametrize("options, message", BAD, ids=[m.split(" ")[0] for _, m in BAD])
def test_bad_options_name_the_option(options, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        EvaluateConfig(**options).validate()


def test_unknown_tasks_and_a_taken_out_are_refused_before_anything_is_written(tiny, tmp_path):
    hf = str(tiny["root"] / "hf")
    with pytest.raises(ValueError, match=r"tasks=\['nope'\] names tasks no task folder holds \(nope\): allowed are"):
        evaluate(EvaluateConfig(pretrained=hf, out=str(tmp_path / "new"), tasks=["nope"]))
    assert not (tmp_path / "new").exists()
    with pytest.raises(ValueError, match="val_data=.* holds no stagecheck_data.json"):
        evaluate(EvaluateConfig(pretrained=hf, out=str(tmp_path / "new"), tasks=TASKS, val_data=str(tmp_path)))
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "mine").write_text("keep")
    with pytest.raises(ValueError, match="out=.* exists and is not an empty folder"):
        evaluate(EvaluateConfig(pretrained=hf, out=str(tmp_path / "taken")))
    assert [p.name for p in (tmp_path / "taken").iterdir()] == ["mine"]


def test_the_command_exits_2_with_one_line(tmp_path):
    result = subprocess.run(
        [sys.executable, str(REPO / "evaluate.py"), "checkpoint=/no/such/run"],
        cwd=tmp_path,
        env=cpu_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 2, result.stderr
    assert result.stderr.startswith("stagecheck: error: checkpoint='/no/such/run'"), result.stderr
    assert "Traceback" not in result.stderr + result.stdout and not os.listdir(tmp_path)
