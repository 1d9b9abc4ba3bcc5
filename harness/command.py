"""The commands beside training (generate.py, export_hf.py): bad input ends them like training's start-up, with
one `stagecheck: error: ...` line naming the option and exit code 2, no traceback. Every command, training
included, refuses an output directory that is a file here, before Hydra runs."""

import sys
from collections.abc import Callable

from harness.faults import EXIT_CONFIG
from harness.run_dir import check_directory_overrides


def run_command(command: Callable[[], None]) -> None:
    try:
        command()
    except ValueError as error:
        _refuse(error)


def refuse_file_as_directory(argv: list[str]) -> None:
    """Before Hydra parses `argv` (sys.argv): a hydra.run.dir or hydra.sweep.dir that is a file ends the command
    with one line, not in Hydra's traceback."""
    try:
        check_directory_overrides(argv[1:])
    except ValueError as error:
        _refuse(error)


def _refuse(error: ValueError) -> None:
    print(f"stagecheck: error: {error}", file=sys.stderr)
    sys.exit(EXIT_CONFIG)
