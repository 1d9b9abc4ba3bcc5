"""Per-step metrics: metrics.jsonl, the progress line, W&B, and summary.json at the end."""

import json
import statistics
import sys
from pathlib import Path

from harness.files import atomic_write_json, atomic_write_text
from harness.wandb_logger import WandbLogger


def median_after_warmup(values: list[float]) -> float:
    """Median, skipping the first steps (allocator and JIT warm-up) when there are enough."""
    skip = 2 if len(values) > 4 else min(1, len(values) - 1)
    return statistics.median(values[skip:])


class MetricsLog:
    """Written by the one rank that holds the loss (last stage, first data-parallel rank)."""

    def __init__(
        self,
        run_dir: Path,
        total_steps: int,
        print_every: int,
        wandb: WandbLogger | None,
        resume_step: int | None = None,
    ):
        self.run_dir = run_dir
        self.total_steps = total_steps
        self.print_every = print_every
        self.wandb = wandb
        self.records: list[dict] = []
        path = run_dir / "metrics.jsonl"
        if resume_step is None:
            # "x": never truncate an existing run's metrics (start-up already refused such a directory).
            self._file = open(path, "x", buffering=1)
        else:
            # Resumed after `resume_step`: keep the records up to it, drop those logged after the checkpoint
            # (they are trained again), and append from there: no step appears twice.
            self.records = _records_up_to(path, resume_step)
            atomic_write_text(path, "".join(json.dumps(r) + "\n" for r in self.records))
            self._file = open(path, "a", buffering=1)
        self._live = sys.stdout.isatty()

    def log_step(self, record: dict) -> None:
        self.records.append(record)
        self._file.write(json.dumps(record) + "\n")
        if self.wandb:
            self.wandb.log(record, step=record["step"])
        step = record["step"]
        if step % self.print_every == 0 or step == self.total_steps or "val_loss" in record:  # every eval shows
            line = (
                f"step {step}/{self.total_steps} | loss {record['loss']:.4f} | lr {record['lr']:.2e} | "
                f"{record['tokens_per_s']:,.0f} tok/s | {record['step_time_s']:.3f} s/step"
            )
            if "val_loss" in record:
                line += f" | val {record['val_loss']:.4f}"
            # On a terminal each line overwrites the last, except the evaluated steps': the val loss history stays.
            end = "\r" if self._live and step < self.total_steps and "val_loss" not in record else "\n"
            print(line, end=end, flush=True)

    def write_summary(self, summary: dict) -> None:
        atomic_write_json(self.run_dir / "summary.json", summary)  # a crash mid-write never leaves half a summary
        if self.wandb:
            # The histories are W&B's history already (every step's record); the summary keeps the last values.
            self.wandb.update_summary({k: v for k, v in summary.items() if k not in ("losses", "val_losses")})

    def close(self, exit_code: int = 0) -> None:
        if self._file.closed:
            return
        self._file.close()
        if self.wandb:
            self.wandb.finish(exit_code=exit_code)


def _records_up_to(path: Path, step: int) -> list[dict]:
    if not path.exists():
        return []
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r for r in records if r["step"] <= step]
