"""What an export keeps of model.init_from's directory: its config.json, generation_config.json and tokenizer files
(tokenizer_config.json with the chat template, special_tokens_map.json, chat_template.jinja or .json).

Rank 0 records them at start-up in the run directory as stagecheck_hf_source.json, which every checkpoint copies
(harness/checkpoint.py), so a checkpoint copied away from its run still exports as the model it came from
(harness/hf/export.py): the source's max_position_embeddings (not the training length), its special token ids, chat
template and generation settings (Llama-3-Instruct stops on both <|end_of_text|> and <|eot_id|>). Token ids,
generation settings and tokenizer files are the source's only while the run's token ids are: its tokenizer is the
source's tokenizer.json, or it has none of its own (data=synthetic, data=memmap without data.tokenizer_file).
"""

import json
from dataclasses import dataclass
from pathlib import Path

from harness.files import atomic_write_json

SOURCE_FILE = "stagecheck_hf_source.json"
GENERATION_CONFIG = "generation_config.json"
# The source's tokenizer files besides tokenizer.json (which the run's tokenizer carries), written back verbatim.
TOKENIZER_SIDE_FILES = ("tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja", "chat_template.json")
TOKEN_ID_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id")


@dataclass(frozen=True)
class HFSource:
    directory: str
    """model.init_from, as resolved at start-up."""
    config: dict
    """Its config.json."""
    files: dict[str, str]
    """generation_config.json and TOKENIZER_SIDE_FILES that the source holds, name -> text; none unless
    tokenizer_is_source."""
    tokenizer_is_source: bool
    """The run's token ids are the source's (its tokenizer.json, or no tokenizer of the run's own), so its special
    token ids, chat template and generation settings hold."""

    @property
    def max_positions(self) -> int | None:
        value = self.config.get("max_position_embeddings")
        return value if isinstance(value, int) and not isinstance(value, bool) else None

    def token_ids(self) -> dict:
        """config.json's bos, eos and pad ids as the source wrote them (an eos list included), when its tokenizer
        is the run's; {} otherwise."""
        return (
            {key: self.config[key] for key in TOKEN_ID_KEYS if key in self.config} if self.tokenizer_is_source else {}
        )


def uses_source_ids(data, directory: Path) -> bool:
    """The run's data config tokenizes as the source does: with its tokenizer.json, or not at all (data=synthetic
    and data=memmap without data.tokenizer_file have no tokenizer; data=text's bytes is one)."""
    tokenizer_file = getattr(data, "tokenizer_file", None)
    if tokenizer_file is not None:
        return Path(tokenizer_file) == directory / "tokenizer.json"
    return getattr(data, "tokenizer", None) is None


def record_hf_source(init_from: str | None, data, run_dir: Path) -> None:
    """stagecheck_hf_source.json in `run_dir` for a run started from `init_from` (a directory start-up checked) with
    `data` (the run's data config); without one, an earlier run's record there is removed (it must not outlive the
    run it described)."""
    path = Path(run_dir) / SOURCE_FILE
    if init_from is None:
        path.unlink(missing_ok=True)
        return
    directory = Path(init_from)
    tokenizer_is_source = uses_source_ids(data, directory)
    names = (GENERATION_CONFIG, *TOKENIZER_SIDE_FILES) if tokenizer_is_source else ()
    record = {
        "directory": str(directory),
        "config": json.loads((directory / "config.json").read_text()),
        "files": {name: (directory / name).read_text() for name in names if (directory / name).is_file()},
        "tokenizer_is_source": tokenizer_is_source,
    }
    atomic_write_json(path, record)


def read_hf_source(*folders: Path) -> HFSource | None:
    """The record in the first of `folders` that holds one (a checkpoint, then its run directory); None for a run
    trained from scratch."""
    for folder in folders:
        path = Path(folder) / SOURCE_FILE
        if path.is_file():
            record = json.loads(path.read_text())
            return HFSource(record["directory"], record["config"], record["files"], record["tokenizer_is_source"])
    return None
