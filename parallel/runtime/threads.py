"""Intra-op threads per rank: each rank takes its share of this node's cores, unless OMP_NUM_THREADS says otherwise.

torch gives every process one intra-op thread per usable core (OpenMP's default). torchrun sets
OMP_NUM_THREADS=1 when it starts several ranks on a node; the deepspeed launcher and srun set nothing, so N ranks
on a node each ran as many threads as the node has cores and fought over them: the 2-rank CPU demo on 2 cores ran
1.9-2.3x slower than with one thread per rank. On CUDA the same rule keeps the host threads of 8 ranks apart. A
user's (or a launcher's) OMP_NUM_THREADS always wins.
"""

import os
from collections.abc import MutableMapping

import torch

from parallel.runtime.dist_env import DistEnv


def usable_cores() -> int:
    """The cores this process may run on (its affinity mask: a cgroup, taskset or srun's binding narrows it)."""
    return len(os.sched_getaffinity(0))


def threads_per_rank(cores: int, local_ranks: int, cpus_per_task: int | None = None) -> int:
    """This rank's share of `cores`: an equal part for each of the `local_ranks` on the node, at least 1.
    `cpus_per_task` (srun's --cpus-per-task) is the share SLURM gave each rank: taken as it is, within `cores`,
    since srun may already have bound this rank to those cores alone, and a part of them would idle the rest."""
    if cpus_per_task is not None:
        return max(1, min(cores, cpus_per_task))
    return max(1, cores // local_ranks)


def _threads(n: int) -> str:
    return f"{n} intra-op thread{'' if n == 1 else 's'} per rank"


def set_threads_per_rank(env: DistEnv, environ: MutableMapping[str, str] = os.environ) -> str:
    """Unless `environ` has OMP_NUM_THREADS, set this process's intra-op threads to its share, and the variable
    for any process it starts. Returns the start-up line that says how many threads each rank runs, and why."""
    given = environ.get("OMP_NUM_THREADS")
    if given:  # set and not empty (OpenMP ignores an empty value)
        return f"OMP_NUM_THREADS={given}: {_threads(torch.get_num_threads())}"
    cores = usable_cores()
    threads = threads_per_rank(cores, env.local_world_size, env.cpus_per_task)
    torch.set_num_threads(threads)
    environ["OMP_NUM_THREADS"] = str(threads)
    if env.cpus_per_task is not None:
        share = f"SLURM_CPUS_PER_TASK={env.cpus_per_task} of {cores} cores"
    else:
        share = f"{cores} cores / {env.local_world_size} rank{'' if env.local_world_size == 1 else 's'} on this node"
    return f"{share}: {_threads(torch.get_num_threads())} (OMP_NUM_THREADS unset; set it to choose)"
