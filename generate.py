"""stagecheck: sample text from a trained checkpoint, on one process, with a KV cache.

python generate.py checkpoint=outputs/RUN 'prompt="def main("' max_new_tokens=200 temperature=0.8 top_k=50 seed=1
"""

import sys

import hydra
from omegaconf import DictConfig

from harness.command import refuse_file_as_directory, run_command
from harness.config_errors import config_errors
from harness.generation import sample_text
from schema.scripts import register_script_schemas, to_script_config

register_script_schemas()


@hydra.main(version_base="1.3", config_path="conf", config_name="generate")
def main(cfg: DictConfig) -> None:
    run_command(lambda: print(sample_text(to_script_config(cfg)), flush=True))


if __name__ == "__main__":
    refuse_file_as_directory(sys.argv)  # before Hydra makes the directory
    with config_errors(sys.argv[1:]):  # an unknown option or key, a wrong type: one line, exit 2
        main()
