"""Threads per rank (parallel/runtime/threads.py) and the ranks on this node they divide the cores by
(parallel/runtime/dist_env.py), from each launcher's variables. In-process: no launch."""

import pytest
import torch

from parallel.runtime.dist_env import read_dist_env, tasks_per_node
from parallel.runtime.threads import set_threads_per_rank, threads_per_rank, usable_cores

TORCH = {"RANK": "1", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "MASTER_ADDR": "h", "MASTER_PORT": "123"}
SLURM = {"SLURM_PROCID": "5", "SLURM_NTASKS": "7", "SLURM_LOCALID": "1", "MASTER_ADDR": "n1", "MASTER_PORT": "2000"}


@pytest.mark.parametrize(
    ("environ", "local"),
    [
        ({}, 1),  # python train.py
        ({**TORCH, "LOCAL_SIZE": "2", "CROSS_SIZE": "4"}, 2),  # deepspeed --num_nodes 4 --num_gpus 2
        ({**TORCH, "LOCAL_WORLD_SIZE": "4", "LOCAL_SIZE": "2"}, 4),  # torchrun's own first
        ({**TORCH}, 8),  # a launcher that does not say: every rank counts as local
        ({**SLURM, "SLURM_STEP_TASKS_PER_NODE": "2(x3),1", "SLURM_NODEID": "3", "SLURM_TASKS_PER_NODE": "4"}, 1),
        ({**SLURM, "SLURM_TASKS_PER_NODE": "2(x3),1", "SLURM_NODEID": "1"}, 2),
        ({**SLURM, "SLURM_TASKS_PER_NODE": "3,4"}, 4),  # no SLURM_NODEID: the most tasks any node runs
        ({**SLURM, "SLURM_NTASKS_PER_NODE": "4"}, 4),
        ({**SLURM}, 7),
    ],
)
def test_ranks_on_this_node_come_from_each_launchers_variables(environ, local):
    assert read_dist_env(environ).local_world_size == local


def test_slurm_task_lists_expand_and_bad_counts_name_the_variable():
    assert tasks_per_node("2(x3),1") == [2, 2, 2, 1]
    assert tasks_per_node("8") == [8]
    assert tasks_per_node("2(3)") is None
    with pytest.raises(ValueError, match=r"SLURM_TASKS_PER_NODE='two' is invalid"):
        read_dist_env({**SLURM, "SLURM_TASKS_PER_NODE": "two"})
    with pytest.raises(ValueError, match=r"LOCAL_SIZE='0' is invalid: it must be positive"):
        read_dist_env({**TORCH, "LOCAL_SIZE": "0"})
    with pytest.raises(ValueError, match=r"SLURM_CPUS_PER_TASK='x' is invalid"):
        read_dist_env({**SLURM, "SLURM_CPUS_PER_TASK": "x"})


def test_each_rank_takes_its_share_of_the_cores_and_at_least_one():
    assert threads_per_rank(cores=2, local_ranks=2) == 1
    assert threads_per_rank(cores=16, local_ranks=8) == 2
    assert threads_per_rank(cores=7, local_ranks=2) == 3
    assert threads_per_rank(cores=2, local_ranks=4) == 1
    assert threads_per_rank(cores=2, local_ranks=1) == 2
    # srun's --cpus-per-task: the cores SLURM gave each rank, whether or not it bound the rank to them
    assert threads_per_rank(cores=64, local_ranks=8, cpus_per_task=8) == 8
    assert threads_per_rank(cores=8, local_ranks=8, cpus_per_task=8) == 8
    assert threads_per_rank(cores=1, local_ranks=8, cpus_per_task=8) == 1


@pytest.fixture
def restored_threads():
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def test_unset_omp_num_threads_gets_the_share_in_torch_and_for_children(restored_threads):
    environ = {**TORCH, "LOCAL_SIZE": "2"}
    line = set_threads_per_rank(read_dist_env(environ), environ)
    share = max(1, usable_cores() // 2)
    assert torch.get_num_threads() == share and environ["OMP_NUM_THREADS"] == str(share)
    thread_s = "thread" if share == 1 else "threads"
    assert line == (
        f"{usable_cores()} cores / 2 ranks on this node: {share} intra-op {thread_s} per rank "
        "(OMP_NUM_THREADS unset; set it to choose)"
    )
    slurm = {**SLURM, "SLURM_CPUS_PER_TASK": "1"}
    assert set_threads_per_rank(read_dist_env(slurm), slurm).startswith(
        f"SLURM_CPUS_PER_TASK=1 of {usable_cores()} cores: 1 intra-op thread per rank"
    )
    assert torch.get_num_threads() == 1


def test_the_users_omp_num_threads_wins(restored_threads):
    torch.set_num_threads(5)  # as torch starts under OMP_NUM_THREADS=5
    environ = {**TORCH, "LOCAL_SIZE": "64", "OMP_NUM_THREADS": "5"}  # the share would be 1 below 128 cores
    line = set_threads_per_rank(read_dist_env(environ), environ)
    assert line == "OMP_NUM_THREADS=5: 5 intra-op threads per rank"
    assert torch.get_num_threads() == 5 and environ["OMP_NUM_THREADS"] == "5"
