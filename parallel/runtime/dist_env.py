"""Rank, world size, ranks on this node and rendezvous address from the launcher's environment.

Read in this order: torch/DeepSpeed variables (RANK, WORLD_SIZE, LOCAL_RANK: deepspeed, torchrun),
then SLURM's (SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID: srun), else a single process.
Under srun, MASTER_ADDR defaults to the first host of the step's node list (where rank 0 runs) and
MASTER_PORT to one derived from the job id (`slurm_master_port`), as launch/slurm.sbatch exports them,
so `srun python train.py` and submitit jobs need no wrapper. Also each rank's GPU (`cuda_device_index`) and the
default process group's options (`default_group_options`).
"""

import os
import re
import socket
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta

import torch


@dataclass(frozen=True)
class DistEnv:
    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int
    source: str
    """`torch`, `slurm` or `single`: which variables the ranks came from."""
    local_world_size: int = 1
    """Ranks on this node (`local_world_size`)."""
    cpus_per_task: int | None = None
    """srun's `--cpus-per-task` (SLURM_CPUS_PER_TASK): the cores SLURM gave each rank; None elsewhere."""


def _int_var(environ: Mapping[str, str], name: str) -> int:
    raw = environ[name]
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"environment variable {name}={raw!r} is invalid: it must be an integer") from None


def first_host(nodelist: str) -> str:
    """The first host of a SLURM host list, as `scontrol show hostnames LIST | head -n1` prints it:
    `gpu[007-008,012],cpu1` -> `gpu007` (zero padding kept)."""
    host, i = [], 0
    while i < len(nodelist) and nodelist[i] != ",":
        if nodelist[i] == "[":
            end = nodelist.index("]", i)
            host.append(re.split(r"[,-]", nodelist[i + 1 : end])[0])
            i = end + 1
        else:
            host.append(nodelist[i])
            i += 1
    return "".join(host)


def slurm_master_port(job_id: int) -> int:
    """Rendezvous port of a SLURM job: 10000-29999, below Linux's ephemeral range (32768-60999), and
    different for jobs that share a node (launch/slurm.sbatch computes the same number)."""
    return 10000 + job_id % 20000


def node_name(environ: Mapping[str, str] = os.environ) -> str:
    """This rank's node: SLURM's name for it (several slurmd may share one host), else the host name."""
    return environ.get("SLURMD_NODENAME") or socket.gethostname()


def tasks_per_node(spec: str) -> list[int] | None:
    """SLURM's compressed tasks-per-node list, one count per node: `2(x3),1` -> [2, 2, 2, 1]; None when `spec` is
    not such a list."""
    counts = []
    for part in spec.split(","):
        match = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if not match:
            return None
        counts += [int(match.group(1))] * int(match.group(2) or 1)
    return counts


SLURM_TASKS_PER_NODE = ("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE", "SLURM_NTASKS_PER_NODE")
"""Where srun says how many tasks each node runs: this step's, the job's, the job's request."""


def _slurm_tasks_on_this_node(environ: Mapping[str, str], name: str) -> int:
    """The count at this node's SLURM_NODEID in the list `name`; the largest when the node is not in it."""
    counts = tasks_per_node(environ[name])
    if counts is None:
        raise ValueError(f"environment variable {name}={environ[name]!r} is invalid: expected counts such as 2(x3),1")
    node = _int_var(environ, "SLURM_NODEID") if "SLURM_NODEID" in environ else -1
    return counts[node] if 0 <= node < len(counts) else max(counts)


def local_world_size(environ: Mapping[str, str], source: str) -> int:
    """Ranks on this node, for the `torch` or `slurm` variables: torchrun's LOCAL_WORLD_SIZE, else the deepspeed
    launcher's LOCAL_SIZE; srun's first of SLURM_TASKS_PER_NODE that is set. A launcher that says neither counts
    as all its ranks on this node (the fewest threads each: parallel/runtime/threads.py)."""
    if source == "torch":
        read, names = _int_var, ("LOCAL_WORLD_SIZE", "LOCAL_SIZE")
    else:
        read, names = _slurm_tasks_on_this_node, SLURM_TASKS_PER_NODE
    for name in names:
        if name in environ:
            count = read(environ, name)
            if count <= 0:
                raise ValueError(f"environment variable {name}={environ[name]!r} is invalid: it must be positive")
            return count
    return _int_var(environ, "WORLD_SIZE" if source == "torch" else "SLURM_NTASKS")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def read_dist_env(environ: Mapping[str, str] = os.environ) -> DistEnv:
    if "RANK" in environ or "WORLD_SIZE" in environ:
        source, rank_var, world_var, local_var = "torch", "RANK", "WORLD_SIZE", "LOCAL_RANK"
    elif "SLURM_PROCID" in environ and "SLURM_NTASKS" in environ:
        source, rank_var, world_var, local_var = "slurm", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID"
    else:
        return DistEnv(0, 1, 0, "127.0.0.1", _free_port(), "single")
    for name in (rank_var, world_var):
        if name not in environ:
            raise ValueError(
                f"environment variable {name} is missing: the launcher must set {rank_var} and {world_var} together"
            )
    rank, world = _int_var(environ, rank_var), _int_var(environ, world_var)
    local = _int_var(environ, local_var) if local_var in environ else 0
    if world <= 0 or not 0 <= rank < world:
        raise ValueError(f"environment variable {rank_var}={rank} is invalid: it must be in [0, {world_var}={world})")
    addr, port = environ.get("MASTER_ADDR"), 29500
    if source == "slurm":  # srun without a wrapper (e.g. submitit): rank 0 runs on the step's first node
        nodelist = environ.get("SLURM_STEP_NODELIST") or environ.get("SLURM_JOB_NODELIST")
        addr = addr or (first_host(nodelist) if nodelist else None)
        if "SLURM_JOB_ID" in environ:
            port = slurm_master_port(_int_var(environ, "SLURM_JOB_ID"))
    if world > 1 and not addr:
        raise ValueError("environment variable MASTER_ADDR is missing: set it to the host name of rank 0")
    port = _int_var(environ, "MASTER_PORT") if "MASTER_PORT" in environ else port
    if not 0 < port < 65536:
        raise ValueError(f"environment variable MASTER_PORT={port} is invalid: it must be in 1..65535")
    cpus = _int_var(environ, "SLURM_CPUS_PER_TASK") if source == "slurm" and "SLURM_CPUS_PER_TASK" in environ else None
    return DistEnv(rank, world, local, addr or "127.0.0.1", port, source, local_world_size(environ, source), cpus)


def export_dist_env(env: DistEnv, cuda_device: int | None = None) -> None:
    """Set the torch variables DeepSpeed reads; LOCAL_RANK is the rank's GPU where it has one (`cuda_device`):
    DeepSpeed's engine sets its device from LOCAL_RANK, which a per-task binding numbers past the one visible GPU."""
    os.environ.update(
        RANK=str(env.rank),
        WORLD_SIZE=str(env.world_size),
        LOCAL_RANK=str(env.local_rank if cuda_device is None else cuda_device),
        MASTER_ADDR=env.master_addr,
        MASTER_PORT=str(env.master_port),
    )


def cuda_device_index(visible: int, local_rank: int, local_ranks: int) -> int:
    """This rank's GPU among the `visible` ones: the only one when it sees one (a per-task binding such as
    `srun --gpus-per-task=1`, whatever its local rank), else the one at its local rank (each rank of the node sees
    the node's GPUs: deepspeed --num_gpus, torchrun, srun --ntasks-per-node). Raises ValueError (one line) where
    neither holds: 1 < visible < `local_ranks` (the ranks on this node), or a local rank beyond the visible GPUs."""
    if visible == 1:
        return 0
    if 1 < visible < local_ranks:
        raise ValueError(
            f"this rank sees {visible} CUDA devices but its node runs {local_ranks} ranks (train.device=cuda): bind "
            f"one GPU to each rank (srun --gpus-per-task=1, or CUDA_VISIBLE_DEVICES per rank) or let every rank see "
            f"at least {local_ranks} GPUs"
        )
    if local_rank >= visible:
        raise ValueError(
            f"LOCAL_RANK={local_rank} but this node has {visible} visible CUDA device(s) (train.device=cuda): launch "
            f"at most {visible} rank(s) per node (deepspeed --num_gpus {visible}, srun --ntasks-per-node "
            f"{visible}), or make more devices visible (CUDA_VISIBLE_DEVICES)"
        )
    return local_rank


def default_group_options(device: str, world_size: int, cuda_device: int | None, timeout: timedelta) -> dict:
    """torch.distributed.init_process_group's arguments. On CUDA with peers, the default group is bound to the
    rank's GPU (`device_id`: NCCL's eager init). ProcessGroupNCCL runs `batch_isend_irecv` on the group's own
    communicator, but an unbatched send or recv on a two-rank communicator of the pair unless the group is bound;
    zb-h1's and early recompute's batched sends meet DeepSpeed's unbatched receives only on one communicator, so
    without the binding they would never match (a hang). DeepSpeed binds the group too, but only on some torch
    versions: here it holds by construction. A single rank has no peer (DeepSpeed leaves it unbound: #8248)."""
    options = {"backend": "gloo" if device == "cpu" else "nccl", "init_method": "env://", "timeout": timeout}
    if device == "cuda" and world_size > 1:
        options["device_id"] = torch.device("cuda", cuda_device)
    return options
