"""+recompute=plan: a plan.json's per-stage plans and boundaries, run as they are; a file that cannot be run is
refused at start-up with one line naming recompute.file."""

import json
from dataclasses import replace

import pytest

from model import GPTConfig
from parallel.planning.config import AutoRecompute, FullRecompute, GivenRecompute
from parallel.planning.given_plan import read_given_plan
from parallel.planning.layout import build_layout
from parallel.planning.run_plan import plan_run
from parallel.planning.shapes import GIB, RunShape, Target, Topology

MODEL = GPTConfig(n_layer=6, n_head=4, n_embd=64, seq_len=64, vocab_size=256, dropout=0.1)
RUN = RunShape(Topology(2), Target("cpu", "fp32"), micro_batches=4, micro_batch_size=2)


def _written(tmp_path, recompute, partition="balanced", run=RUN, name="plan.json"):
    """The plan.json of a dry run of `recompute` (what harness/dry_run.py writes), and its layout."""
    layout = build_layout(MODEL, recompute, run, partition, 0)
    path = tmp_path / name
    path.write_text(json.dumps(plan_run(MODEL, recompute, layout, run).to_json()))
    read_given_plan.cache_clear()
    return path, layout


def _auto_between_floor_and_none(tmp_path):
    """auto at a budget where it mixes choices: halfway from its floor to what no recompute needs on stage 0."""
    roomy = build_layout(MODEL, AutoRecompute(budget_gb=1.0, reserve_gb=0.0), RUN, "balanced", 0)
    floor, plain = roomy.budgets[0].least_bytes, roomy.peak_bytes[0]
    auto = AutoRecompute(budget_gb=(floor + plain) / 2 / GIB, reserve_gb=0.0, per_micro_batch=True)
    return _written(tmp_path, auto)


def test_auto_plan_runs_as_it_was_chosen_with_its_boundaries(tmp_path):
    path, chosen = _auto_between_floor_and_none(tmp_path)
    assert len({c for stage in chosen.as_dict() for c in stage["choices"]}) > 1  # not a uniform mode's plan
    given = build_layout(MODEL, GivenRecompute(file=str(path)), RUN, "uniform", 0)  # boundaries from the file
    assert given.parts == chosen.parts
    assert [replace(p, early=False) for p in given.plans] == [replace(p, early=False) for p in chosen.plans]
    assert given.peak_bytes == chosen.peak_bytes and given.budgets is None
    plan = plan_run(MODEL, GivenRecompute(file=str(path)), given, RUN).to_json()
    assert [s["plan"] for s in plan["stages"]] == [p.to_record() for p in chosen.plans]


def test_a_nested_compressed_plan_keeps_both(tmp_path):
    path, chosen = _written(tmp_path, FullRecompute(interval="stage", nested=True, compress="bf16"), "type:Block")
    given = read_given_plan(str(path))
    assert all(p.nested and p.compress == "bf16" and p.segments for p in given.plans)
    assert list(given.parts) == chosen.parts


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda d: d.update(stages=[]), "holds no `stages`"),
        (lambda d: d["stages"][1].pop("plan"), "stage 1 has no readable `plan`"),
        (lambda d: d["stages"][0]["plan"]["selective"].update({"1": ["softmax"]}), "unknown modules ['softmax']"),
        (lambda d: d["stages"][1]["plan"].update(compress="int4"), "compress 'int4'"),
        (lambda d: d["stages"][1].update(layers=[9, 12]), "stage 1's layers [9, 12) do not follow on"),
        (lambda d: d.update(virtual={"schedule": "zb-v"}), "plans a schedule with virtual stages"),
    ],
)
def test_a_file_that_is_no_runnable_plan_is_refused_naming_the_option(tmp_path, edit, message):
    path, _ = _written(tmp_path, FullRecompute(interval="2"), "type:Block")
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="recompute.file=") as refused:
        build_layout(MODEL, GivenRecompute(file=str(path)), RUN, "uniform", 0)
    assert message in str(refused.value)


def test_a_plan_for_another_run_is_refused(tmp_path):
    path, _ = _written(tmp_path, FullRecompute(interval="2"), "type:Block")
    three = replace(RUN, topology=Topology(3))
    with pytest.raises(ValueError, match="plans 2 pipeline stages and this run has 3"):
        build_layout(MODEL, GivenRecompute(file=str(path)), three, "uniform", 0)
    with pytest.raises(ValueError, match="plans 10 layers and this run's model has 12"):
        build_layout(replace(MODEL, n_layer=8), GivenRecompute(file=str(path)), RUN, "uniform", 0)
    with pytest.raises(ValueError, match="this run's stage 0 holds"):  # a resume holding other boundaries
        build_layout(MODEL, GivenRecompute(file=str(path)), RUN, "uniform", 0, held_parts=[0, 4, 10])
    with pytest.raises(ValueError, match="recompute.file is required"):
        GivenRecompute()
