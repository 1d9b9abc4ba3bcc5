"""Launcher arguments Hydra cannot parse."""

import os
import re

LOCAL_RANK_ARG = re.compile(r"^--local[_-]rank(=(\d+))?$")


def strip_launcher_args(argv: list[str]) -> list[str]:
    """Drop the `--local_rank=N` (or `--local_rank N`) that the deepspeed launcher appends, keeping
    its value in LOCAL_RANK, where the launcher also puts it."""
    kept, i = [], 0
    while i < len(argv):
        match = LOCAL_RANK_ARG.match(argv[i])
        if not match:
            kept.append(argv[i])
            i += 1
            continue
        value = match.group(2)
        if value is None and i + 1 < len(argv) and argv[i + 1].isdigit():
            value, i = argv[i + 1], i + 1
        if value is not None:
            os.environ.setdefault("LOCAL_RANK", value)
        i += 1
    return kept
