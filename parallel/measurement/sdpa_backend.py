"""Which kernel torch's scaled_dot_product_attention runs for a run's attention, found by running it once, and
whether that is the kernel the memory model planned for (parallel/planning/memory_model.py's `attention_kernel`).

SDPA picks its kernel per call from the device, dtype, head size, dropout and the kernels this torch build
enables: flash, memory-efficient, cuDNN, or its math fallback. The fused ones keep q, k, v, the output and a
log-sum-exp; the math fallback keeps s x s scores per head; cuDNN's saved tensors are not modelled here. The
autograd node of the output names the kernel that ran, so one probe on the run's shapes tells."""

import torch
import torch.nn.functional as F

from parallel.planning.memory_model import attention_kernel
from parallel.planning.shapes import Shape, Target

BACKEND_OF_NODE = {
    "ScaledDotProductFlashAttentionBackward0": "flash",
    "ScaledDotProductEfficientAttentionBackward0": "efficient",
    "ScaledDotProductCudnnAttentionBackward0": "cudnn",
    "ScaledDotProductFlashAttentionForCpuBackward0": "flash-cpu",
}
"""The autograd node of SDPA's output -> its kernel; any other node is the math fallback (its last op's)."""

PLANNED_KERNEL = {"flash": "sdpa-fused", "efficient": "sdpa-fused", "flash-cpu": "sdpa-flash", "math": "sdpa-math"}
"""The memory model's kernel whose saved tensors each backend keeps (cuDNN: none modelled)."""


def sdpa_backend(shape: Shape, target: Target, dropout_p: float) -> str:
    """The SDPA kernel a training forward of one sequence of `shape` runs on the current device (the kernel
    choice does not depend on the batch size): flash, efficient, cudnn, flash-cpu or math."""
    device = torch.device("cuda", torch.cuda.current_device()) if target.device == "cuda" else torch.device("cpu")
    head = shape.h // shape.a
    q = torch.zeros(1, shape.a, shape.s, head, dtype=target.torch_dtype, device=device, requires_grad=True)
    kv = q[:, : shape.g or shape.a]  # (1, g, T, hs): grouped-query attention (llama) narrows the kernels' choice
    gqa = kv.shape[1] != shape.a
    out = F.scaled_dot_product_attention(q, kv, kv, dropout_p=dropout_p, is_causal=True, enable_gqa=gqa)
    return BACKEND_OF_NODE.get(out.grad_fn.name(), "math")


def check_planned_backend(backend: str, shape: Shape, target: Target) -> None:
    """Raise unless the kernel that runs keeps what the plan counted for attention."""
    planned = attention_kernel(shape, target)
    if PLANNED_KERNEL.get(backend) != planned:
        raise RuntimeError(
            f"SDPA runs its {backend} kernel here, but the plan counted the saved tensors of {planned} "
            f"(parallel/planning/memory_model.py): its memory prediction and recompute plan would not hold. "
            f"Set model.attention=math (planned exactly on every device), or a dtype and head size the fused "
            f"kernels take (train.precision=bf16, model.n_embd / model.n_head a multiple of 8, at most 256)"
        )
