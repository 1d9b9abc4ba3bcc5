"""How `make test` shares its tests between two pytest-xdist workers: whole groups of tests, each on one worker.

Each worker is a pytest session of its own, so a session's shared launch (tests/shared_runs.py) or the Slurm cluster
(tests/slurm_cluster.py) would start once on every worker that asked for it. So the modules that read the train.py
cases of the shared launches run in one group, those that read the engine-level runs in another, and those that use
the Slurm cluster in a third; every other module is a group of its own (its module-scoped fixtures start once). The
three launch groups start first: they are the longest, and mostly wait (on their launches' start-up, and on each
other's ranks), while the other worker fills those waits with in-process tests. The other modules that take long come
next, longest first, so that neither worker ends the suite on a long module while the other has finished (pytest-xdist
would order them by their number of tests: the 80 s peer benchmark, 3 tests, came last, alone for its last 70 s).

A module's group is read from its source (the fixtures its functions take), since the process that schedules never
imports the tests. (pytest-xdist 3.8's own `--dist loadgroup` marks reach no scheduler under pytest 9.2: it rewrites
`item._nodeid`, which pytest 9.2's node ids no longer read.)
"""

import ast
from functools import cache
from pathlib import Path

from xdist.scheduler import LoadScopeScheduling

CASE_LAUNCHES, ENGINE_LAUNCHES, SLURM = "case-launches", "engine-launches", "slurm"
FIRST = (CASE_LAUNCHES, SLURM, ENGINE_LAUNCHES)
LONG_SECONDS = {
    "tests/test_checkpoint_resume.py": 129,
    "tests/test_sweeps.py": 127,
    "tests/test_faults.py": 96,
    "tests/test_pipeline_peers.py": 79,
    "tests/test_eval.py": 59,
    "tests/test_prepare_data.py": 46,
    "tests/test_bad_input.py": 45,
    "tests/test_device_profile.py": 36,
    "tests/test_llama_planner.py": 32,
}
"""Modules that take over half a minute in `make test` (seconds, measured at 9950079 on 2 loaded cores)."""
CASE_FIXTURES = {"case_runs", "shared_runs"}


@cache
def module_group(path: Path) -> str:
    """The group of the test module at `path`: a launch group, or the module's own path. A module reads a launch
    when one of its tests or fixtures takes that launch's fixture (tests/conftest.py), as the shared launches find
    the modules whose runs they start (tests/shared_runs.py)."""
    tree = ast.parse(path.read_text(), str(path))
    arguments = {
        argument.arg for node in ast.walk(tree) if isinstance(node, ast.FunctionDef) for argument in node.args.args
    }
    if arguments >= {"engine_runs"} and arguments & CASE_FIXTURES:
        # Either group's worker would then start the other launch too.
        raise ValueError(f"{path} reads both the engine runs and the train.py cases: give each its own test module")
    if "slurm_cluster" in arguments:
        return SLURM
    if arguments & CASE_FIXTURES:
        return CASE_LAUNCHES
    if "engine_runs" in arguments:
        return ENGINE_LAUNCHES
    return str(path)


class LaunchGroupScheduling(LoadScopeScheduling):
    """pytest-xdist's scope scheduling, its scope a test module's group, the launch groups handed out first, then the
    long modules."""

    def __init__(self, config, log=None):
        super().__init__(config, log)
        self.root = config.rootpath
        gone = [module for module in LONG_SECONDS if not (self.root / module).is_file()]
        if gone:
            raise ValueError(f"tests/xdist_groups.py LONG_SECONDS names modules that do not exist: {gone}")

    def _split_scope(self, nodeid: str) -> str:
        return module_group(self.root / nodeid.split("::", 1)[0])

    def _assign_work_unit(self, node) -> None:
        long_modules = [str(self.root / module) for module in sorted(LONG_SECONDS, key=LONG_SECONDS.get)]
        for group in [*long_modules, *reversed(FIRST)]:  # each to the front: the last moved comes first
            if group in self.workqueue:
                self.workqueue.move_to_end(group, last=False)
        super()._assign_work_unit(node)
