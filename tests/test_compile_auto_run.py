"""+recompute=auto under train.compile through the deepspeed launcher (`make test-compile`: its start-up compiles the
six block options auto weighs, minutes on this CPU): it compiles in its first step only, plans from the compiled
blocks' bytes, and trains as the compiled full run does, bit for bit."""

import pytest

from tests.compiled_runs import COMPILED_RUN, assert_compiled_in_the_first_step_only
from tests.runs import summary
from tests.shared_runs import case

pytestmark = pytest.mark.compile

# At this budget (its compiled plan's peak on stage 0) auto runs selective core_attn+mlp on stage 0 and mlp_act on
# stage 1; the full run is the reference its losses are held to.
CASES = {
    "compiled-full": case(*COMPILED_RUN, "+recompute=full"),
    "compiled-auto": case(*COMPILED_RUN, "+recompute=auto", "recompute.budget_gb=0.0006", "recompute.reserve_gb=0"),
}


@pytest.mark.multiproc
def test_auto_under_compile_plans_from_compiled_bytes_and_matches_compiled_full_bit_for_bit(case_runs, shared_runs):
    """+recompute=auto compiled: its start-up measured every option it weighs, its plan recomputes selectively on both
    stages with options only compiled blocks' bytes make fit, and its losses are the compiled full run's bit for bit
    (every compiled mode is compiled none's: tests/test_compile_matrix.py)."""
    auto, full = summary(case_runs["compiled-auto"]), summary(case_runs["compiled-full"])
    assert_compiled_in_the_first_step_only(auto, shared_runs.case_output())
    assert [stage["choices"] for stage in auto["layout"]] == [["selective:core_attn+mlp"], ["selective:mlp_act"]]
    assert auto["recompute_config"]["early"] is False  # null resolves to false under compile
    output = shared_runs.case_output()
    assert ", core_attn+mlp_act " in output and "measured now by compiling one block per option: 6 option(s)" in output
    assert auto["losses"] == full["losses"] and auto["val_losses"] == full["val_losses"]
