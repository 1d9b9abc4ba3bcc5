"""From a composed Hydra config to a run: validate everything once, then train."""
import sys
from pathlib import Path

import torch
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from harness.run_dir import check_run_dir, remove_if_empty
from parallel.dist_env import read_dist_env
from schema.checks import check_data, runtime, to_run_config, topology


def run_from_hydra(cfg: DictConfig) -> None:
    run_dir = Path(HydraConfig.get().runtime.output_dir)
    try:
        env = read_dist_env()
        run = to_run_config(cfg)
        topo = topology(run, env.world_size)
        rt = runtime(run, torch.cuda.is_available())
        check_data(run)
        check_run_dir(run_dir)
    except ValueError as error:
        remove_if_empty(run_dir)
        print(f"stagecheck: error: {error}", file=sys.stderr)
        sys.exit(2)

    from harness.trainer import train

    train(run, run_dir, env, topo, rt, OmegaConf.to_container(cfg, resolve=True))
