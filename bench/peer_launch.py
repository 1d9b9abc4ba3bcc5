"""Launching the peer benchmark's runs: a peer (plain DeepSpeed or torch.distributed.pipelining, bench/peers_*.py) or
a stagecheck `train.py` run (bench/real_runs.py), each a real 2-rank launch on CPU, read back into one `Run`.
"""

import json
import os
import resource
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from bench.real_runs import DEEPSPEED, REPO, STAGES, Variant, free_port, launch, launch_env, read_result
from model import GPTConfig


@dataclass(frozen=True)
class Peer:
    name: str
    launcher: str
    """`deepspeed` (bench/peers_deepspeed.py) or `torch` (bench/peers_torch.py, through torchrun)."""
    variant: str


@dataclass
class Run:
    name: str
    round: int
    micro_batches: int
    seq_len: int
    step_s: list[float] = field(default_factory=list)
    """Seconds of each timed step (after warm-up and the metered step) on the rank that holds the loss."""
    peak_bytes: list[int] = field(default_factory=list)
    """Measured peak tensor bytes per rank (a rank holds one stage, or two under interleaved and ZBV schedules)."""
    launch_cpu_s: float = 0.0
    """CPU seconds of the whole launch: both ranks and the launcher, start-up included."""
    launch_wall_s: float = 0.0
    load: float = 0.0
    """The 1-minute load average when the launch ended."""
    loss: float | None = None
    error: str | None = None
    """Why the launch failed (its last output lines); no figures then."""
    plan: str | None = None
    """stagecheck's schedule and each (virtual) stage's block choices, as its summary.json records them (auto's
    choice; None for a peer)."""

    @property
    def tokens_per_s(self) -> float:
        return self.micro_batches * self.seq_len / statistics.median(self.step_s)

    @property
    def peak(self) -> int:
        """The largest rank's peak: the memory a user has to have."""
        return max(self.peak_bytes)


def _shape_args(cfg: GPTConfig, micro_batches: int, steps: int, out: Path) -> list[str]:
    return [
        *("--layers", str(cfg.n_layer), "--embd", str(cfg.n_embd), "--heads", str(cfg.n_head)),
        *("--seq-len", str(cfg.seq_len), "--dropout", str(cfg.dropout), "--attention", cfg.attention),
        *("--micro-batches", str(micro_batches), "--steps", str(steps), "--out", str(out)),
    ]


def run_peer(cfg: GPTConfig, peer: Peer, micro_batches: int, steps: int, run_dir: Path, round_: int) -> Run:
    out = run_dir / "ranks"
    if peer.launcher == "deepspeed":
        start = [str(DEEPSPEED), "--num_gpus", str(STAGES), "--master_port", str(free_port()), "--module"]
        module = "bench.peers_deepspeed"
    else:
        start = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(STAGES)]
        start += ["--master_port", str(free_port()), "-m"]
        module = "bench.peers_torch"
    cmd = [*start, module, "--variant", peer.variant, *_shape_args(cfg, micro_batches, steps, out)]
    run = Run(peer.name, round_, micro_batches, cfg.seq_len)
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    wall = time.monotonic()
    result = subprocess.run(cmd, cwd=REPO, env=launch_env(), capture_output=True, text=True, timeout=900)
    run.launch_wall_s = time.monotonic() - wall
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    run.launch_cpu_s = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
    run.load = os.getloadavg()[0]
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "launch.log").write_text(result.stdout + result.stderr)
    if result.returncode != 0:
        run.error = _last_lines(result.stdout + result.stderr)
        return run
    ranks = [json.loads(p.read_text()) for p in sorted(out.glob("rank*.json"))]
    holder = next(r for r in reversed(ranks) if r["losses"][-1] is not None)  # the rank of the last stage
    run.step_s, run.loss = holder["step_s"], holder["losses"][-1]
    run.peak_bytes = [r["peak_bytes"] for r in ranks]
    return run


def run_stagecheck(cfg: GPTConfig, variant: Variant, steps: int, run_dir: Path, round_: int) -> Run:
    run = Run(variant.name, round_, variant.micro_batches, cfg.seq_len)
    try:
        cpu_s, wall_s = launch(cfg, variant, steps, run_dir)
    except SystemExit as failed:  # launch() exits with the run's command and output
        run.error = _last_lines(str(failed))
        return run
    result = read_result(variant, round_, run_dir, cpu_s, wall_s)
    run.step_s, run.launch_cpu_s, run.launch_wall_s = result.step_times, cpu_s, wall_s
    summary = result.summary  # per rank under a schedule with virtual stages (2 stages per rank), else per stage
    per_rank = summary.get("measured_peak_tensor_bytes_per_rank")
    run.peak_bytes = per_rank or summary["measured_peak_tensor_bytes_per_stage"]
    run.loss, run.load = result.summary["losses"][-1], os.getloadavg()[0]
    stages = " | ".join(",".join(stage["choices"]) for stage in summary["layout"])
    run.plan = f"{summary['schedule']}: {stages}"
    return run


def _last_lines(text: str, n: int = 6) -> str:
    lines = [line for line in text.splitlines() if line.strip() and "Warning" not in line]
    return "\n".join(lines[-n:])
