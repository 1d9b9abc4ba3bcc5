"""The DeepSpeed config dict, built from the typed run config in this one place."""

from parallel.planning.config import OptimConfig, ParallelConfig
from parallel.planning.model_states import zero_bucket_elements

NEVER = 10**9  # steps_per_print: DeepSpeed's own step log would duplicate ours


def deepspeed_config(
    train: OptimConfig, parallel: ParallelConfig, data_parallel_size: int, precision: str, device: str, params: int
) -> dict:
    """`params`: the rank's parameters, which bound ZeRO's gradient-reduction bucket (zero_bucket_elements)."""
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
                # torch's AdamW on every device: DeepSpeed's FusedAdam is JIT-built with nvcc on first use (a
                # minute or two with a CUDA toolkit, a crash without one).
                "torch_adam": True,
            },
        },
        # The LR schedule is passed to deepspeed.initialize: parallel/runtime/lr_schedule.py.
        "gradient_clipping": train.grad_clip,
        "bf16": {"enabled": precision == "bf16"},
        "fp16": {"enabled": precision == "fp16"},
        "zero_optimization": {"stage": parallel.zero_stage, "reduce_bucket_size": zero_bucket_elements(params)},
        # Recompute is applied by our own stage plans, never by DeepSpeed's interval.
        "pipeline": {"activation_checkpoint_interval": 0},
        "steps_per_print": NEVER,
        "wall_clock_breakdown": False,
    }
