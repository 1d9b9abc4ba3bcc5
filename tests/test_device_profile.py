"""The device profile: its fit predicts sizes it was not measured at, its op lists price a block from it, a damaged,
stale or foreign profile is refused or replaced by the analytic costs (saying so), and a plan records which costs
priced it. The command itself runs for real (`--quick`)."""

import json
import math
import subprocess
import sys

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from model import ARCHITECTURES as MODEL_ARCHITECTURES
from model import GPTConfig
from model.llama_layers import LlamaBlock
from parallel.measurement import profile_kernels
from parallel.measurement.device_profile import size_grid
from parallel.measurement.tensor_peak import TensorPeakMeter
from parallel.planning.curve_seconds import ARCHITECTURES, gpt_block_ops, llama_block_ops, profile_seconds
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
)
from parallel.planning.flops import attention_core_forward_flops, block_forward_flops, mlp_forward_flops
from parallel.planning.shapes import Shape, Target
from parallel.runtime.device_signature import signature_of
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


LLAMA_CURVES = ("rmsnorm", "rotary", "swiglu")


def synthetic_curve_seconds(curve: str, size: float) -> float:
    """synthetic_seconds, scaled per curve (each its own rate); an attention curve's seconds grow linearly with its
    head size (its matmuls), as the profile's head-size interpolation assumes."""
    base, _, head = curve.partition("_hs")  # attention_{kernel}[_gqa][_dropout]_hs{head size}[_backward]
    head_size, _, part = head.partition("_")
    return (
        synthetic_attention_seconds(base + "_" * bool(part) + part, int(head_size), size)
        if head
        else _scale(curve) * synthetic_seconds(size)
    )


def synthetic_attention_seconds(curve: str, head_size: int, scores: float) -> float:
    return _scale(curve) * (1 + head_size / 64) * synthetic_seconds(scores)


def _scale(curve: str) -> int:
    return 1 + sum(map(ord, curve)) % 7


def test_the_llama_curves_price_held_out_shapes_within_3_percent_of_synthetic_costs(tmp_path):
    """RMSNorm, the rotary embedding, SwiGLU and grouped-query attention measured at two sizes a decade on
    synthetic costs: a Llama block at shapes between them (other widths, GQA ratios and MLP widths) is priced within 3%
    of those costs, op by op, and every op of its list is on one of the curves."""
    signature = signature_of("cpu", "fp32", 1)
    grid = [10 ** (3 + i / 2) for i in range(19)]  # 1e3 .. 1e12
    new = [c for c in CURVES if c.startswith(LLAMA_CURVES) or "_gqa_" in c]
    assert len(new) == 2 * len(LLAMA_CURVES) + 8  # forward and backward; GQA: 2 kernels x 2 head sizes
    points = {name: [(x, synthetic_curve_seconds(name, x)) for x in grid] for name in CURVES}
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(profile_json(signature, "2026-12-01T21:30:00+00:00", points)))
    profile = read_profile(path, signature)
    used = set()
    for n_head, n_kv_head, n_embd, f, seq, kernel in ((8, 2, 336, 904, 136, "sdpa"), (6, 3, 276, 730, 88, "math")):
        config = GPTConfig(
            arch="llama", activation="silu", bias=False, tie_embeddings=False, n_head=n_head, n_kv_head=n_kv_head,
            n_embd=n_embd, intermediate_size=f, seq_len=seq, attention=kernel, n_layer=2,
        )  # fmt: skip
        shape = Shape.of(config, 3)
        block = llama_block_ops(shape)
        for op in (*block.forward, *block.backward):
            if hasattr(op, "curve"):
                truth, used = synthetic_curve_seconds(op.curve, op.size), used | {op.curve}
            else:  # the attention core, on the grouped curves between the head sizes they were measured at
                assert op.grouped and op.kernel == kernel
                curve = f"attention_{kernel}_gqa" + "_backward" * op.backward
                truth = synthetic_attention_seconds(curve, op.head_size, op.scores)
            assert op.seconds(profile) == pytest.approx(truth, rel=0.03), op
    assert {c for c in used if c.split("_backward")[0] in LLAMA_CURVES} == {
        c + part for c in LLAMA_CURVES for part in ("", "_backward")
    }


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
    assert seconds.block_recompute == pytest.approx(linear_flops * 1e-10, rel=1e-3)
    assert seconds.block_backward == pytest.approx(2 * linear_flops * 1e-10, rel=1e-3)
    assert seconds.block_weight_grad == pytest.approx(linear_flops * 1e-10, rel=1e-3)  # one of the two
    mlp_flops = 2 * shape.b * shape.s * 8 * shape.h**2
    assert seconds.mlp == pytest.approx(mlp_flops * 1e-10, rel=1e-3) and seconds.core_attn < 1e-6
    assert seconds.transfer == pytest.approx(shape.bsh * 4 / 2e9)  # the p2p curve at one micro-batch's states
    ops = gpt_block_ops(shape)
    assert sum(op.weight_grad for op in ops.backward) == 4  # the four Linear layers' weight gradients


def test_a_llama_block_is_priced_from_its_op_list_with_gqa_widths_and_swiglus_three_matrices(tmp_path):
    signature = signature_of("cpu", "fp32", 1)
    path = tmp_path / "profile.json"
    per_unit = {"matmul": 1e-10, **{c: 1e-15 for c in CURVES if c != "matmul"}, "rmsnorm": 1e-11, "swiglu": 1e-12}
    path.write_text(json.dumps(linear_profile(signature, per_unit)))
    profile = read_profile(path, signature)
    config = GPTConfig(
        arch="llama", activation="silu", bias=False, tie_embeddings=False, n_layer=2, n_head=8, n_kv_head=2,
        n_embd=128, intermediate_size=352, seq_len=64, vocab_size=256, loss_chunk_tokens=0,
    )  # fmt: skip
    shape = Shape.of(config, 2)
    tokens, h, f = shape.b * shape.s, shape.h, shape.mlp_width
    seconds = profile_seconds(profile, shape, Target("cpu", "fp32"))
    linear_flops = block_forward_flops(shape) - attention_core_forward_flops(shape)
    assert linear_flops == 2 * tokens * (2 * h * h + 2 * h * h // 4 + 3 * h * f)  # k and v are a quarter wide
    rms, act = 2 * tokens * h * 1e-11, tokens * f * 1e-12
    assert seconds.block_recompute == pytest.approx(linear_flops * 1e-10 + rms + act, rel=1e-3)
    assert seconds.block_weight_grad == pytest.approx(linear_flops * 1e-10, rel=1e-3)
    assert sum(op.weight_grad for op in llama_block_ops(shape).backward) == 7  # q, k, v, o, gate, up, down
    # the selective parts: the SwiGLU product, both RMSNorms, the whole MLP (its three matrices and the product)
    assert seconds.mlp_act == pytest.approx(act, rel=1e-3)
    assert seconds.layernorm == pytest.approx(rms, rel=1e-3)
    assert seconds.mlp == pytest.approx(mlp_forward_flops(shape) * 1e-10 + act, rel=1e-3)
    assert seconds.core_attn < 1e-6 and llama_block_ops(shape).parts["core_attn"][0].grouped
    # the untied head (unfused loss): the final RMSNorm and the loss; its weight gradient a matmul of its own to
    # defer; no positions
    loss = tokens * h * shape.vocab * 1e-15  # the loss curves' own
    assert seconds.head_forward == pytest.approx(tokens * h * 1e-11 + loss, rel=1e-3)
    assert seconds.head_weight_grad == pytest.approx(2 * tokens * h * shape.vocab * 1e-10)
    assert seconds.embedding_forward < 1e-9
    assert ARCHITECTURES["llama"].block_params(shape) == 2 * h * h + 2 * h * h // 4 + 3 * h * f
    assert set(ARCHITECTURES) == set(MODEL_ARCHITECTURES)  # a profile prices every model.arch


@pytest.mark.parametrize("qwen3", [False, True], ids=["llama", "qwen3"])
def test_the_llama_op_lists_matmuls_are_the_real_blocks_forward_and_backward_matmuls(qwen3):
    """FlopCounterMode over model/llama_layers.py's LlamaBlock, forward and backward: its Linear layers' matmuls
    (aten.mm; the attention core's are batched) are the op list's, FLOP for FLOP, split 1:2. Qwen3's shape (q and k
    norms, a head_dim that makes q twice the hidden size) too, its norms in the `layernorm` part."""
    config = GPTConfig(
        arch="llama", activation="silu", bias=False, tie_embeddings=False, n_layer=2, n_head=8, n_kv_head=2,
        n_embd=128, intermediate_size=352, seq_len=64, attention="math",
        **({"head_dim": 32, "qk_norm": True} if qwen3 else {}),
    )  # fmt: skip
    block = LlamaBlock(config, 0, 0)
    x = torch.randn(2, config.seq_len, config.n_embd, requires_grad=True)  # (B, T, C)
    with FlopCounterMode(display=False) as counter:
        y = block(x)
        y.backward(torch.randn_like(y))
    ops = llama_block_ops(Shape.of(config, 2))
    forward, backward = (
        sum(op.size for op in part if getattr(op, "curve", None) == "matmul") for part in (ops.forward, ops.backward)
    )
    assert forward + backward == counter.get_flop_counts()["Global"][torch.ops.aten.mm]
    assert backward == 2 * forward
    assert len(ops.parts["layernorm"]) == (4 if qwen3 else 2)
    params = sum(p.numel() for name, p in block.named_parameters() if name.endswith("proj.weight"))
    assert ARCHITECTURES["llama"].block_params(Shape.of(config, 2)) == params


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
        # measured before the Llama curves: stale, naming what it lacks
        "before Llama": json.dumps(
            {**good, "format": 1, "curves": {k: v for k, v in good["curves"].items() if not k.startswith("rmsnorm")}}
        ),
        "damaged": json.dumps({**good, "curves": {k: v for k, v in good["curves"].items() if k != "adamw"}}),
        "foreign": json.dumps({**good, "signature": {**good["signature"], "threads": 7}}),
    }
    for word, text in cases.items():
        path = tmp_path / f"{word}.json"
        path.write_text(text)
        with pytest.raises(ProfileRefused, match="stale" if word == "before Llama" else word) as refused:
            read_profile(path, signature)
        assert "python -m parallel.measurement.device_profile" in str(refused.value)
    assert "it lacks the curves rmsnorm, rmsnorm_backward)" in str(
        pytest.raises(ProfileRefused, read_profile, tmp_path / "before Llama.json", signature).value
    )
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

    # model.arch=llama is priced by its own op list (RMSNorm, rotary, SwiGLU, grouped-query attention)
    llama = [a if a != "model=tiny" else "model=tiny-llama" for a in DRY]
    result = python_run(tmp_path / "llama", *llama, f"train.device_profile={named}", env=env)
    assert f"stagecheck: costs: device profile {named}" in result.stdout
    llama_plan = json.loads((tmp_path / "llama" / "plan.json").read_text())
    assert llama_plan["step_time_costs"] == "measured" and llama_plan["cost_source"]["path"] == str(named)

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


def test_each_family_builds_one_size_with_all_its_curves_and_together_they_are_every_curve():
    """The profile builds, times and frees one size at a time: each family's smallest size on its own."""
    grid = size_grid("cpu", quick=True)
    seen: list[str] = []
    for family in profile_kernels.families("cpu", torch.float32, grid["points"], grid):
        assert family.sizes == sorted(family.sizes) and len(family.sizes) >= 2
        workloads = family.build(family.sizes[0])
        assert all(len(by_x) == 1 for by_x in workloads.values()), family.name
        for by_x in workloads.values():
            (run,) = by_x.values()
            run()
        seen += workloads
    assert sorted(seen) == sorted(CURVES)


def test_the_sizes_are_capped_by_the_free_memory():
    """On CUDA a size is kept when its workloads' bound fits in half the free memory; a CPU has no bound."""
    grid = size_grid("cuda", quick=False)
    for family in profile_kernels.families("cuda", torch.bfloat16, grid["points"], grid):
        bounds = [family.bytes_at(size) for size in family.sizes]
        assert bounds == sorted(bounds) and bounds[0] > 0, family.name
        assert profile_kernels.sizes_that_fit(family, None) == family.sizes
        for free in (2 * bounds[0], 2 * bounds[len(bounds) // 2], 2 * bounds[-1] - 1):
            kept = profile_kernels.sizes_that_fit(family, free)
            assert kept == [s for s, b in zip(family.sizes, bounds) if b <= free / 2] and kept, (family.name, free)
        assert profile_kernels.sizes_that_fit(family, bounds[0]) == []
    sizes = {
        f.name: profile_kernels.sizes_that_fit(f, 24 * 2**30)
        for f in profile_kernels.families("cuda", torch.bfloat16, grid["points"], grid)
    }
    # A 24 GB card loses the largest elementwise and optimizer sizes (they held 36 and 32 GB at once before).
    assert len(sizes["elementwise"]) < grid["points"] and len(sizes["optimizer"]) < grid["points"]


def test_each_familys_byte_bound_holds_what_one_size_really_takes():
    """The bound the cap reads, against the allocator's events (parallel/measurement/tensor_peak.py) while one
    size is built and each of its workloads runs once: on CPU in fp32 (tests/test_gpu.py checks CUDA's)."""
    grid = {"max_flops": 4e9, "max_elements": 2.5e5, "max_seq": 128, "max_tokens": 256}
    for family in profile_kernels.families("cpu", torch.float32, 2, grid):
        size = family.sizes[-1]
        with TensorPeakMeter("cpu").window() as result:
            workloads = family.build(size)
            for by_x in workloads.values():
                for run in by_x.values():
                    run()
            del workloads
        held = result[0].peak_bytes - result[0].baseline_bytes
        assert 0 < held <= family.tensor_bytes(size), (family.name, held, family.tensor_bytes(size))
