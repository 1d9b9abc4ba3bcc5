"""docs/llama.md's dry-run table: real `python train.py model=PRESET dry_run=true` runs, one per recompute mode, for
llama3-8b on 8 GPUs (4 stages x 2 data-parallel) and llama3-70b on 64 (8 stages x 8 data-parallel, ZeRO-1), read
back from each plan.json. Prints a Markdown table: per mode, whether every stage's predicted peak fits an 80 GiB
GPU, each stage's predicted peak, the predicted step time, and which costs priced it.

python -m bench.llama_plan_table
"""

import json
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
GIB = 2**30
GPU_GIB = 80
GRIDS = {
    "llama3-8b": ("parallel.pipeline_stages=4", "parallel.data_parallel_size=2", "train.micro_batches=8"),
    "llama3-70b": (
        "parallel.pipeline_stages=8",
        "parallel.data_parallel_size=8",
        "parallel.zero_stage=1",
        "train.micro_batches=16",
    ),
}
COMMON = ("data=synthetic", "train.micro_batch_size=1", "dry_run=true")
MODES = {
    "none": (),
    "selective (core_attn)": ("+recompute=selective",),
    "selective (core_attn, mlp_act, layernorm)": (
        "+recompute=selective",
        "recompute.modules=[core_attn,mlp_act,layernorm]",
    ),
    "full (every block)": ("+recompute=full",),
    f"auto ({GPU_GIB} GiB budget)": ("+recompute=auto", f"recompute.budget_gb={GPU_GIB}"),
}


def dry_run(model: str, overrides: tuple[str, ...], run_dir: Path) -> dict | str:
    """plan.json of the dry run, or the one-line message it exited with."""
    command = [sys.executable, "train.py", f"model={model}", *GRIDS[model], *COMMON, *overrides]
    result = subprocess.run([*command, f"hydra.run.dir={run_dir}"], cwd=REPO, capture_output=True, text=True)
    if result.returncode != 0:
        return result.stderr.strip().splitlines()[-1]
    return json.loads((run_dir / "plan.json").read_text())


def row(model: str, mode: str, plan: dict | str) -> str:
    if isinstance(plan, str):
        return f"| {model} | {mode} | no | - | - | {plan.removeprefix('stagecheck: error: ')} |"
    peaks = [stage["predicted_peak_bytes"] / GIB for stage in plan["stages"]]
    fits = "yes" if max(peaks) <= GPU_GIB else "no"
    peak_text = " / ".join(f"{peak:.1f}" for peak in peaks)
    costs = f"{plan['step_time_costs']}, {plan['device']} peak"
    return f"| {model} | {mode} | {fits} | {peak_text} | {plan['predicted_step_time_s']:.2f} | {costs} |"


def main() -> None:
    print(f"| model | recompute | fits {GPU_GIB} GiB | predicted peak per stage (GiB) | step (s) | priced by |")
    print("|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as scratch:
        for model in GRIDS:
            for k, (mode, overrides) in enumerate(MODES.items()):
                plan = dry_run(model, overrides, Path(scratch) / f"{model}-{k}")
                print(row(model, mode, plan), flush=True)


if __name__ == "__main__":
    main()
