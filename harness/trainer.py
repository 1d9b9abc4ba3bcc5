"""The training run: process group, pipeline engine, the step loop and its outputs."""
import os
import time
from pathlib import Path

import torch
from omegaconf import OmegaConf

from data import open_token_source
from harness.metrics import MetricsLog, median_after_warmup
from harness.wandb_logger import open_wandb
from parallel.dist_env import DistEnv
from schema.checks import Runtime, Topology
from schema.run import RunConfig

PROCESS_GROUP_TIMEOUT_S = 600.0


def recompute_label(run: RunConfig) -> str:
    return run.recompute.mode


def train(run: RunConfig, run_dir: Path, env: DistEnv, topo: Topology, rt: Runtime, resolved: dict) -> None:
    # DeepSpeed picks its accelerator when first imported: choose it before that import.
    os.environ.setdefault("DS_ACCELERATOR", rt.device)
    from parallel.engine import build_engine, init_process_group
    from parallel.layout import pipeline_layout

    layout = pipeline_layout(run.model, run.recompute, topo.pipeline_stages, run.parallel.partition_method, run.seed)
    if env.rank == 0:
        (run_dir / "config.yaml").write_text(OmegaConf.to_yaml(resolved))
        print(f"stagecheck: {topo.world_size} ranks = {topo.pipeline_stages} stages x {topo.data_parallel_size} "
              f"data-parallel | recompute={run.recompute} | {rt.device} {rt.precision} | run dir {run_dir}")
        for line in layout.describe():
            print("stagecheck: " + line, flush=True)

    init_process_group(env, rt.device, PROCESS_GROUP_TIMEOUT_S)
    engine = build_engine(layout, run.train, run.parallel, topo.data_parallel_size, rt.precision, rt.device)
    # Dropout draws from this stream; every recompute mode consumes it identically.
    torch.manual_seed(run.seed * 1009 + env.rank)

    dp_rank = engine.grid.get_data_parallel_rank()
    needs_data = engine.is_first_stage() or engine.is_last_stage()
    source = open_token_source(run.data, run.model.vocab_size) if needs_data else None
    holds_loss = engine.is_last_stage() and dp_rank == 0
    metrics = None
    if holds_loss:
        run_config = {**resolved, "layout": layout.as_dict(), "topology": vars(topo), "runtime": vars(rt)}
        wandb = open_wandb(run.logger, run_dir, run_config, job_type=recompute_label(run),
                           extra_tags=[f"model:{run.model.n_layer}L-{run.model.n_embd}h", f"stages:{topo.pipeline_stages}"])
        metrics = MetricsLog(run_dir, run.train.steps, run.train.log_every, wandb)

    t = run.train
    tokens_per_step = t.micro_batches * t.micro_batch_size * run.model.seq_len * topo.data_parallel_size
    for step in range(1, t.steps + 1):
        batches = None
        if source is not None:
            batches = iter([source.batch(run.seed, step, dp_rank, micro, t.micro_batch_size, run.model.seq_len)
                            for micro in range(t.micro_batches)])
        lr = engine.get_lr()[0]
        start = time.perf_counter()
        loss = engine.train_batch(data_iter=batches)
        step_time = time.perf_counter() - start
        if metrics:
            grad_norm = engine.get_global_grad_norm()
            metrics.log_step({
                "step": step, "loss": loss.item(), "lr": lr, "tokens_per_s": tokens_per_step / step_time,
                "step_time_s": step_time, "tokens": tokens_per_step * step,
                **({"grad_norm": float(grad_norm)} if grad_norm is not None else {}),
            })

    # Every rank takes part; only the first and last stages hold a copy of the tied weight.
    digests = [None] * topo.world_size
    torch.distributed.all_gather_object(digests, engine.module.tied_weight_digest())
    if metrics:
        records = metrics.records
        metrics.write_summary({
            "recompute": recompute_label(run),
            "recompute_config": vars(run.recompute),
            "layout": layout.as_dict(),
            "world_size": topo.world_size,
            "pipeline_stages": topo.pipeline_stages,
            "data_parallel_size": topo.data_parallel_size,
            "micro_batches": t.micro_batches,
            "micro_batch_size": t.micro_batch_size,
            "seq_len": run.model.seq_len,
            "steps": t.steps,
            "device": rt.device,
            "precision": rt.precision,
            "losses": [r["loss"] for r in records],
            "tokens_per_s": median_after_warmup([r["tokens_per_s"] for r in records]),
            "step_time_s": median_after_warmup([r["step_time_s"] for r in records]),
            "tied_weight_sha256_per_rank": digests,
        })
        metrics.close()
