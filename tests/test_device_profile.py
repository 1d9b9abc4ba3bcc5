"""The device profile: its fit predicts sizes it was not measured at, its op lists price a block from it, a damaged,
stale or foreign profile is refused or replaced by the analytic costs (saying so), and a plan records which costs
priced it. The command itself runs for real (`--quick`)."""

import json
import math
import subprocess
import sys

import pytest

from model import GPTConfig
from parallel.planning.device_profile_file import (
    CACHE_ENV,
    CURVES,
    FORMAT,
    LINK_CURVES,
    Curve,
    ProfileRefused,
    attention_curve,
    profile_json,
    read_profile,
    signature_of,
)
from parallel.planning.flops import block_forward_flops
from parallel.planning.op_costs import gpt_block_ops, profile_seconds
from parallel.planning.shapes import Shape, Target
from tests.runs import REPO, TINY, cpu_env, python_run


def synthetic_seconds(size: float) -> float:
    """A kernel with a 4 us launch cost whose throughput ramps up to 50 G units/s as sqrt(size / (size + 1e6))."""
    return 4e-6 + math.sqrt(size * (size + 1e6)) / 5e10


def test_the_fit_predicts_held_out_sizes_of_synthetic_costs_within_3_percent():
    measured = [10 ** (3 + i / 2) for i in range(13)]  # 1e3 .. 1e9, two points a decade
    curve = Curve.of([(x, synthetic_seconds(x)) for x in measured])
    held_out = [10 ** (3.25 + i / 2) for i in range(12)]  # half-way between every pair
    errors = [abs(curve(x) / synthetic_seconds(x) - 1) for x in held_out]
    assert max(errors) < 0.03, errors
    # beyond the largest size: its rate; below the smallest: its seconds (a launch floor)
    assert curve(1e10) == pytest.approx(10 * synthetic_seconds(1e9)) and curve(10) == synthetic_seconds(1e3)
    # noise that makes a larger size cheaper is lowered away, never raised (load only adds time)
    noisy = Curve.of([(1e3, 9e-4), (1e4, 4e-5), (1e5, 3e-4)])
    assert [y for _, y in noisy.points] == [4e-5, 4e-5, 3e-4]


def linear_profile(signature, per_unit: dict[str, float] | None = None) -> dict:
    """A profile whose every curve costs `per_unit` seconds (default 1e-9) per unit of its size."""
    per_unit = per_unit or {}
    points = {name: [(1e3, 1e3 * per_unit.get(name, 1e-9)), (1e12, 1e12 * per_unit.get(name, 1e-9))] for name in CURVES}
    points.update({name: [(1e3, 1e3 / 2e9), (1e9, 1e9 / 2e9)] for name in LINK_CURVES})  # 2 GB/s
    return profile_json(signature, "2026-12-01T21:30:00+00:00", points)


def test_a_block_is_priced_from_its_op_list_on_the_profiles_curves(tmp_path):
    signature = signature_of("cpu", "fp32", 1)
    path = tmp_path / "profile.json"
    # matmuls at 1e10 FLOP/s, every other op free but for a tiny launch cost
    path.write_text(
        json.dumps(linear_profile(signature, {"matmul": 1e-10, **{c: 1e-15 for c in CURVES if c != "matmul"}}))
    )
    profile = read_profile(path, signature)
    config = GPTConfig(n_layer=2, n_head=4, n_embd=128, seq_len=64, vocab_size=256, dropout=0.1, attention="math")
    shape = Shape.of(config, 2)
    seconds = profile_seconds(profile, shape, Target("cpu", "fp32"))
    linear_flops = block_forward_flops(shape) - 4 * shape.b * shape.s * shape.s * shape.h  # the attention core aside
    assert seconds["block"] == pytest.approx(linear_flops * 1e-10, rel=1e-3)
    assert seconds["block_backward"] == pytest.approx(2 * linear_flops * 1e-10, rel=1e-3)
    assert seconds["block_weight_grad"] == pytest.approx(linear_flops * 1e-10, rel=1e-3)  # one of the two
    mlp_flops = 2 * shape.b * shape.s * 8 * shape.h**2
    assert seconds["mlp"] == pytest.approx(mlp_flops * 1e-10, rel=1e-3) and seconds["core_attn"] < 1e-6
    assert seconds["transfer"] == pytest.approx(shape.bsh * 4 / 2e9)  # the p2p curve at one micro-batch's states
    ops = gpt_block_ops(shape)
    assert sum(op.weight_grad for op in ops.backward) == 4  # the four Linear layers' weight gradients


def test_attention_is_priced_between_the_head_sizes_it_was_measured_at(tmp_path):
    """At a given number of score elements, attention's matmuls grow with the head size and its passes over the
    scores do not: linear in the head size between the 32 and 128 curves, the 32 curve below."""
    signature = signature_of("cpu", "fp32", 1)
    per_unit = {attention_curve("math", True, 32): 1e-9, attention_curve("math", True, 128): 4e-9}
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(linear_profile(signature, per_unit)))
    profile = read_profile(path, signature)
    scores = 1e6
    assert [profile.attention_seconds("math", True, scores, hs, False) for hs in (16, 32, 64, 128, 256)] == (
        pytest.approx([1e-3, 1e-3, 2e-3, 4e-3, 8e-3])
    )


def test_a_damaged_stale_or_foreign_profile_is_refused_and_says_why(tmp_path):
    signature = signature_of("cpu", "fp32", 1)
    good = linear_profile(signature)
    cases = {
        "unreadable": "{not json",
        "stale": json.dumps({**good, "format": FORMAT - 1}),
        "damaged": json.dumps({**good, "curves": {k: v for k, v in good["curves"].items() if k != "adamw"}}),
        "foreign": json.dumps({**good, "signature": {**good["signature"], "threads": 7}}),
    }
    for word, text in cases.items():
        path = tmp_path / f"{word}.json"
        path.write_text(text)
        with pytest.raises(ProfileRefused, match=word) as refused:
            read_profile(path, signature)
        assert "python -m parallel.measurement.device_profile" in str(refused.value)
    assert "threads 7 (this run: 1)" in str(pytest.raises(ProfileRefused, read_profile, path, signature).value)
    bad_points = {**good, "curves": {**good["curves"], "matmul": [[1e3, math.nan]]}}
    (tmp_path / "nan.json").write_text(json.dumps(bad_points))
    with pytest.raises(ProfileRefused, match="damaged"):
        read_profile(tmp_path / "nan.json", signature)


DRY = [*TINY, "parallel.pipeline_stages=2", "+recompute=full", "dry_run=true"]


def test_a_dry_run_records_which_costs_priced_its_plan(tmp_path):
    """One rank's thread: OMP_NUM_THREADS=1, so the dry run expects a 1-thread profile of this CPU."""
    cache = tmp_path / "cache"
    env = cpu_env(tmp_path, OMP_NUM_THREADS="1", **{CACHE_ENV: str(cache)})
    named = tmp_path / "named.json"
    named.write_text(json.dumps(linear_profile(signature_of("cpu", "fp32", 1))))
    python_run(tmp_path / "named", *DRY, f"train.device_profile={named}", env=env)
    plan = json.loads((tmp_path / "named" / "plan.json").read_text())
    assert plan["step_time_costs"] == "measured"
    assert plan["cost_source"] == {
        "kind": "profile",
        "path": str(named),
        "created": "2026-12-01T21:30:00+00:00",
    }

    # auto, and no profile in the cache: analytic, saying how to make one
    result = python_run(tmp_path / "none", *DRY, env=env)
    assert "stagecheck: costs: analytic: no device profile of this device at " in result.stdout
    assert "--threads 1` measures one" in result.stdout
    assert json.loads((tmp_path / "none" / "plan.json").read_text())["cost_source"]["kind"] == "analytic"

    # auto, and a damaged profile in the cache: refused, said, analytic
    cache.mkdir()
    (cache / signature_of("cpu", "fp32", 1).file_name()).write_text("{not json")
    result = python_run(tmp_path / "damaged", *DRY, env=env)
    assert "stagecheck: costs: analytic: device profile " in result.stdout and "is unreadable" in result.stdout
    assert json.loads((tmp_path / "damaged" / "plan.json").read_text())["step_time_costs"] == "analytic"

    # an architecture without an op list (model.arch=llama) plans with the analytic costs and says so
    llama = [a if a != "model=tiny" else "model=tiny-llama" for a in DRY]
    result = python_run(tmp_path / "llama", *llama, f"train.device_profile={named}", env=env)
    assert "stagecheck: costs: analytic: a device profile prices model.arch=gpt2 blocks" in result.stdout
    assert json.loads((tmp_path / "llama" / "plan.json").read_text())["cost_source"]["kind"] == "analytic"

    # auto, and this device's profile in the cache: every run on the device uses it
    (cache / signature_of("cpu", "fp32", 1).file_name()).write_text(named.read_text())
    result = python_run(tmp_path / "cached", *DRY, env=env)
    assert "stagecheck: costs: device profile " in result.stdout
    assert json.loads((tmp_path / "cached" / "plan.json").read_text())["cost_source"]["kind"] == "profile"


def test_a_named_profile_of_another_device_is_refused_at_start_up(tmp_path):
    foreign = tmp_path / "foreign.json"
    foreign.write_text(json.dumps(linear_profile(signature_of("cpu", "fp32", 64))))
    env = cpu_env(tmp_path, OMP_NUM_THREADS="1")
    for path, words in ((foreign, "is foreign"), (tmp_path / "missing.json", "is not a file")):
        run_dir = tmp_path / path.stem
        result = python_run(run_dir, *DRY, f"train.device_profile={path}", check=False, env=env, timeout=120)
        assert result.returncode == 2, result.stderr
        assert words in result.stderr and "Traceback" not in result.stderr + result.stdout
        assert not run_dir.exists()


@pytest.mark.multiproc
def test_the_profile_command_measures_every_curve_and_its_links(tmp_path):
    """`--quick`: few sizes and rounds (a few seconds); the links need two processes (gloo)."""
    out = tmp_path / "profile.json"
    command = [sys.executable, "-m", "parallel.measurement.device_profile", "--quick", "--threads", "1", "--out"]
    result = subprocess.run(
        [*command, str(out)], cwd=REPO, env=cpu_env(tmp_path), capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr
    profile = read_profile(out, signature_of("cpu", "fp32", 1))
    assert set(profile.curves) == set(CURVES) | set(LINK_CURVES) and profile.has_links
    assert all(len(curve.points) >= 2 for curve in profile.curves.values())
