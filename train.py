"""stagecheck: train a pipelined GPT with a measured recompute mode.

deepspeed --num_gpus 2 train.py +recompute=selective
python train.py model=gpt3-175b parallel.pipeline_stages=8 dry_run=true
"""

import sys

from harness import preemption

preemption.quit_on_interrupt()  # Ctrl-C before training: no traceback (harness/preemption.py saves from then on)

from harness.command import refuse_file_as_directory  # noqa: E402
from harness.launcher_args import strip_launcher_args  # noqa: E402

# Before Hydra parses argv: it rejects the deepspeed launcher's --local_rank=N, and ends in a traceback when
# hydra.run.dir is a file.
sys.argv = strip_launcher_args(sys.argv)
refuse_file_as_directory(sys.argv)

import hydra  # noqa: E402
from omegaconf import DictConfig  # noqa: E402

from harness.config_errors import config_errors  # noqa: E402
from harness.process_exit import exit_after_cleanup  # noqa: E402
from harness.run_dir import register_run_stamp_resolver  # noqa: E402
from harness.startup import run_from_hydra  # noqa: E402
from schema import register_schemas  # noqa: E402
from sweep.job import job_hooks  # noqa: E402

register_schemas()
register_run_stamp_resolver()


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def main(cfg: DictConfig) -> None:
    run_from_hydra(cfg, job_hooks())


if __name__ == "__main__":
    # the teardown of torch's C++ statics can abort a finished run: harness/process_exit.py
    with exit_after_cleanup(), config_errors(sys.argv[1:]):  # an unknown option or key, a wrong type: one line, exit 2
        main()
