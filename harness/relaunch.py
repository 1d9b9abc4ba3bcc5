"""The command that launched this run, as the user typed it: the launcher with its options, the script path, the
options. A preemption and a refused resume print it (with the run directory), so a relaunch is a copy and paste.

The launcher's words are read from /proc: the ranks' own command line is the launcher's rewrite (`python -u
train.py --local_rank=0 ...`), while the typed one (`deepspeed --num_gpus 2 --master_port 29600 train.py ...`) is
the furthest ancestor whose command line still holds the script as a word. Where /proc does not tell (not Linux,
srun's tasks), the launcher is inferred from the world size.
"""

import os
import shlex
import shutil
from pathlib import Path

LAUNCHERS = ("deepspeed", "torchrun")
"""Python console scripts that start the ranks: shown by name when that name on PATH is the one that ran."""
INTERPRETERS = ("python", "bash", "sh", "dash", "zsh")
"""What runs a launcher script (its #! line): the script is what the user typed."""
ANCESTORS = 3
"""deepspeed's runner is the ranks' grandparent (runner, deepspeed.launcher.launch, rank), torchrun's their parent;
one more for a wrapper script in front of the runner (launch/local_deepspeed.sh)."""


def _cmdline(pid: int) -> list[str]:
    return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")[:-1]


def _parent(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def typed_launcher(script: str) -> list[str] | None:
    """The launcher's words up to and including `script` (the path the ranks were given), as typed; None when /proc
    does not show them."""
    found, pid = None, os.getpid()
    try:
        for _ in range(ANCESTORS + 1):
            words = _cmdline(pid)
            if script in words:
                found = words
            pid = _parent(pid)
    except (OSError, ValueError, IndexError):
        pass
    if found is None:
        return None
    found = found[: found.index(script) + 1]
    # A launcher script runs as `INTERPRETER SCRIPT ...` (`/path/bin/python /path/bin/deepspeed ...`, `/bin/bash
    # launch/local_deepspeed.sh ...`): show what was typed, the script, by name when PATH finds it.
    if len(found) > 2 and Path(found[0]).name.startswith(INTERPRETERS) and not found[1].startswith("-"):
        name = Path(found[1]).name
        found = [name if shutil.which(name) == found[1] else found[1], *found[2:]]
    return found


def launcher_words(script: str, world_size: int) -> list[str]:
    """This launch's launcher and script as typed, else the launcher a world of `world_size` ranks needs."""
    typed = typed_launcher(script)
    if typed is not None:
        return typed
    if "SLURM_PROCID" in os.environ:
        return ["srun", "python", script]
    return ["python", script] if world_size == 1 else ["deepspeed", "--num_gpus", str(world_size), script]


RANK_COUNT_OPTIONS = {"deepspeed": "--num_gpus", "torchrun": "--nproc_per_node"}
"""Each launcher's option for the ranks of one node (a single node: the world size)."""


def with_ranks(launcher: list[str], world_size: int) -> list[str]:
    """`launcher` starting `world_size` ranks on one node: its rank count set (python becomes deepspeed)."""
    name = Path(launcher[0]).name
    if name not in RANK_COUNT_OPTIONS:
        if name.startswith("python") and world_size > 1:
            return ["deepspeed", "--num_gpus", str(world_size), launcher[-1]]
        return launcher
    option = RANK_COUNT_OPTIONS[name]
    spellings = (option, option.replace("_", "-"))
    words = list(launcher)
    for i, word in enumerate(words):
        if word in spellings and i + 1 < len(words):
            words[i + 1] = str(world_size)
            return words
        if word.partition("=")[0] in spellings:
            words[i] = f"{word.partition('=')[0]}={world_size}"
            return words
    return [words[0], option, str(world_size), *words[1:]]


def relaunch_command(launcher: list[str], run_dir_override: str | None, overrides: list[str]) -> str:
    """One line to paste into a shell: the launcher words, the run directory (when this launch named none and
    `run_dir_override` is given), the options."""
    words = [shlex.quote(w) for w in launcher]
    return " ".join([*words, *([run_dir_override] if run_dir_override else []), *overrides])
