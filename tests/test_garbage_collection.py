"""train.gc_interval in the training loop (harness/garbage_collection.py): the automatic collector off between
collections every N steps, untouched at 0, and the process's collector as it was afterwards (a sweep's next job trains
in the same process)."""

import gc

import pytest

from harness.garbage_collection import GarbageCollection


@pytest.mark.parametrize("interval", [0, 3])
def test_the_collector_is_off_between_collections_every_n_steps_and_restored_after_the_loop(interval):
    assert gc.isenabled()
    frozen = gc.get_freeze_count()
    with GarbageCollection(interval) as collector:
        assert gc.isenabled() == (interval == 0)
        collected = [step for step in range(1, 8) if collector.after_step(step)]
    assert collected == ([3, 6] if interval else [])
    # nothing frozen: the tensor meters walk the collector's objects, which leave frozen ones out
    assert gc.isenabled() and gc.get_freeze_count() == frozen


def test_a_due_collection_frees_cycles_and_says_what_it_took():
    class Cycle:
        def __init__(self):
            self.me = self

    with GarbageCollection(2) as collector:
        Cycle()
        record = collector.after_step(2)
    assert set(record) == {"gc_s"} and record["gc_s"] >= 0
    # type(), not isinstance(): some tracked objects answer __class__ lookups with deprecation warnings
    assert not any(type(o) is Cycle for o in gc.get_objects())
