"""Predicted against measured peak tensor memory per stage, on CPU, for every recompute mode at two shapes.

    DS_ACCELERATOR=cpu .venv/bin/python -m bench.peak_memory_bench [--out DIR]

Each shape is trained for 2 steps by the real `deepspeed` launcher (2 CPU ranks, 2 stages, gloo): one Hydra
multirun over the variants none, selective (attention core), full(1) and full(stage), and one run of `auto`
at a budget between full's and none's predicted peaks (the planner's own figures, from a dry run). Step 2
(train.measure_step) is measured by parallel/measurement/tensor_peak.py: the most bytes of live tensors at once, the
baseline (parameters, optimizer state, buffers) included. The prediction is the run plan's
`predicted_peak_bytes` (parallel/planning/stage_bytes.py's StageMemory.peak_tensor_terms). Bytes are exact, so
the machine's load does not change the figures. About 3 minutes on 2 busy cores.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEEPSPEED = Path(sys.executable).with_name("deepspeed")
VARIANTS = ("none", "selective_core_attn", "full_1", "full_stage")
COMMON = (
    "model=tiny",
    "data=synthetic",
    "train.device=cpu",
    "train.steps=2",
    "train.measure_step=2",
    "train.trace_step=0",
    "train.micro_batches=4",
    "train.micro_batch_size=2",
    "logger=none",
)
SHAPES = {
    "h128 s128 dropout 0.1 (sdpa-math)": (),
    "h256 s256 dropout 0 (sdpa-flash)": ("model.n_embd=256", "model.n_head=8", "model.seq_len=256", "model.dropout=0"),
}
TOLERANCE = 0.10
MIB = 2**20


def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    env.update(DS_ACCELERATOR="cpu", WANDB_MODE="disabled", PYTHONUNBUFFERED="1")
    return env


def _run(cmd: list[str]) -> None:
    done = subprocess.run(cmd, cwd=REPO, env=_env(), capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")


def _deepspeed(port: int, *args: str) -> list[str]:
    return [str(DEEPSPEED), "--num_gpus", "2", "--master_port", str(port), "train.py", *args]


def auto_budget_gb(out: Path, shape: tuple[str, ...]) -> float:
    """Halfway between stage 0's predicted peak under full(stage) and under none (dry runs), in GiB."""
    peaks = []
    for variant in ("full_stage", "none"):
        run_dir = out / f"dry-{variant}"
        _run(
            [sys.executable, "train.py", f"hydra.run.dir={run_dir}", "dry_run=true", "parallel.pipeline_stages=2"]
            + ["parallel.data_parallel_size=1", f"variant={variant}", *COMMON, *shape]
        )
        plan = json.loads((run_dir / "plan.json").read_text())
        peaks.append(plan["stages"][0]["predicted_peak_bytes"])
    return (sum(peaks) / 2) / 2**30


def measure_shape(out: Path, shape: tuple[str, ...], port: int) -> dict[str, dict]:
    """{mode: summary.json} for the four variants and auto."""
    sweep = out / "sweep"
    _run(_deepspeed(port, "-m", f"hydra.sweep.dir={sweep}", f"variant={','.join(VARIANTS)}", *COMMON, *shape))
    summaries = {v: json.loads((sweep / str(i) / "summary.json").read_text()) for i, v in enumerate(VARIANTS)}
    budget = auto_budget_gb(out, shape)
    auto_dir = out / "auto"
    _run(
        _deepspeed(
            port + 1,
            f"hydra.run.dir={auto_dir}",
            "+recompute=auto",
            f"recompute.budget_gb={budget:.6f}",
            "recompute.reserve_gb=0",
            *COMMON,
            *shape,
        )
    )
    summaries[f"auto ({budget * 1024:.1f} MiB)"] = json.loads((auto_dir / "summary.json").read_text())
    return summaries


def table(results: dict[str, dict[str, dict]]) -> tuple[list[str], bool]:
    lines = [
        "| shape | mode | stage | blocks' choices | predicted MiB | measured MiB | measured / predicted | "
        "baseline MiB | peak op | RSS MiB |",
        "|---|---|---:|---|---:|---:|---:|---:|---|---:|",
    ]
    ok = True
    for shape, summaries in results.items():
        for mode, s in summaries.items():
            for stage, (pred, meas) in enumerate(
                zip(s["predicted_peak_bytes_per_stage"], s["measured_peak_tensor_bytes_per_stage"])
            ):
                ratio = meas / pred
                ok &= abs(ratio - 1) <= TOLERANCE
                choices = ",".join(sorted(set(s["layout"][stage]["choices"]))) or "-"
                lines.append(
                    f"| {shape} | {mode} | {stage} | {choices} | {pred / MIB:.3f} | {meas / MIB:.3f} | {ratio:.3f} | "
                    f"{s['measured_baseline_tensor_bytes_per_stage'][stage] / MIB:.3f} | "
                    f"{s['tensor_peak_op_per_stage'][stage]} | {s['peak_memory_bytes_per_stage'][stage] / MIB:.0f} |"
                )
    return lines, ok


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="keep the runs here (default: a temporary directory)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        out = args.out or Path(tmp)
        results = {
            name: measure_shape(out / f"shape{i}", shape, 29500 + 10 * i)
            for i, (name, shape) in enumerate(SHAPES.items())
        }
    lines, ok = table(results)
    print("\n".join(lines))
    verdict = "met" if ok else "NOT met"
    print(f"\npredicted and measured peak tensor bytes agree within {TOLERANCE:.0%} on every stage: {verdict}")


if __name__ == "__main__":
    main()
