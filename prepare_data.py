"""stagecheck: tokenize a corpus (JSONL, Parquet, text, or a dataset saved by `datasets`) into token files that
data=memmap reads, in parallel worker processes.

python prepare_data.py input=corpus.jsonl out=data/corpus tokenizer=path/to/tokenizer.json workers=8
"""

import signal
import sys

import hydra
from omegaconf import DictConfig

from data.prepare import prepare
from harness.command import refuse_file_as_directory, run_command
from harness.config_errors import config_errors
from schema.scripts import register_script_schemas, to_script_config

register_script_schemas()


@hydra.main(version_base="1.3", config_path="conf", config_name="prepare_data")
def main(cfg: DictConfig) -> None:
    # A terminated prepare unwinds like an interrupted one, removing its unfinished output.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    run_command(lambda: print(prepare(to_script_config(cfg)), flush=True))


if __name__ == "__main__":
    refuse_file_as_directory(sys.argv)  # before Hydra makes the directory
    with config_errors(sys.argv[1:]):  # an unknown option or key, a wrong type: one line, exit 2
        main()
