"""The options of prepare_data.py (a Hydra schema, registered by schema/scripts.py), checked before any file is
written. Options are top-level (`input=PATH`, not `prepare.input=PATH`), so messages name them so."""

from __future__ import annotations

import os
from dataclasses import dataclass

FORMATS = ("auto", "jsonl", "parquet", "text", "dataset")
# Files of each format that a folder given as `input` contributes (text: every non-hidden file).
SUFFIXES = {"jsonl": (".jsonl",), "parquet": (".parquet",), "text": None}
# What marks a folder that `datasets`' save_to_disk wrote (a Dataset, or a DatasetDict).
DATASET_MARKERS = ("state.json", "dataset_dict.json")


@dataclass
class PrepareDataConfig:
    """python prepare_data.py input=PATH out=DIR tokenizer=bytes|PATH [format=... text_field=... workers=N]"""

    input: str | None = None
    """The corpus: a .jsonl or .parquet file, a text file, a folder of them (read in sorted path order, hidden files
    skipped), or a folder written by `datasets`' save_to_disk."""
    out: str | None = None
    """A new (or empty) folder for train.bin, val.bin, stagecheck_data.json and the tokenizer.json. A folder that a
    finished prepare with the same inputs and options wrote is reused as it is; one that holds anything else is
    refused, never overwritten."""
    format: str = "auto"
    """How `input` is read: jsonl (one JSON object a line), parquet, text (each file one document), dataset
    (`datasets`' save_to_disk), or auto: dataset for a folder holding state.json or dataset_dict.json, else by the
    file suffixes (.jsonl, .parquet), else text."""
    text_field: str = "text"
    """The JSONL field, Parquet column or dataset column that holds each document's text."""
    split: str = "train"
    """The split to read when `input` is a DatasetDict (several splits saved together)."""
    tokenizer: str = "bytes"
    """bytes (one id per UTF-8 byte, and id 256 as end of sequence: 257 ids), or the path of a tokenizer.json of
    the Hugging Face tokenizers library (or of a model folder holding one), e.g. GPT-2's or Llama 3's."""
    eos_token: str | None = None
    """The end-of-sequence token appended after every document. None: the eos_token of a tokenizer_config.json
    beside the tokenizer.json, else the first of <|endoftext|>, <|end_of_text|>, </s>, <eos> that the tokenizer
    has."""
    val_fraction: float = 0.01
    """Fraction of the documents held out for validation, in [0, 0.5]: whole documents, drawn with `seed`."""
    val_count: int | None = None
    """Exactly this many documents held out for validation instead of val_fraction (>= 0). None: use
    val_fraction."""
    seed: int = 1337
    """Seeds the choice of the validation documents: the same seed and input give the same split."""
    workers: int | None = None
    """Processes that tokenize (>= 1); the output is the same for any number. None: one per core this process may
    use."""

    def validate(self) -> None:
        """Check the values that need no reading of the corpus; the rest is checked by data/prepare.py's plan."""
        if not self.input:
            raise ValueError(f"input={self.input!r} is not set: give the corpus file or folder to prepare")
        if not os.path.exists(self.input):
            raise ValueError(f"input={self.input!r} does not exist: give the corpus file or folder to prepare")
        if not os.access(self.input, os.R_OK):
            raise ValueError(f"input={self.input!r} is not readable by this user")
        if not self.out:
            raise ValueError(f"out={self.out!r} is not set: give a new folder for the token files")
        if os.path.exists(self.out) and not os.path.isdir(self.out):
            raise ValueError(f"out={self.out!r} is a file: give a new (or empty) folder for the token files")
        if self.format not in FORMATS:
            raise ValueError(f"format={self.format!r} is unknown: allowed values are {', '.join(FORMATS)}")
        if not self.text_field:
            raise ValueError("text_field='' is empty: give the field or column that holds each document's text")
        if not 0 <= self.val_fraction <= 0.5:
            raise ValueError(f"val_fraction={self.val_fraction} is out of range: give a fraction in [0, 0.5]")
        if self.val_count is not None and self.val_count < 0:
            raise ValueError(f"val_count={self.val_count} is invalid: give a document count >= 0, or null")
        if self.workers is not None and self.workers < 1:
            raise ValueError(f"workers={self.workers} is invalid: give a process count >= 1, or null for one per core")
        if self.eos_token == "":
            raise ValueError("eos_token='' is empty: give a token of the tokenizer, or null to find it")

    def input_format(self) -> str:
        """`format`, with auto resolved from what `input` holds."""
        if self.format != "auto":
            return self.format
        if os.path.isdir(self.input) and any(os.path.exists(os.path.join(self.input, m)) for m in DATASET_MARKERS):
            return "dataset"
        for name, suffixes in SUFFIXES.items():
            if suffixes and (self.input.endswith(suffixes) or _folder_has(self.input, suffixes)):
                return name
        return "text"


def _folder_has(path: str, suffixes: tuple[str, ...]) -> bool:
    if not os.path.isdir(path):
        return False
    for _, dirnames, filenames in os.walk(path):
        dirnames[:] = [d for d in dirnames if not d.startswith(".")]
        if any(name.endswith(suffixes) and not name.startswith(".") for name in filenames):
            return True
    return False
