"""Rank, world size and rendezvous address from the launcher's environment.

Read in this order: torch/DeepSpeed variables (RANK, WORLD_SIZE, LOCAL_RANK: deepspeed, torchrun),
then SLURM's (SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID: srun), else a single process.
Under srun, MASTER_ADDR defaults to the first host of the step's node list (where rank 0 runs) and
MASTER_PORT to one derived from the job id (`slurm_master_port`), as launch/slurm.sbatch exports them,
so `srun python train.py` and submitit jobs need no wrapper.
"""

import os
import re
import socket
from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class DistEnv:
    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int
    source: str
    """`torch`, `slurm` or `single`: which variables the ranks came from."""


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
    return DistEnv(rank, world, local, addr or "127.0.0.1", port, source)


def export_dist_env(env: DistEnv) -> None:
    """Set the torch variables DeepSpeed's init_distributed reads."""
    os.environ.update(
        RANK=str(env.rank),
        WORLD_SIZE=str(env.world_size),
        LOCAL_RANK=str(env.local_rank),
        MASTER_ADDR=env.master_addr,
        MASTER_PORT=str(env.master_port),
    )
