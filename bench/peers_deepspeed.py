"""Peer rank: a plain DeepSpeed pipeline, as Megatron-DeepSpeed and gpt-neox write one, without stagecheck.

    deepspeed --num_gpus 2 --module bench.peers_deepspeed --variant interval=1 ... (bench/pipeline_peers.py runs it)

`PipelineModule` of LayerSpecs (the token embedding a TiedLayerSpec, also the LM head), `partition_method=type:Block`
(the blocks split evenly, as stagecheck's `type:Block` does), DeepSpeed's own `TrainSchedule` (1F1B) through
`engine.train_batch`, and `activation_checkpoint_interval` from `--variant interval=N` with `checkpointable_layers`
naming the block class (DeepSpeed's default checkpoint function, reentrant). The optimizer and its settings are
train.py's: torch's AdamW through DeepSpeed's config, gradient clipping 1.0.
"""

import deepspeed
import torch
from deepspeed.ops.op_builder.cpu.comm import ShareMemCommBuilder
from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec

from bench import peer_gpt
from bench.peer_steps import SEED, batches, measure, parse


def head(embedding: peer_gpt.TokenEmbedding, x: torch.Tensor) -> torch.Tensor:
    return embedding.head(x)


def main() -> None:
    args, cfg = parse(__doc__.split("\n")[0])
    interval = int(args.variant.removeprefix("interval="))
    torch.set_num_threads(1)
    # DeepSpeed's CPU backend otherwise builds its shm all-reduce op and leaves a 66 MB /dev/shm buffer per rank
    # behind after every launch; only tensor-parallel inference uses it (parallel/runtime/engine.py does the same).
    deepspeed.ops.__compatible_ops__[ShareMemCommBuilder.NAME] = False
    deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False)
    layers = [
        TiedLayerSpec("embed", peer_gpt.TokenEmbedding, cfg, SEED, tied_weight_attr="wte.weight"),
        LayerSpec(peer_gpt.PositionEmbedding, cfg, SEED),
        *[LayerSpec(peer_gpt.Block, cfg, SEED, i) for i in range(cfg.n_layer)],
        LayerSpec(peer_gpt.FinalNorm, cfg, SEED),
        TiedLayerSpec("embed", peer_gpt.TokenEmbedding, cfg, SEED, forward_fn=head, tied_weight_attr="wte.weight"),
    ]
    net = PipelineModule(
        layers=layers,
        num_stages=2,
        loss_fn=peer_gpt.loss_fn,
        partition_method="type:Block",
        activation_checkpoint_interval=interval,
        checkpointable_layers=["Block"],
    )
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": args.micro_batches,
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": 6e-4, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1, "torch_adam": True},
        },
        "gradient_clipping": 1.0,
        "steps_per_print": 10**9,
    }
    engine, _, _, _ = deepspeed.initialize(model=net, model_parameters=net.parameters(), config=config)

    def step(k: int) -> float:
        return float(engine.train_batch(data_iter=iter(batches(cfg, k, args.micro_batches))))

    measure(args, step)


if __name__ == "__main__":
    main()
