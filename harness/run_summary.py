"""The run's last line, printed by the rank that holds the loss once W&B has finished: what a user wants to
see when the run ends, and where to find the rest.

    stagecheck: done | loss 2.5312 | val 2.6120 | 3,120 tok/s (median) | peak activations per stage 1.50 MiB /
    0.75 MiB | run dir outputs/... | wandb sync outputs/.../wandb/offline-run-...
"""

from pathlib import Path

from harness.wandb_logger import WandbLogger
from parallel.planning.shapes import MIB


def wandb_sync_command(wandb: WandbLogger | None) -> str | None:
    """`wandb sync <dir>` for a run that logged offline (logger.mode=offline, or an online init that fell back to
    offline); None when nothing waits to be uploaded."""
    if wandb is None or not wandb.run.offline:
        return None
    return f"wandb sync {wandb.run.settings.sync_dir}"


def _mib(value: int | None) -> str:
    return "n/a" if value is None else f"{value / MIB:.2f} MiB"


def done_line(summary: dict, run_dir: Path, sync_command: str | None) -> str:
    """One line from summary.json's values: final train loss, final val loss (eval on), median tokens/s, the
    measured peak activation bytes per stage (per rank under a virtual-stage schedule; n/a where train.measure_step
    metered nothing), the run directory and the W&B upload command."""
    losses = summary["losses"]
    parts = ["stagecheck: done", f"loss {losses[-1]:.4f}" if losses else "loss n/a"]
    if "val_loss" in summary:
        parts.append(f"val {summary['val_loss']:.4f}")
    parts.append(f"{summary['tokens_per_s']:,.0f} tok/s (median)")
    if "measured_activation_bytes_per_rank" in summary:  # a schedule with virtual stages: per rank
        peaks = summary["measured_activation_bytes_per_rank"]
        parts.append("peak activations per rank " + " / ".join(_mib(b) for b in peaks))
    else:
        peaks = summary.get("peak_activation_bytes_per_stage") or []
        parts.append("peak activations per stage " + " / ".join(_mib(b) for b in peaks))
    parts.append(f"run dir {run_dir}")
    if sync_command:
        parts.append(sync_command)
    return " | ".join(parts)
