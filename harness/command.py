"""The commands beside training (generate.py, export_hf.py): bad input ends them like training's start-up, with
one `stagecheck: error: ...` line naming the option and exit code 2, no traceback."""

import sys
from collections.abc import Callable

from harness.faults import EXIT_CONFIG


def run_command(command: Callable[[], None]) -> None:
    try:
        command()
    except ValueError as error:
        print(f"stagecheck: error: {error}", file=sys.stderr)
        sys.exit(EXIT_CONFIG)
