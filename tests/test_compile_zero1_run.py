"""train.compile with data parallelism and ZeRO-1 through the deepspeed launcher (`make test-compile`): 2 stages x 2
data-parallel ranks, each rank's blocks compiled. Compile touches the blocks only, not the optimizer's partitions or
the gradient all-reduce, so the compiled run holds what a compiled pipeline of one replica holds: no recompile after
the first step on any rank, the plan's bytes met by the meters, and full recompute training as none does, bit for
bit, dropout on. The two runs are consecutive jobs of one launch, as in a user's sweep: each compiles its own graphs
(dynamo's cache is reset between a sweep's jobs, sweep/callback.py; without the reset the second job reused the
first's graphs and counted none)."""

import pytest

from tests.compiled_runs import COMPILED_RUN, assert_compiled_in_the_first_step_only
from tests.runs import summary
from tests.shared_runs import case

pytestmark = pytest.mark.compile

ZERO1 = [*COMPILED_RUN, "parallel.pipeline_stages=2", "parallel.zero_stage=1"]
CASES = {
    "zero1-none": case(*ZERO1, nproc=4),
    "zero1-full": case(*ZERO1, "+recompute=full", nproc=4),
}


@pytest.mark.multiproc
def test_compiled_zero1_data_parallel_runs_compile_once_and_full_trains_as_none(case_runs, shared_runs):
    none, full = summary(case_runs["zero1-none"]), summary(case_runs["zero1-full"])
    output = shared_runs.case_output(nproc=4)
    for run in (none, full):
        assert (run["pipeline_stages"], run["data_parallel_size"]) == (2, 2)
        assert_compiled_in_the_first_step_only(run, output)
    assert full["recompute"] == "full" and none["recompute"] == "none"
    assert full["losses"] == none["losses"] and full["val_losses"] == none["val_losses"]
