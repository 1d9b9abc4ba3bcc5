"""The task folders an evaluation reads, copied into its output folder with their data files made absolute.

lm-eval 0.4 reads a local task as `dataset_path: json` with `dataset_kwargs.data_files`, but opens relative data files
against the working directory, not the task's YAML. So each task folder (the shipped tasks/ and a user's task_dir)
is copied whole into <out>/tasks/<name>/ (a record of exactly what was evaluated), the perplexity task's documents
are written into the copy of ours, and each copied YAML's relative data_files become absolute paths in the copy.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import yaml

from data import MemmapDataConfig, open_tokenizer
from data.token_files import META_FILE, read_token_files

SHIPPED_TASKS = Path(__file__).resolve().parents[1] / "tasks"
VAL_PPL_TASK = "stagecheck_val_ppl"
VAL_DOCUMENTS = Path("data") / "val_documents.jsonl"


class _Tagged:
    """A YAML value under a tag lm-eval resolves itself (`!function module.name`), kept as it was written."""

    def __init__(self, tag: str, value: str) -> None:
        self.tag, self.value = tag, value


class _Loader(yaml.SafeLoader):
    pass


class _Dumper(yaml.SafeDumper):
    pass


_Loader.add_multi_constructor("!", lambda loader, suffix, node: _Tagged("!" + suffix, loader.construct_scalar(node)))
_Dumper.add_representer(_Tagged, lambda dumper, tagged: dumper.represent_scalar(tagged.tag, tagged.value))


def copy_task_folders(folders: dict[str, Path], out: Path) -> list[Path]:
    """Copy each folder to out/<name>; returns the copies, their YAMLs' relative data files made absolute."""
    copies = []
    for name, folder in folders.items():
        copy = out / name
        shutil.copytree(folder, copy)
        for path in sorted(copy.rglob("*.yaml")):
            _absolute_data_files(path)
        copies.append(copy)
    return copies


def _absolute_data_files(path: Path) -> None:
    config = yaml.load(path.read_text(encoding="utf-8"), Loader=_Loader)
    files = (config or {}).get("dataset_kwargs", {}).get("data_files") if isinstance(config, dict) else None
    if files is None:
        return

    def absolute(value):
        if isinstance(value, str):
            return value if "://" in value else str((path.parent / value).resolve())
        if isinstance(value, list):
            return [absolute(v) for v in value]
        return {split: absolute(v) for split, v in value.items()}

    config["dataset_kwargs"]["data_files"] = absolute(files)
    path.write_text(yaml.dump(config, Dumper=_Dumper, sort_keys=False, allow_unicode=True), encoding="utf-8")


def check_val_data(val_data: str) -> None:
    """ValueError naming val_data unless it is a prepared folder (prepare_data.py) with held-out documents."""
    folder = Path(val_data)
    hint = "give a folder prepare_data.py wrote with a validation split (val_count or val_fraction above 0)"
    if not (folder / META_FILE).is_file():
        raise ValueError(f"val_data={val_data!r} holds no {META_FILE}: {hint}")
    files = read_token_files(str(folder / "train.bin"), option="val_data")
    if files.val_path is None:
        raise ValueError(f"val_data={val_data!r} holds no validation tokens: {hint}")


def write_val_documents(val_data: str, out: Path) -> int:
    """The held-out documents of the prepared folder ``val_data`` as JSONL lines {"text": ...} at ``out``, decoded
    with the folder's own tokenizer (its special tokens around each document left out); returns their count."""
    folder = Path(val_data)
    files = read_token_files(str(folder / "train.bin"), option="val_data")
    tokenizer = open_tokenizer(MemmapDataConfig(path=str(folder)))
    meta = json.loads((folder / META_FILE).read_text(encoding="utf-8"))["tokenizer"]
    before, after = len(meta["before_document"]), len(meta["after_document"])
    after -= 0 if meta["eos_appended"] else 1  # the EOS that ends each document is the post-processor's last id
    tokens = np.fromfile(files.val_path, dtype=files.dtype)  # (N,) documents, each ended by the EOS id
    ends = np.flatnonzero(tokens == files.eos_id)
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out, "w", encoding="utf-8") as handle:
        for start, end in zip([-1, *ends[:-1]], ends, strict=True):
            ids = tokens[start + 1 : end].tolist()
            ids = ids[before : len(ids) - after]
            handle.write(json.dumps({"text": tokenizer.decode(ids)}, ensure_ascii=False) + "\n")
    return len(ends)
