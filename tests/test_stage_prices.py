"""Prices from the real stage (train.prices=measured): the stage replay times every part the planner prices at the
run's shape; local rank 0 measures into the cache file and every other rank plans from that same file; a shape this
device cannot build, or a damaged file, is said and priced by the curves. No process group: ranks are threads here."""

import contextlib
import functools
import io
import json
import statistics
import threading
import time
from dataclasses import replace
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from harness import price_source
from harness.context import RunContext
from harness.job import JobHooks
from harness.prediction_check import residuals_path
from harness.price_source import PRICE_CACHE_ENV, expected_signature, price_file, run_prices
from harness.run_layout import layout_of
from parallel.measurement.stage_prices import refusal
from parallel.planning.block_prices import SELECTIVE_PARTS
from parallel.planning.curve_seconds import CORRECTED, corrected, curve_corrections, op_counts, profile_seconds
from parallel.planning.device_profile_file import CACHE_ENV, ProfileRefused, cache_dir, read_profile
from parallel.planning.run_plan import plan_run
from parallel.planning.shapes import Shape, Target
from parallel.runtime.device_signature import signature_of
from parallel.runtime.dist_env import DistEnv
from schema.checks import run_shape, to_run_config
from schema.run import register_schemas
from tests.runs import REPO
from tests.test_device_profile import linear_profile

SMALL = (
    "model=tiny",
    "model.n_layer=2",
    "model.n_embd=32",
    "model.n_head=2",
    "model.seq_len=16",
    "data=synthetic",
    "train.device=cpu",
    "train.micro_batch_size=1",
    "parallel.pipeline_stages=2",
    "+recompute=auto",
    "recompute.budget_gb=4",
    "dry_run=true",
)


@functools.cache
def context(local_rank: int, *overrides: str) -> RunContext:
    """The RunContext start-up builds for one of two ranks on this node (composed once: it is frozen)."""
    register_schemas()
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        cfg = compose(config_name="config", overrides=[*SMALL, *overrides])
    run = to_run_config(cfg)
    env = DistEnv(local_rank, 2, local_rank, "127.0.0.1", 0, "torch", 2)
    return RunContext(run, {}, REPO, env, run_shape(run, 2, cuda_available=False), JobHooks())


@pytest.fixture(scope="module")
def price_dir(tmp_path_factory):
    with pytest.MonkeyPatch.context() as patch:
        path = tmp_path_factory.mktemp("cache") / "prices"
        patch.setenv(PRICE_CACHE_ENV, str(path))
        yield path


@pytest.fixture(scope="module")
def two_ranks(price_dir):
    """run_prices of local ranks 1 and 0 (rank 1 started first, waiting while rank 0 measures), and whether rank 1
    was still waiting, with no file written, when rank 0 began."""
    got, ranks = {}, {rank: context(rank) for rank in (0, 1)}  # Hydra composes in one thread at a time
    waiting = threading.Thread(target=lambda: got.setdefault(1, run_prices(ranks[1])), daemon=True)
    waiting.start()
    time.sleep(0.5)
    waited = waiting.is_alive() and not price_dir.exists()
    got[0] = run_prices(ranks[0])
    waiting.join(timeout=120)
    return got[0], got[1], waited


def test_every_rank_plans_from_local_rank_0s_measurement(two_ranks):
    """Rank 1 waits for the file rank 0 writes, then both read the same prices: the same plan on every rank."""
    (prices0, line0), (prices1, line1), waited = two_ranks
    assert waited  # rank 1 did not time the stage itself
    assert prices0 == prices1 and prices0.measured is not None and prices0.source.kind == "measured"
    assert line0.startswith("costs: measured at this shape: one block per recompute option") and "s; cached at" in line0
    assert line1.startswith("costs: measured at this shape by 10 stage replays in")
    ctx = context(0)
    with contextlib.redirect_stdout(io.StringIO()):
        layout = layout_of(ctx)
    plan = plan_run(ctx.run.model, ctx.run.recompute, layout, ctx.shape)
    assert plan.step_time.costs == "measured" and plan.step_time.cost_source["kind"] == "measured"
    assert "measured at this shape by the stage replay" in "\n".join(plan.lines())


def test_the_stage_replay_times_every_part_the_planner_prices(two_ranks):
    seconds = two_ranks[0][0].measured
    timed = ("block_forward", "block_backward", "block_weight_grad", "embedding_forward", "embedding_backward")
    fixed = ("optimizer_per_param", "load", "reduce_grads_per_param")  # the stage's own work beside its blocks'
    assert all(getattr(seconds, name) > 0 for name in (*timed, "head_forward", "head_backward", *fixed))
    assert all(seconds.selective((part,)) >= 0 for part in SELECTIVE_PARTS) and seconds.block_recompute >= 0
    assert seconds.block_backward_input > 0 and seconds.head_backward_input > 0  # zb-h1's B, timed as it runs
    assert seconds.transfer is None and seconds.link_bytes_per_s is None  # no profile measured the links


def test_a_stage_this_device_cannot_build_is_priced_by_the_curves():
    ctx = context(0)
    model, run = ctx.run.model, ctx.shape
    assert refusal(model, run, 2**34) is None
    bf16 = replace(run, target=Target("cpu", "bf16"))
    assert "fp32 on CPU only" in refusal(model, bf16, 2**34)
    assert "fp32 on CPU only" in refusal(model, replace(run, target=Target("cuda", "fp32")), 2**34)
    assert "of a rank's" in refusal(model, run, 2**14)  # one block's bytes against a rank's share of the memory
    assert "would take about" in refusal(replace(model, n_embd=8192, n_head=64, seq_len=8192), run, 2**60)


def test_a_misspelt_measured_price_is_said_and_the_curves_price_the_plan(tmp_path, monkeypatch):
    monkeypatch.setenv(PRICE_CACHE_ENV, str(tmp_path))
    ctx = context(0, "model.n_embd=64")  # a shape of its own
    path = price_file(ctx, signature_of("cpu", "fp32", 1))
    seconds = {"block_forwrd": 0.1}
    path.write_text(json.dumps({"created": "now", "replays": 10, "wall_s": 1.0, "seconds": seconds}))
    prices, line = run_prices(ctx)
    assert prices is None  # no cached device profile in tests: the curves are the analytic model
    assert line.startswith(
        f"costs: not measured: the measured prices {path} or their residuals are damaged (TypeError("
    )
    assert "block_forwrd" in line and "; costs: analytic: no device profile of this device at " in line


def test_the_run_is_planned_with_its_clipping():
    """train.grad_clip reaches the plan (the optimizer steps' barrier: parallel/planning/step_sim.py)."""
    assert context(0).shape.grad_clip == 1.0 and context(0, "train.grad_clip=0").shape.grad_clip == 0.0


def test_train_prices_names_its_allowed_values():
    allowed = r"train.prices='measure' is unknown: allowed values are measured, curves, corrected, analytic"
    with pytest.raises(ValueError, match=allowed):
        context(0, "train.prices=measure")


def test_a_shape_this_device_cannot_build_is_priced_by_the_curves_corrected_by_the_shapes_it_measured(
    tmp_path, monkeypatch
):
    """Every measured part twice what the curves price it at a small shape: at a shape too large to time here, the
    curves' seconds are doubled, and the plan says which prices made it."""
    monkeypatch.setenv(PRICE_CACHE_ENV, str(tmp_path / "prices"))
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "profiles"))
    small_ctx = context(0)
    signature = expected_signature(small_ctx)
    profile_path = cache_dir() / signature.file_name()
    profile_path.parent.mkdir(parents=True)
    profile_path.write_text(json.dumps(linear_profile(signature)))
    profile = read_profile(profile_path, signature)
    small = Shape.of(small_ctx.run.model, 1)
    twice = replace(profile_seconds(profile, small, small_ctx.target), transfer=None, link_bytes_per_s=None)
    twice = replace(twice, **{name: 2 * getattr(twice, name) for name in CORRECTED})
    measured = price_file(small_ctx, signature)
    measured.parent.mkdir(parents=True)
    measured.write_text(json.dumps({"shape": vars(small), "seconds": vars(twice)}))

    large_ctx = context(0, "model.n_embd=8192", "model.n_head=64", "model.seq_len=8192")
    prices, line = run_prices(large_ctx)
    assert line.startswith("costs: not measured: ")  # too large or too slow to time here
    assert line.endswith("corrected by 1 shape(s) measured on this device")
    assert prices.source.kind == "corrected_curves" and prices.source.path == str(profile_path)
    large = Shape.of(large_ctx.run.model, 1)
    curves = profile_seconds(profile, large, large_ctx.target)
    assert prices.measured.block_forward == pytest.approx(2 * curves.block_forward)
    assert prices.measured.head_backward == pytest.approx(2 * curves.head_backward)
    assert prices.measured.transfer == curves.transfer  # the links are the profile's own


def test_train_prices_corrected_prices_a_shape_by_the_other_shapes_measured_never_its_own(tmp_path, monkeypatch):
    """train.prices=corrected at a shape this device measured: the curves corrected by the other shapes only (its own
    measurement, priced 3x the curves here, is held out; another shape's, 2x, corrects it), in a dry run; a launch of
    several ranks is refused in one line naming the option."""
    monkeypatch.setenv(PRICE_CACHE_ENV, str(tmp_path / "prices"))
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "profiles"))
    ctx = context(0, "train.prices=corrected", "dry_run=true")
    signature = expected_signature(ctx)
    profile_path = cache_dir() / signature.file_name()
    profile_path.parent.mkdir(parents=True)
    profile_path.write_text(json.dumps(linear_profile(signature)))
    profile = read_profile(profile_path, signature)
    other_ctx = context(0, "model.n_embd=48")
    for factor, at in ((3, ctx), (2, other_ctx)):
        shape = Shape.of(at.run.model, 1)
        seconds = replace(profile_seconds(profile, shape, at.target), transfer=None, link_bytes_per_s=None)
        seconds = replace(seconds, **{name: factor * getattr(seconds, name) for name in CORRECTED})
        path = price_file(at, signature)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"shape": vars(shape), "seconds": vars(seconds)}))
    prices, line = run_prices(ctx)
    assert line.endswith("corrected by 1 other shape(s) measured on this device")
    curves = profile_seconds(profile, Shape.of(ctx.run.model, 1), ctx.target)
    assert prices.source.kind == "corrected_curves"
    assert prices.measured.block_forward == pytest.approx(2 * curves.block_forward)
    with pytest.raises(ProfileRefused, match=r"^train.prices=corrected prices dry runs and one-rank runs only"):
        run_prices(context(0, "train.prices=corrected", "dry_run=false"))


def test_the_corrections_fit_a_per_op_cost_beside_the_scale_from_three_shapes_and_only_the_scale_from_fewer(tmp_path):
    """Shapes measured at 1.5 x their curves plus 40 us per op: from three of them the held-out fourth is priced as
    measured, to rounding, where the median ratio misses what the per-op cost adds at its own size; from two, the
    median ratio alone (two points fit any pair)."""
    signature = expected_signature(context(0))
    (tmp_path / "profile.json").write_text(json.dumps(linear_profile(signature)))
    profile = read_profile(tmp_path / "profile.json", signature)
    target = Target("cpu", "fp32")
    widths = (32, 64, 128, 256)
    shapes = [Shape.of(replace(context(0).run.model, n_embd=w, n_head=4), 1) for w in widths]

    def measured(shape: Shape):
        curves, ops = profile_seconds(profile, shape, target), op_counts(shape, target)
        return (
            replace(curves, **{n: 1.5 * getattr(curves, n) + 40e-6 * getattr(ops, n) for n in CORRECTED}),
            curves,
            ops,
        )

    held_out, *taught = [measured(shape) for shape in shapes]
    got = corrected(held_out[1], held_out[2], curve_corrections(taught))
    assert got.block_forward == pytest.approx(held_out[0].block_forward, rel=1e-9)
    assert got.core_attn == pytest.approx(held_out[0].core_attn, rel=1e-9)
    median = statistics.median(m.block_forward / c.block_forward for m, c, _ in taught)
    assert abs(median * held_out[1].block_forward - held_out[0].block_forward) > 0.01 * held_out[0].block_forward
    two = curve_corrections(taught[:2])["block_forward"]
    assert two.per_op == 0 and two.scale == statistics.median(
        m.block_forward / c.block_forward for m, c, _ in taught[:2]
    )


def test_a_measurement_that_failed_is_said_to_every_rank_alike(tmp_path, monkeypatch):
    """Rank 0 writes the failure into the file the others wait for: every rank then plans from the curves."""
    monkeypatch.setenv(PRICE_CACHE_ENV, str(tmp_path))

    def fail(*args):
        raise RuntimeError("no kernel for this shape")

    monkeypatch.setattr(price_source, "measure_stage_prices", fail)
    ranks = [context(rank, "model.n_embd=48") for rank in (0, 1)]
    for ctx in ranks:  # rank 0 measures (and fails), rank 1 finds the file
        prices, line = run_prices(ctx)
        assert prices is None
        assert line.startswith("costs: not measured: timing the stage failed (RuntimeError: no kernel for this shape)")


def test_the_next_plan_at_a_shape_is_scaled_by_the_residuals_earlier_runs_measured(two_ranks, tmp_path, monkeypatch):
    (measured, _), _, _ = two_ranks
    cached = Path(measured.source.path)
    monkeypatch.setenv(PRICE_CACHE_ENV, str(tmp_path))
    (tmp_path / cached.name).write_bytes(cached.read_bytes())
    residuals = residuals_path(tmp_path / cached.name)
    residuals.write_text(json.dumps({"runs": 2, "residuals": {"forward": 2.0, "weight_grad": 1e6}}))
    prices, line = run_prices(context(0))
    assert line.endswith(f", scaled by the residuals 2 earlier run(s) measured ({residuals})")
    before, after = measured.measured, prices.measured
    assert after.block_forward == pytest.approx(2 * before.block_forward)
    assert after.head_forward == pytest.approx(2 * before.head_forward)
    assert after.block_backward == before.block_backward
    assert after.block_weight_grad == before.block_backward  # W is part of the backward: never more than it
    residuals.write_text(json.dumps({"runs": 1, "residuals": {"forwad": 2.0}}))
    prices, line = run_prices(context(0))
    assert prices is None and "or their residuals are damaged" in line and "forwad" in line
