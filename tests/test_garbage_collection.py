"""train.gc_interval in the training loop (harness/garbage_collection.py): start-up's objects frozen out of later
collections, the automatic collector off between collections every N steps, and the process's collector as it was
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


@pytest.mark.parametrize("interval", [0, 3])
def test_start_up_is_frozen_and_the_collector_restored_after_the_loop(interval, frozen_again):
    built = [[] for _ in range(1000)]  # what start-up built after the earlier freeze: the engine, the model
    before = gc.get_freeze_count()
    with GarbageCollection(interval) as collector:
        assert gc.get_freeze_count() >= before + len(built)
        assert gc.isenabled() == (interval == 0)
        collected = [step for step in range(1, 8) if collector.after_step(step)]
    assert collected == ([3, 6] if interval else [])
    assert gc.isenabled() and gc.get_freeze_count() == 0


def test_a_due_collection_frees_cycles_and_says_what_it_took(frozen_again):
    class Cycle:
        def __init__(self):
            self.me = self

    with GarbageCollection(2) as collector:
        Cycle()
        before = gc.get_count()[0]
        record = collector.after_step(2)
    assert set(record) == {"gc_s"} and record["gc_s"] >= 0
    # type(), not isinstance(): some tracked objects answer __class__ lookups with deprecation warnings
    assert before > 0 and not any(type(o) is Cycle for o in gc.get_objects())
