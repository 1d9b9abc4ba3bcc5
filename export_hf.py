"""stagecheck: export a checkpoint as a Hugging Face directory of its model type (gpt2, llama, qwen2, qwen3, mistral)
that transformers' AutoModelForCausalLM loads, keeping what model.init_from's source had (harness/hf/export.py).

python export_hf.py checkpoint=outputs/RUN out=exports/my-model [dtype=bf16|fp16|fp32]
"""

import sys

import hydra
from omegaconf import DictConfig

from harness.command import refuse_file_as_directory, run_command
from harness.config_errors import config_errors
from harness.hf.export import export_hf
from schema.scripts import register_script_schemas, to_script_config

register_script_schemas()


@hydra.main(version_base="1.3", config_path="conf", config_name="export_hf")
def main(cfg: DictConfig) -> None:
    run_command(lambda: print(f"stagecheck: exported {export_hf(to_script_config(cfg))}", flush=True))


if __name__ == "__main__":
    refuse_file_as_directory(sys.argv)  # before Hydra makes the directory
    with config_errors(sys.argv[1:]):  # an unknown option or key, a wrong type: one line, exit 2
        main()
