"""Shared pytest set-up: the `slurm_cluster` fixture (a real two-node Slurm on this machine) and one
intra-op thread for in-process tests."""

import pytest
import torch

pytest_plugins = ["tests.slurm_cluster"]


@pytest.fixture(autouse=True, scope="session")
def one_thread():
    """Tests use tiny tensors: one intra-op thread is faster than two, and steadier on a shared
    machine. (Multi-process runs start their own processes and are not affected.)"""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
