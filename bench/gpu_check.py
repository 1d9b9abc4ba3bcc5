"""`make gpu-check` (python -m bench.gpu_check): the CUDA check, at most 10 minutes on one GPU, more checks with two
or more. It writes docs/gpu_figures.md from what it ran, and only on a machine with a GPU.

- tests/test_gpu.py (`pytest -m gpu`): planned = measured activation bytes, the predicted peak against the step
  window's `max_memory_allocated`, exactness as docs/gpu.md defines it, the weight-gradient store and early
  recompute, an fp16 overflow, a resume (also under another device visibility with two GPUs). NCCL refuses two
  ranks on one GPU: there, multi-stage checks run every stage in one process.
- gpt2 and the Llama family (smollm2-135m: grouped-query attention, RMSNorm, rotary, SwiGLU; random weights) on one
  GPU, one rank, bf16 with SDPA, per recompute mode, eager and with train.compile (docs/compile.md): peak memory
  predicted and measured (the most allocated in a step, the allocator's reserve beside it), tokens/s, MFU, the SDPA
  kernel that ran, and what compiling cost (the six compiled runs are not yet timed on a GPU: they may stretch
  the 10 minutes).
- Two GPUs or more: 2-stage NCCL runs of gpt2 under 1f1b and under zb-h1 with early full recompute, activations and
  gradients of 18 MiB per message (NCCL's buffers hold far less), and of smollm2-135m under zb-h1 with early full
  recompute, each under a timeout: a hang is reported as one.
"""

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ElementTree
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
FIGURES = REPO / "docs" / "gpu_figures.md"
DEEPSPEED = Path(sys.executable).with_name("deepspeed")
MODES = ("none", "selective", "full")
COMPILED = ", compiled"
"""Suffix of a mode's row run with train.compile=true (the planner's predicted peak is eager autograd's then)."""
COMMON = ["data=synthetic", "train.device=cuda", "train.precision=bf16", "logger=none", "train.steps=8"]
COMMON += ["train.micro_batches=4", "train.measure_step=3", "train.trace_step=0"]
MODELS = {
    "gpt2": ["model=gpt2"],
    "smollm2-135m": ["model=smollm2-135m", "model.seq_len=1024"],
}
"""Each family's model on one GPU (smollm2-135m: 9 query heads sharing 3 KV heads, head size 64, tied head)."""
MICRO_BATCH = 8
PIPE_MICRO_BATCH = 12
"""2-stage gpt2 runs: (12, 1024, 768) bf16 activations, 18 MiB per message."""
LLAMA_PIPE_MICRO_BATCH = 16
"""2-stage smollm2-135m runs: (16, 1024, 576) bf16 activations, 18 MiB per message."""
RUN_TIMEOUT_S = 240
MIB = 2**20


def launch_env() -> dict:
    """The CUDA accelerator, no W&B, no inherited rank variables (bench/ may not import tests/'s helpers)."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    env.update(DS_ACCELERATOR="cuda", WANDB_MODE="disabled", PYTHONUNBUFFERED="1")
    env.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # the exactness tests' deterministic cuBLAS
    return env


def run(cmd: list[str], timeout: float) -> tuple[int | None, float, str]:
    """(exit code, or None when it ran past `timeout`; wall seconds; the output's tail). In a session of its own:
    a hung launch is ended with every rank it started, so none keeps holding a GPU."""
    start = time.perf_counter()
    proc = subprocess.Popen(
        cmd, cwd=REPO, env=launch_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True
    )
    try:
        output, _ = proc.communicate(timeout=timeout)
        code = proc.returncode
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        code = None
    return code, time.perf_counter() - start, output.decode(errors="replace")[-5000:]


def gpu_tests(root: Path) -> list[tuple[str, str]]:
    """(test, outcome) of every test of tests/test_gpu.py."""
    report = root / "gpu-tests.xml"
    cmd = [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "tests/test_gpu.py", f"--junitxml={report}"]
    code, wall, tail = run(cmd, timeout=420)
    print(f"gpu-check: pytest -m gpu: exit {code} in {wall:.0f} s\n{tail[-1500:]}", flush=True)
    if not report.exists():
        return [("tests/test_gpu.py", "did not finish" if code is None else f"exit {code}")]
    outcomes = []
    for case in ElementTree.parse(report).getroot().iter("testcase"):
        kinds = {child.tag for child in case}
        outcome = next((k for k in ("failure", "error", "skipped") if k in kinds), "passed")
        outcomes.append((case.get("name"), outcome))
    return outcomes


def train_run(root: Path, name: str, overrides: list[str], nproc: int = 1) -> dict:
    """One train.py run (one rank: python; several: the deepspeed launcher): its summary, or why there is none."""
    run_dir = root / name
    args = ["train.py", f"hydra.run.dir={run_dir}", *overrides]
    cmd = [sys.executable, *args] if nproc == 1 else [str(DEEPSPEED), "--num_gpus", str(nproc), *args]
    code, wall, tail = run(cmd, RUN_TIMEOUT_S)
    print(f"gpu-check: {name}: exit {code} in {wall:.0f} s", flush=True)
    if code != 0:
        what = f"no result within {RUN_TIMEOUT_S} s (a hang?)" if code is None else f"exit {code}"
        print(tail, flush=True)
        return {"failed": what, "wall_s": wall}
    return {**json.loads((run_dir / "summary.json").read_text()), "wall_s": wall}


def mode_rows(runs: dict[str, dict]) -> list[str]:
    rows = [
        "| mode | predicted peak (MiB) | measured peak, max allocated per step (MiB) | measured / predicted | "
        "reserved (MiB) | tokens/s | MFU | SDPA kernel | first step's compiling (s), graphs, later graphs |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for mode, s in runs.items():
        if "failed" in s:
            rows.append(f"| {mode} | {s['failed']} | | | | | | | |")
            continue
        predicted, measured = s["predicted_peak_bytes_per_stage"][0], s["peak_memory_bytes_per_stage"][0]
        mfu = (s.get("mfu_per_rank") or [None])[0]
        compiled = (s.get("compile_per_rank") or [None])[0]
        compiling = "eager"
        if compiled:
            first = compiled["first_step"]
            compiling = f"{first['compile_s']:.0f}, {first['graphs']}, {compiled['later']['graphs']}"
        rows.append(
            f"| {mode} | {predicted / MIB:,.0f} | {measured / MIB:,.0f} | {measured / predicted:.3f} | "
            f"{s['peak_reserved_bytes_per_stage'][0] / MIB:,.0f} | {s['tokens_per_s']:,.0f} | "
            f"{'n/a' if mfu is None else f'{mfu:.3f}'} | {s['sdpa_backend']} | {compiling} |"
        )
    return rows


def pipe_rows(runs: dict[str, dict]) -> list[str]:
    rows = ["| schedule | result | losses | tokens/s | wall (s) |", "|---|---|---|---|---|"]
    for name, s in runs.items():
        if "failed" in s:
            rows.append(f"| {name} | {s['failed']} | | | {s['wall_s']:.0f} |")
            continue
        losses = ", ".join(f"{loss:.4f}" for loss in s["losses"])
        rows.append(f"| {name} | finished | {losses} | {s['tokens_per_s']:,.0f} | {s['wall_s']:.0f} |")
    return rows


def write_figures(gpus: int, tests: list[tuple[str, str]], modes: dict, pipes: dict, wall_s: float) -> None:
    """`modes`: {model: {recompute mode: summary}}; `pipes`: {2-stage run: summary}."""
    name = torch.cuda.get_device_name(0)
    lines = [
        "# GPU figures (written by `make gpu-check`)",
        "",
        f"{gpus} x {name}, torch {torch.__version__}, CUDA {torch.version.cuda}; the check took {wall_s / 60:.1f} min. "
        "What the checks mean: [gpu.md](gpu.md).",
        "",
    ]
    for model, runs in modes.items():
        lines += [
            f"## {model} on one GPU (bf16, SDPA, micro-batch {MICRO_BATCH} x 1024 tokens, 4 micro-batches)",
            "",
            *mode_rows(runs),
            "",
        ]
    lines += [
        "## Exactness and the other GPU tests (tests/test_gpu.py)",
        "",
        "| test | outcome |",
        "|---|---|",
        *[f"| {test} | {outcome} |" for test, outcome in tests],
        "",
    ]
    if pipes:
        lines += [
            f"## 2 stages on 2 GPUs over NCCL (bf16; gpt2 at micro-batch {PIPE_MICRO_BATCH}, smollm2-135m at "
            f"{LLAMA_PIPE_MICRO_BATCH}: 18 MiB per message)",
            "",
            *pipe_rows(pipes),
            "",
        ]
    else:
        lines += ["## 2 stages over NCCL", "", "Not run: one GPU (NCCL refuses two ranks on one GPU).", ""]
    FIGURES.write_text("\n".join(lines))
    print(f"gpu-check: wrote {FIGURES.relative_to(REPO)}", flush=True)


def main() -> int:
    gpus = torch.cuda.device_count()
    if gpus == 0:
        print("gpu-check: no CUDA device is visible: nothing checked, docs/gpu_figures.md left as it is")
        return 1
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp:
        root = Path(tmp)
        tests = gpu_tests(root)
        modes = {
            model: {
                mode + suffix: train_run(
                    root,
                    f"{model}-{mode}{'-compiled' if suffix else ''}",
                    [
                        *COMMON,
                        *overrides,
                        f"train.micro_batch_size={MICRO_BATCH}",
                        f"+recompute={mode}",
                        f"train.compile={'true' if suffix else 'false'}",
                    ],
                )
                for suffix in ("", COMPILED)
                for mode in MODES
            }
            for model, overrides in MODELS.items()
        }
        pipes = {}
        if gpus >= 2:
            early = ["parallel.schedule=zb-h1", "+recompute=full", "recompute.early=true"]
            pipe = [*COMMON, "parallel.pipeline_stages=2"]
            gpt2 = [*pipe, *MODELS["gpt2"], f"train.micro_batch_size={PIPE_MICRO_BATCH}"]
            llama = [*pipe, *MODELS["smollm2-135m"], f"train.micro_batch_size={LLAMA_PIPE_MICRO_BATCH}"]
            pipes = {
                "gpt2, 1f1b": train_run(root, "pipe-gpt2-1f1b", [*gpt2, "parallel.schedule=1f1b"], nproc=2),
                "gpt2, zb-h1, early full recompute": train_run(root, "pipe-gpt2-zb-h1-early", [*gpt2, *early], nproc=2),
                "smollm2-135m, zb-h1, early full recompute": train_run(
                    root, "pipe-smollm2-zb-h1-early", [*llama, *early], nproc=2
                ),
            }
        write_figures(gpus, tests, modes, pipes, time.perf_counter() - start)
    failed = [t for t, outcome in tests if outcome not in ("passed", "skipped")]
    runs = {f"{model} {mode}": s for model, by_mode in modes.items() for mode, s in by_mode.items()}
    failed += [name for name, s in {**runs, **pipes}.items() if "failed" in s]
    print(f"gpu-check: {'all passed' if not failed else 'FAILED: ' + ', '.join(failed)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
