"""Shared pytest set-up: the `slurm_cluster` fixture (a real two-node Slurm on this machine), one intra-op thread for
in-process tests, no cached device profile, the environment restored after each test, the shared launches of
tests/shared_runs.py, the quick tier's guard, and the scheduler that keeps each shared launch on one pytest-xdist
worker."""

import gc
import os

import pytest
import torch
import torch.distributed as dist

from harness.price_source import PRICE_CACHE_ENV
from parallel.planning.device_profile_file import CACHE_ENV
from tests.runs import QUICK_TIER, refuse_in_quick_tier
from tests.shared_runs import SharedRuns, shared_runs_of
from tests.xdist_groups import LaunchGroupScheduling

pytest_plugins = ["tests.slurm_cluster"]


def pytest_xdist_make_scheduler(config, log):
    """`make test`'s two workers: each shared launch, and the Slurm cluster, on one of them (tests/xdist_groups.py)."""
    return LaunchGroupScheduling(config, log)


@pytest.fixture(autouse=True, scope="session")
def one_thread():
    """Tests use tiny tensors: one intra-op thread is faster than two, and steadier on a shared
    machine. (Multi-process runs start their own processes and are not affected.)"""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(autouse=True, scope="session")
def no_cached_device_profile(tmp_path_factory):
    """Runs plan with the analytic costs unless a test names a profile: a device profile or measured prices cached on
    this machine would change every plan. Launched runs inherit the variables."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(CACHE_ENV, str(tmp_path_factory.mktemp("device_profiles")))
        patch.setenv(PRICE_CACHE_ENV, str(tmp_path_factory.mktemp("stage_prices")))
        yield


@pytest.fixture(autouse=True, scope="session")
def no_process_group_in_the_quick_tier():
    """`make test-quick` leaves out the `multiproc` tests; one without the marker that starts an in-process group
    fails here (tests/runs.py does the same for launches)."""
    if not os.environ.get(QUICK_TIER):
        yield
        return
    start = dist.init_process_group

    def refused(*args, **kwargs):
        refuse_in_quick_tier("torch.distributed.init_process_group")
        return start(*args, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(dist, "init_process_group", refused)
        yield


@pytest.fixture(autouse=True)
def restored_environment():
    """Each test leaves os.environ as it found it. monkeypatch.delenv of an absent variable records nothing, so a test
    that deletes one and then calls code that sets it (the launcher's LOCAL_RANK, a rank's RANK) leaked it into every
    later test: a launch then ran as rank 5 and printed no start-up error, and lm-eval, reading LOCAL_RANK=1, returned
    no results."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


@pytest.fixture(scope="session")
def shared_runs(request, tmp_path_factory) -> SharedRuns:
    """The CASES and ENGINE_RUNS of every module in this session, each kind launched once per world size."""
    return shared_runs_of(request.session, tmp_path_factory.mktemp("shared"))


@pytest.fixture(scope="module")
def case_runs(request, shared_runs) -> dict:
    """This module's CASES: name -> run directory."""
    return shared_runs.case_runs(request.module.__name__)


@pytest.fixture(scope="module")
def engine_runs(request, shared_runs) -> dict:
    """This module's ENGINE_RUNS: name -> every rank's result."""
    return shared_runs.engine_runs(request.module.__name__)


def _freeze_the_heap() -> None:
    """Collect, then move every survivor out of the collector's sight (gc.freeze): later collections, and the tensor
    meters' `gc.get_objects()` walks, visit only what the tests after this point create. A worker's heap holds every
    imported module and collected test (hundreds of thousands of objects), and the in-process stage replays collect
    and walk it several times per test: 4-5x their time alone, in the suite (sweep/callback.py does the same between
    a sweep's jobs). A frozen object is still freed when its count drops; only a cycle among frozen objects leaks."""
    gc.collect()
    gc.freeze()


def pytest_collection_finish(session):
    _freeze_the_heap()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item, nextitem):
    """After the last test of a module (its module fixtures torn down): what that module imported and kept, frozen."""
    result = yield
    if nextitem is None or nextitem.module is not item.module:
        _freeze_the_heap()
    return result
