"""Real 2-rank training runs for the benchmarks: the benchmark's model shape, one `deepspeed --num_gpus 2 train.py`
launch on CPU (gloo, one thread per rank) read back from its summary.json, metrics.jsonl and traced step, and the
round-robin runner that interleaves variants (every variant once per round), so a ratio within one round compares
runs that saw the same machine state. bench/step_time_bench.py, bench/hidden_recompute_bench.py and
bench/micro_batch_bench.py launch through it.
"""

import json
import os
import resource
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from model import GPTConfig
from parallel.planning.step_sim import StageCosts

REPO = Path(__file__).resolve().parents[1]
DEEPSPEED = Path(sys.executable).with_name("deepspeed")
STAGES = 2
TRACE_STEP = 3
"""Traced step (train.trace_step): after the allocator warm-up. It stays in the bench's own median (as in
summary.json's): its timers and one barrier cost milliseconds against steps of seconds."""
EXIT_ABORT = "terminate called without an active exception"
"""What a rank printed when the teardown of torch's C++ statics aborted it at exit, after its run finished and wrote
summary.json (4 of about 230 launches of bench/planner_regret.py); train.py now skips that teardown
(harness/process_exit.py), and a bench still says so should it come back."""
SKIPPED_STEPS = 2
"""Left out of the bench's own median: step 1 (allocator warm-up) and step 2 (train.measure_step: the activation
meter's saved-tensor hooks), as harness/metrics.py's median_after_warmup."""


@dataclass(frozen=True)
class Variant:
    name: str
    micro_batches: int
    recompute: object
    """The config the run gets, for the in-process replay of its plan with the bench's profile."""
    partition: str
    overrides: tuple[str, ...]
    figures: tuple[int, ...]


@dataclass
class Result:
    variant: Variant
    round: int
    summary: dict
    step_times: list[float]
    """Seconds of each step after warm-up (metrics.jsonl)."""
    launch_cpu_s: float
    """CPU seconds of the whole launch (both ranks and the launcher, start-up included)."""
    launch_wall_s: float
    replayed: dict = field(default_factory=dict)

    @property
    def median_step_s(self) -> float:
        return statistics.median(self.step_times)

    @property
    def tokens_per_s(self) -> float:
        return (
            self.variant.micro_batches
            * self.summary["seq_len"]
            * self.summary["micro_batch_size"]
            / (self.median_step_s)
        )


def model_config(smoke: bool) -> GPTConfig:
    if smoke:
        return GPTConfig(n_layer=2, n_head=4, n_embd=64, seq_len=64, vocab_size=256, dropout=0.1, attention="math")
    return GPTConfig(n_layer=8, n_head=8, n_embd=256, seq_len=512, vocab_size=256, dropout=0.1, attention="math")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_env() -> dict:
    """CPU accelerator, one thread per rank (2 ranks on 2 cores), no W&B, no inherited rank variables
    (tests/runs.py's cpu_env does the same for tests; bench/ may not import tests/)."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("WANDB_", "SLURM_"))
        and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    }
    env.update(DS_ACCELERATOR="cpu", WANDB_MODE="disabled", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    return env


def train_args(cfg: GPTConfig, variant: Variant, steps: int, run_dir: Path) -> list[str]:
    """`train.py` and its overrides for one variant (a launch's, or its dry run's with `dry_run=true` added)."""
    return [
        "train.py",
        f"hydra.run.dir={run_dir}",
        "data=synthetic",
        "logger=none",
        "train.device=cpu",
        "train.precision=fp32",
        f"model.n_layer={cfg.n_layer}",
        f"model.n_head={cfg.n_head}",
        f"model.n_embd={cfg.n_embd}",
        f"model.seq_len={cfg.seq_len}",
        f"model.vocab_size={cfg.vocab_size}",
        f"model.dropout={cfg.dropout}",
        f"model.attention={cfg.attention}",
        f"train.steps={steps}",
        f"train.micro_batches={variant.micro_batches}",
        "train.micro_batch_size=1",
        f"train.trace_step={TRACE_STEP}",
        "train.save_every=0",
        "train.keep_checkpoints=1",
        f"parallel.partition_method={variant.partition}",
        *variant.overrides,
    ]


def dry_run_plan(cfg: GPTConfig, variant: Variant, run_dir: Path) -> dict | str:
    """The variant's plan.json from its dry run (`train.py ... dry_run=true`, no launcher, one thread as a rank has),
    or the start-up's refusal line."""
    command = [sys.executable, *train_args(cfg, variant, 5, run_dir), f"parallel.pipeline_stages={STAGES}"]
    command.append("dry_run=true")  # without a launcher, the dry run's stages are parallel.pipeline_stages
    result = subprocess.run(command, cwd=REPO, env=launch_env(), capture_output=True, text=True)
    if result.returncode != 0:
        return result.stderr.strip().splitlines()[-1]
    return json.loads((run_dir / "plan.json").read_text())


def launch(cfg: GPTConfig, variant: Variant, steps: int, run_dir: Path) -> tuple[float, float]:
    """One real 2-rank training run; returns (CPU seconds, wall seconds) of the whole launch."""
    cmd = [str(DEEPSPEED), "--num_gpus", str(STAGES), "--master_port", str(free_port())]
    cmd += train_args(cfg, variant, steps, run_dir)
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    wall = time.monotonic()
    result = subprocess.run(cmd, cwd=REPO, env=launch_env(), capture_output=True, text=True, timeout=900)
    wall = time.monotonic() - wall
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    aborted_at_exit = EXIT_ABORT in result.stderr and (run_dir / "summary.json").is_file()
    if aborted_at_exit:  # every step ran and was written: measured, and said (docs/step_time_benchmark.md)
        print(f"{variant.name}: a rank aborted at exit after the run finished ({EXIT_ABORT})", flush=True)
    elif result.returncode != 0:
        raise SystemExit(
            f"{variant.name}: {' '.join(cmd)} exited {result.returncode}\n{result.stdout[-3000:]}\n"
            f"{result.stderr[-3000:]}"
        )
    (run_dir / "launch.log").write_text(result.stdout + result.stderr)
    return (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime), wall


def read_result(variant: Variant, round_: int, run_dir: Path, cpu_s: float, wall_s: float) -> Result:
    summary = json.loads((run_dir / "summary.json").read_text())
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r["step_time_s"] for r in records if r["step"] > SKIPPED_STEPS]
    return Result(variant, round_, summary, steps, cpu_s, wall_s)


def traced_costs(summary: dict) -> list[StageCosts]:
    """Each stage's mean traced instruction seconds in the simulator's terms (step_sim.StageCosts): the
    shortest send/recv stands for a transfer, the rest of a blocking send or recv is waiting for the peer. The
    backward is BackwardPass, or BackwardInput + BackwardWeight under zb-h1, without the recompute inside it; the
    recompute is a RecomputeEarly where the stage runs one, else what ran inside the backward."""

    def s(costs: dict, key: str) -> float:
        return costs.get(key) or 0.0

    out = []
    for c in summary["trace_costs"]:
        early = c.get("early_recompute_s") is not None
        backward = (
            c["backward_s"] if c.get("backward_s") is not None else s(c, "backward_input_s") + s(c, "backward_weight_s")
        )
        out.append(
            StageCosts(
                forward=s(c, "forward_s"),
                backward=backward - (0.0 if early else s(c, "recompute_s")),
                recompute=s(c, "early_recompute_s") if early else s(c, "recompute_s"),
                send_activation=s(c, "p2p_min_s"),
                send_grad=s(c, "p2p_min_s"),
                reduce_tied=s(c, "reduce_tied_grads_s"),
                reduce_grads=s(c, "reduce_grads_s"),
                optimizer=s(c, "optimizer_s"),
                load=s(c, "load_s"),
                weight_grad=s(c, "backward_weight_s"),
            )
        )
    return out


def run_dir_of(root: Path, round_: int, variant: Variant) -> Path:
    return root / f"r{round_ + 1}-{variant.name.replace(' ', '-').replace('(', '').replace(')', '')}"


def run_rounds(
    cfg: GPTConfig, todo: list[Variant], rounds: int, steps: int, root: Path, first_round: int = 1, shape: str = ""
) -> list[Result]:
    """Every variant once per round, `rounds` times, each a real launch into run_dir_of(root, round, variant);
    prints a line per run as it ends (its round counted from `first_round`, after `shape`: a caller that runs one
    round per call over several shapes)."""
    results = []
    for k in range(rounds):
        for variant in todo:
            run_dir = run_dir_of(root, k, variant)
            cpu_s, wall_s = launch(cfg, variant, steps, run_dir)
            result = read_result(variant, k, run_dir, cpu_s, wall_s)
            results.append(result)
            print(
                f"{shape + ' ' if shape else ''}round {first_round + k} {variant.name}: "
                f"{result.median_step_s:.3f} s/step, "
                f"{result.tokens_per_s:.0f} tok/s, launch {wall_s:.0f} s wall / {cpu_s:.0f} s CPU",
                flush=True,
            )
    return results
