"""Process group and DeepSpeed pipeline engine."""
from datetime import timedelta

import deepspeed
import torch.nn as nn

from harness.config import TrainConfig
from parallel.config import ParallelConfig
from parallel.dist_env import DistEnv, export_dist_env
from parallel.ds_config import deepspeed_config
from parallel.layout import PipelineLayout
from parallel.pipeline import PlannedPipelineModule


def init_process_group(env: DistEnv, device: str, timeout_s: float) -> None:
    export_dist_env(env)
    # auto_mpi_discovery=False: a missing variable must fail loudly, not silently import mpi4py.
    deepspeed.init_distributed(dist_backend="gloo" if device == "cpu" else "nccl", auto_mpi_discovery=False,
                               timeout=timedelta(seconds=timeout_s))


def _param_groups(module: nn.Module, weight_decay: float) -> list[dict]:
    """Decay matrices and embeddings; leave biases and LayerNorm gains alone (as GPT-2/nanoGPT)."""
    params = [p for p in module.parameters() if p.requires_grad]
    return [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]


def build_engine(layout: PipelineLayout, train: TrainConfig, parallel: ParallelConfig,
                 data_parallel_size: int, precision: str, device: str):
    module = PlannedPipelineModule(layout.recipes, layout.stages, layout.plans, parallel.partition_method)
    config = deepspeed_config(train, parallel, data_parallel_size, precision, device)
    engine, _, _, _ = deepspeed.initialize(model=module, model_parameters=_param_groups(module, train.weight_decay),
                                           config=config)
    return engine
