"""train.gc_interval in the training loop (harness/garbage_collection.py): what is alive frozen once no step is left
to meter, the automatic collector off between collections every N steps, and the process's collector as it was
afterwards (a sweep's next job trains in the same process)."""

import gc

import pytest

from harness.garbage_collection import GarbageCollection


@pytest.fixture
def frozen_again():
    """Leaving unfreezes everything: this session's earlier freeze (tests/conftest.py) is made again afterwards."""
    yield
    gc.collect()
    gc.freeze()


def _frozen(obj) -> bool:
    """gc.get_objects() leaves frozen objects out. Not a count of frozen objects: a frozen object that dies leaves
    the count, so it moves under the test (CI saw it fall by 2 across a step that froze nothing)."""
    return gc.is_tracked(obj) and not any(o is obj for o in gc.get_objects())


@pytest.mark.parametrize("interval", [0, 3])
def test_the_run_is_frozen_after_the_metered_step_and_the_collector_restored_after_the_loop(interval, frozen_again):
    with GarbageCollection(interval) as collector:
        assert gc.isenabled() == (interval == 0)
        built = [[] for _ in range(1000)]  # what the run holds: the engine, the model, the optimizer's states
        collector.after_step(1, metering_done=False)
        assert not _frozen(built)  # the meters of step 2 walk the collector's objects
        collected = [step for step in range(2, 8) if collector.after_step(step, metering_done=True)]
        assert _frozen(built) and _frozen(built[0]) and _frozen(built[-1])
    assert collected == ([3, 6] if interval else [])
    assert gc.isenabled() and gc.get_freeze_count() == 0


def test_a_due_collection_frees_cycles_and_says_what_it_took(frozen_again):
    class Cycle:
        def __init__(self):
            self.me = self

    with GarbageCollection(2) as collector:
        Cycle()
        record = collector.after_step(2, metering_done=False)
    assert set(record) == {"gc_s"} and record["gc_s"] >= 0
    # type(), not isinstance(): some tracked objects answer __class__ lookups with deprecation warnings
    assert not any(type(o) is Cycle for o in gc.get_objects())
