"""The DeepSpeed config dict, built from the typed run config in this one place."""

from parallel.planning.config import OptimConfig, ParallelConfig

NEVER = 10**9  # steps_per_print: DeepSpeed's own step log would duplicate ours


def deepspeed_config(
    train: OptimConfig, parallel: ParallelConfig, data_parallel_size: int, precision: str, device: str
) -> dict:
    return {
        "train_micro_batch_size_per_gpu": train.micro_batch_size,
        "gradient_accumulation_steps": train.micro_batches,
        "train_batch_size": train.micro_batch_size * train.micro_batches * data_parallel_size,
        "optimizer": {
            "type": "AdamW",
            "params": {
                "lr": train.lr,
                "betas": [train.beta1, train.beta2],
                "eps": train.eps,
                "weight_decay": train.weight_decay,
                # torch's AdamW on CPU; DeepSpeed's fused Adam needs a CUDA build.
                "torch_adam": device == "cpu",
            },
        },
        # The LR schedule is passed to deepspeed.initialize: parallel/runtime/lr_schedule.py.
        "gradient_clipping": train.grad_clip,
        "bf16": {"enabled": precision == "bf16"},
        "fp16": {"enabled": precision == "fp16"},
        "zero_optimization": {"stage": parallel.zero_stage},
        # Recompute is applied by our own stage plans, never by DeepSpeed's interval.
        "pipeline": {"activation_checkpoint_interval": 0},
        "steps_per_print": NEVER,
        "wall_clock_breakdown": False,
    }
