"""stagecheck: score a checkpoint on lm-eval tasks (local ones, offline), in this process with the KV cache generate.py
uses; or a Hugging Face directory through lm-eval's own `hf` model, for the same numbers.

python evaluate.py checkpoint=outputs/RUN 'tasks=[stagecheck_mc,stagecheck_gen,stagecheck_val_ppl]' val_data=data/corpus
python evaluate.py pretrained=exports/run out=evals/run 'tasks=[stagecheck_mc]'
"""

import os
import sys

# Every task is local: the Hugging Face libraries must not try the Hub for a dataset or a tokenizer. Set before they
# are imported, since they read these once.
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import hydra  # noqa: E402
from omegaconf import DictConfig  # noqa: E402

from harness.command import refuse_file_as_directory, run_command  # noqa: E402
from harness.config_errors import config_errors  # noqa: E402
from schema.scripts import register_script_schemas, to_script_config  # noqa: E402

register_script_schemas()


@hydra.main(version_base="1.3", config_path="conf", config_name="evaluate")
def main(cfg: DictConfig) -> None:
    from harness.lm_evaluation import evaluate  # lm-eval loads in seconds: only once the options are valid

    run_command(lambda: print(evaluate(to_script_config(cfg)), flush=True))


if __name__ == "__main__":
    refuse_file_as_directory(sys.argv)  # before Hydra makes the directory
    with config_errors(sys.argv[1:]):  # an unknown option or key, a wrong type: one line, exit 2
        main()
