"""The recompute report of a sweep: `python report.py SWEEP_DIR`.

Reads every job's summary.json (and plan.json, FAILED) under SWEEP_DIR, writes SWEEP_DIR/report.md and
SWEEP_DIR/report.png, and logs both to W&B (a Table and an Image, job_type `report`) in the sweep's group,
with the sweep's logger settings (offline unless the sweep ran with logger.mode=online). A multirun
(`train.py -m ...`) writes the same report when it ends; this redoes it, e.g. after a sweep stopped early.
See sweep/report/.
"""

import argparse
import sys
from pathlib import Path

from sweep.report import sweep_logger, write_report


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("sweep_dir", type=Path, help="a multirun directory holding job directories 0/, 1/, ...")
    parser.add_argument("--no-wandb", action="store_true", help="write report.md and report.png only")
    parser.add_argument(
        "--wandb-mode",
        choices=("offline", "online"),
        default=None,
        help="override the sweep's logger.mode for the report run",
    )
    args = parser.parse_args(argv)
    if not args.sweep_dir.is_dir():
        print(f"report.py: error: {args.sweep_dir} is not a directory", file=sys.stderr)
        return 2
    logger = None
    if args.wandb_mode:
        logger = {**(sweep_logger(args.sweep_dir) or {"name": "wandb"}), "mode": args.wandb_mode}
    try:
        write_report(args.sweep_dir, logger=logger, wandb=not args.no_wandb)
    except ValueError as error:
        print(f"report.py: error: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
