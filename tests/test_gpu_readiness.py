"""What of the CUDA paths runs without a GPU: each rank's GPU (its local rank's, or the one a per-task binding
shows it) and the start-up refusals of a CUDA run (fewer GPUs than ranks on the node, a LOCAL_RANK beyond the
visible devices, bf16 on a GPU without it), the default group bound to the rank's GPU (NCCL's p2p), the SDPA kernel
a run records and the plan it is refused against, the fused kernels' log-sum-exp as planned, torch's Adam on every
device, and the RNG state of the rank's own device only. The GPU itself: tests/test_gpu.py (`gpu` marker) and
`make gpu-check`."""

import os
from datetime import timedelta

import pytest
import torch
import torch.multiprocessing as mp

from harness.checkpoint import rng_state, set_rng_state
from harness.run_control import step_is_nonfinite
from model import GPTConfig
from parallel.measurement.sdpa_backend import PLANNED_KERNEL, check_planned_backend, sdpa_backend
from parallel.planning.config import OptimConfig, ParallelConfig
from parallel.planning.memory_model import attention_core_items, attention_kernel
from parallel.planning.shapes import Shape, Target
from parallel.runtime.dist_env import DistEnv, cuda_device_index, default_group_options, export_dist_env
from parallel.runtime.ds_config import deepspeed_config
from schema.checks import check_cuda_device
from tests.fixtures.p2p_pair import batched_meets_unbatched
from tests.runs import free_port

CUDA_BF16 = Target("cuda", "bf16")


def capability(major: int, minor: int = 0):
    """Every visible GPU of this compute capability."""
    return lambda index: (major, minor)


@pytest.mark.parametrize(
    "visible, local_rank, local_ranks, device",
    [
        (8, 3, 8, 3),  # each rank sees the node's GPUs: its local rank's
        (8, 1, 2, 1),  # fewer ranks than GPUs
        (1, 5, 8, 0),  # per-task binding (srun --gpus-per-task=1): the one it sees, whatever SLURM_LOCALID says
        (1, 0, 1, 0),
    ],
)
def test_each_rank_gets_its_own_gpu(visible, local_rank, local_ranks, device):
    assert cuda_device_index(visible, local_rank, local_ranks) == device
    check_cuda_device(CUDA_BF16, "bf16", local_rank, local_ranks, visible, capability(9))


@pytest.mark.parametrize("visible, local_rank", [(2, 0), (2, 1), (4, 3)])
def test_fewer_visible_gpus_than_ranks_on_the_node_are_refused_naming_the_binding(visible, local_rank):
    with pytest.raises(ValueError, match=rf"this rank sees {visible} CUDA devices but its node runs 8 ranks") as e:
        check_cuda_device(CUDA_BF16, "bf16", local_rank, 8, visible, capability(9))
    assert "srun --gpus-per-task=1" in str(e.value) and "\n" not in str(e.value)


def test_a_local_rank_beyond_the_visible_gpus_is_refused_naming_the_launch():
    """The launcher says 2 ranks on the node (LOCAL_SIZE) but numbers this one 2."""
    with pytest.raises(ValueError, match=r"LOCAL_RANK=2 but this node has 2 visible CUDA device\(s\)") as error:
        check_cuda_device(CUDA_BF16, "bf16", 2, 2, 2, capability(0))
    assert "deepspeed --num_gpus 2" in str(error.value) and "CUDA_VISIBLE_DEVICES" in str(error.value)


@pytest.mark.parametrize("option", ["bf16", "auto"])
def test_bf16_on_a_gpu_without_it_is_refused_naming_the_option(option):
    with pytest.raises(ValueError, match=rf"train.precision='{option}' means bf16, which this GPU \(compute capab"):
        check_cuda_device(CUDA_BF16, option, 0, 1, 1, capability(7, 5))
    check_cuda_device(Target("cuda", "fp16"), "fp16", 0, 1, 1, capability(7, 5))
    check_cuda_device(CUDA_BF16, option, 0, 1, 1, capability(8))


def test_the_capability_read_is_the_chosen_gpus():
    """Per-task binding: local rank 5 reads the capability of its one visible GPU, index 0."""
    read = []
    check_cuda_device(CUDA_BF16, "bf16", 5, 8, 1, lambda index: read.append(index) or (9, 0))
    assert read == [0]


def test_a_cpu_run_is_not_checked_against_cuda_devices():
    check_cuda_device(Target("cpu", "bf16"), "bf16", 3, 8, 0, capability(0))


@pytest.mark.parametrize(
    "device, world, cuda_device, bound",
    [("cuda", 2, 1, "cuda:1"), ("cuda", 8, 0, "cuda:0"), ("cuda", 1, 0, None), ("cpu", 2, None, None)],
)
def test_the_default_group_is_bound_to_the_ranks_gpu_wherever_peers_exchange_p2p(device, world, cuda_device, bound):
    """NCCL's unbatched send and recv share the batched ones' communicator only in a group bound to its device
    (docs/gpu.md): zb-h1 and early recompute mix the two."""
    options = default_group_options(device, world, cuda_device, timedelta(seconds=5))
    assert options["backend"] == ("nccl" if device == "cuda" else "gloo")
    assert options["timeout"] == timedelta(seconds=5)
    assert (str(options["device_id"]) if "device_id" in options else None) == bound


def shape(dropout: float, s: int = 64) -> Shape:
    return Shape.of(GPTConfig(n_layer=1, n_head=4, n_embd=64, seq_len=s, vocab_size=256, dropout=dropout), 2)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("dropout, backend", [(0.0, "flash-cpu"), (0.1, "math")])
def test_the_sdpa_kernel_that_runs_on_cpu_is_the_one_planned(precision, dropout, backend):
    target = Target("cpu", precision)
    assert sdpa_backend(shape(dropout), target, dropout) == backend
    assert PLANNED_KERNEL[backend] == attention_kernel(shape(dropout), target)
    check_planned_backend(backend, shape(dropout), target)


@pytest.mark.parametrize("backend", ["math", "cudnn"])
def test_a_plan_made_for_the_fused_kernels_is_refused_where_another_runs(backend):
    with pytest.raises(RuntimeError, match=f"SDPA runs its {backend} kernel here, but the plan counted .* sdpa-fused"):
        check_planned_backend(backend, shape(0.1), CUDA_BF16)
    for fused in ("flash", "efficient"):
        check_planned_backend(fused, shape(0.1), CUDA_BF16)


@pytest.mark.parametrize("s, rows", [(64, 64), (100, 128), (33, 64)])
def test_the_fused_log_sum_exp_is_planned_with_the_efficient_kernels_padding(s, rows):
    """CUDA's memory-efficient kernel pads the log-sum-exp to a multiple of 32 rows (flash keeps s: the same where
    seq_len is a multiple of 32, a few bytes over elsewhere); CPU's flash kernel keeps s."""
    (lse,) = [b for name, b in attention_core_items(shape(0.1, s), CUDA_BF16) if name == "log-sum-exp"]
    assert lse == 2 * 4 * rows * 4
    (lse,) = [b for name, b in attention_core_items(shape(0.0, s), Target("cpu", "fp32")) if name == "log-sum-exp"]
    assert lse == 2 * 4 * s * 4


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_torch_adam_on_every_device(device):
    config = deepspeed_config(OptimConfig(), ParallelConfig(), 1, "fp32", device, 10**6)
    assert config["optimizer"]["params"]["torch_adam"] is True


def test_a_checkpoint_keeps_one_cuda_rng_state_at_most():
    """The rank's own device's only (none on a CPU-only process): a resume under another device visibility finds
    its state on cuda:LOCAL_RANK, whatever the other devices are."""
    state = rng_state()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        assert isinstance(state["cuda"], torch.Tensor)
    else:
        assert state["cuda"] is None
    drawn = torch.rand(4)
    set_rng_state(state)
    assert torch.equal(torch.rand(4), drawn)


@pytest.mark.parametrize(
    "loss, norm, applied, fp16, fault",
    [
        (2.5, float("inf"), False, True, False),  # fp16 loss-scale overflow: DeepSpeed skipped the step
        (2.5, 1.0, True, True, False),
        (float("nan"), float("inf"), False, True, True),  # a non-finite loss stays a fault under fp16
        (2.5, float("inf"), False, False, True),  # bf16 / fp32: a skipped step is a fault
        (2.5, float("nan"), True, False, True),
        (2.5, None, True, False, False),  # fp32 without ZeRO keeps no norm
    ],
)
def test_only_an_fp16_overflow_skip_is_not_a_fault(loss, norm, applied, fp16, fault):
    assert step_is_nonfinite(loss, norm, applied, fp16) is fault


@pytest.mark.parametrize("cuda_device, exported", [(0, "0"), (None, "5")])
def test_deepspeed_reads_the_ranks_gpu_as_its_local_rank(cuda_device, exported, monkeypatch):
    """DeepSpeed's engine sets its device from LOCAL_RANK: under a per-task binding that is the one visible GPU."""
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        # setenv, not delenv: monkeypatch restores only what it recorded, and deleting an absent variable records
        # nothing, so export_dist_env's RANK=5 would leak into every later launch (a rank 5 prints no start-up error)
        monkeypatch.setenv(name, "")
    export_dist_env(DistEnv(5, 8, 5, "h", 123, "slurm", 8), cuda_device)
    assert os.environ["LOCAL_RANK"] == exported and os.environ["RANK"] == "5"


@pytest.mark.multiproc
def test_batched_sends_meet_unbatched_receives_in_the_default_group():
    """On CPU (gloo) the exchange and the group options; tests/test_gpu.py runs the same on two GPUs (NCCL)."""
    mp.start_processes(batched_meets_unbatched, args=("cpu", free_port()), nprocs=2, join=True, start_method="spawn")
