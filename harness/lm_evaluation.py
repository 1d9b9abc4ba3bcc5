"""evaluate.py: lm-eval's tasks on a stagecheck checkpoint (in this process, through harness/eval_model.py) or on a
Hugging Face directory (through lm-eval's own `hf` model), offline; results into a folder of their own, a W&B run
and one summary line.

Everything the user gives is checked before the output folder exists: the model, the task folders and names, the
validation data. Only local task folders are indexed (lm-eval's own tasks download their data).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import torch

from harness.checkpoint import read_checkpoint
from harness.eval_tasks import (
    SHIPPED_TASKS,
    VAL_DOCUMENTS,
    VAL_PPL_TASK,
    check_val_data,
    copy_task_folders,
    write_val_documents,
)
from harness.wandb_logger import init_wandb_run
from schema.scripts import EvaluateConfig
from schema.training import resolve_device

RESULTS_FILE = "results.json"
SHIPPED_NAME = "stagecheck"
USER_NAME = "user"


def evaluate(config: EvaluateConfig) -> str:
    """Run the tasks of ``config``; returns the summary line. ValueError naming the option for bad input."""
    from lm_eval.tasks import TaskManager

    device = resolve_device(config.device, torch.cuda.is_available(), "device")
    if config.checkpoint is not None:
        read_checkpoint(Path(config.checkpoint), option="checkpoint")  # before lm-eval's few seconds of imports
    _check_tasks(
        config, TaskManager(include_path=[str(f) for f in _task_folders(config).values()], include_defaults=False)
    )
    if VAL_PPL_TASK in config.tasks:
        check_val_data(config.val_data)
    model, model_args, source = _model(config, device)
    return run_tasks(config, model, model_args, source, device)


def run_tasks(config: EvaluateConfig, model, model_args: dict | None, source: dict, device: str) -> str:
    """Evaluate ``model`` (an lm-eval LM, or "hf" with ``model_args``) on the checked tasks of ``config``; ``source``
    says what it is (a checkpoint: its "run_dir" holds the default output folder)."""
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    out = _output_folder(config, source)
    copies = copy_task_folders(_task_folders(config), out / "tasks")
    if VAL_PPL_TASK in config.tasks:
        write_val_documents(config.val_data, out / "tasks" / SHIPPED_NAME / VAL_DOCUMENTS)
    start = time.perf_counter()
    results = simple_evaluate(
        model=model,
        model_args=model_args,
        tasks=list(config.tasks),
        num_fewshot=config.num_fewshot,
        batch_size=config.batch_size,
        device=device,
        limit=config.limit,
        log_samples=True,
        task_manager=TaskManager(include_path=[str(c) for c in copies], include_defaults=False),
        random_seed=config.seed,
        numpy_random_seed=config.seed,
        torch_random_seed=config.seed,
        fewshot_random_seed=config.seed,
    )
    seconds = time.perf_counter() - start
    metrics = _metrics(results["results"])
    _write_results(out, results, source, seconds)
    wandb_dir = _log_wandb(config, out, metrics, source)
    shown = " | ".join(f"{name} {value:.4g}" for name, value in metrics.items())
    sync = f" | wandb sync {wandb_dir}" if wandb_dir else ""
    return f"stagecheck: eval done | {shown} | {seconds:.1f} s | out {out}{sync}"


def _task_folders(config: EvaluateConfig) -> dict[str, Path]:
    folders = {SHIPPED_NAME: SHIPPED_TASKS}
    if config.task_dir is not None:
        folders[USER_NAME] = Path(config.task_dir).resolve()
    return folders


def _check_tasks(config: EvaluateConfig, manager) -> None:
    unknown = [task for task in config.tasks if task not in manager.all_tasks]
    if unknown:
        raise ValueError(
            f"tasks={list(config.tasks)} names tasks no task folder holds ({', '.join(unknown)}): allowed are "
            f"{', '.join(manager.all_tasks)} (add a folder of your own with task_dir)"
        )


def _model(config: EvaluateConfig, device: str):
    """(the lm-eval model, its arguments, what was evaluated): a checkpoint in this process, or `hf`."""
    if config.pretrained is not None:
        args = {"pretrained": str(Path(config.pretrained).resolve()), "dtype": "float32"}
        return "hf", args, {"pretrained": args["pretrained"]}
    from data.tokenizer import load_tokenizer
    from harness.consolidate import consolidate
    from harness.eval_model import CheckpointLM

    loaded = consolidate(Path(config.checkpoint), option="checkpoint")
    try:
        tokenizer = load_tokenizer(loaded.tokenizer_dir)
    except ValueError as error:
        raise ValueError(f"checkpoint={config.checkpoint!r}: the run's tokenizer cannot be loaded: {error}") from None
    if tokenizer.eos_id is None:
        raise ValueError(
            f"checkpoint={config.checkpoint!r}: the run's {tokenizer} has no end-of-sequence id, on which lm-eval "
            f"conditions a document's first token: evaluate a run whose data ends documents (prepare_data.py, or a "
            f"data.tokenizer_file with an EOS)"
        )
    model = CheckpointLM(loaded.model.to(device), tokenizer, config.batch_size, config.seed)
    point = loaded.checkpoint
    return model, None, {"checkpoint": str(point.path), "step": point.step, "run_dir": str(loaded.run_dir)}


def _output_folder(config: EvaluateConfig, source: dict) -> Path:
    if config.out is not None:
        out = Path(config.out).resolve()
        if out.exists() and (not out.is_dir() or any(out.iterdir())):
            raise ValueError(
                f"out={config.out!r} exists and is not an empty folder: give a new folder (never overwritten)"
            )
    else:  # a checkpoint's evaluations live in its run directory, one folder per evaluation
        stamp = time.strftime("%Y%m%d-%H%M%S")
        out = Path(source["run_dir"]) / "eval" / f"{Path(source['checkpoint']).name}-{stamp}-{os.getpid()}"
    out.mkdir(parents=True, exist_ok=True)
    return out


def _metrics(results: dict) -> dict[str, float]:
    """{"task/metric": value} of every task's metrics (their standard errors and sample counts left out)."""
    metrics = {}
    for task, values in results.items():
        for key, value in values.items():
            metric = key.split(",")[0]
            shown = not metric.endswith("_stderr") and metric not in ("alias", "sample_len")
            if shown and isinstance(value, int | float):
                metrics[f"{task}/{metric}"] = float(value)
    return metrics


def _write_results(out: Path, results: dict, source: dict, seconds: float) -> None:
    summary = {key: results[key] for key in ("results", "configs", "versions", "n-shot", "n-samples") if key in results}
    summary.update(source=source, seconds=seconds)
    (out / RESULTS_FILE).write_text(json.dumps(summary, indent=2, default=str) + "\n", encoding="utf-8")
    for task, samples in results.get("samples", {}).items():
        with open(out / f"samples_{task}.jsonl", "w", encoding="utf-8") as handle:
            for sample in samples:
                handle.write(json.dumps(sample, default=str, ensure_ascii=False) + "\n")


def _log_wandb(config: EvaluateConfig, out: Path, metrics: dict, source: dict) -> Path | None:
    """The metrics as the summary of a W&B run of job type "eval" in ``out`` (offline by default); its folder."""
    if config.wandb_mode == "disabled":
        return None
    run = init_wandb_run(
        config.wandb_mode,
        60.0,
        project=config.wandb_project,
        dir=str(out),
        job_type="eval",
        name=out.name,
        config={"tasks": list(config.tasks), "limit": config.limit, "num_fewshot": config.num_fewshot, **source},
    )
    run.summary.update(metrics)
    run.finish()
    return Path(run.dir).parent
