"""Shared launches: the multi-process runs of a whole test session in ONE launch per kind and world size.

A launch costs its start-up (the launcher and every rank import torch and DeepSpeed: about 10 CPU seconds for 2
ranks) before it trains anything, and most tests read runs of a few steps. So a test module names the runs it reads,
and the session starts each kind of launch once, for every collected module that needs it (peers do the same:
DeepSpeed's unit tests reuse one process pool per world size):

- `CASES = {name: Case(...)}`: real `train.py` runs, as a user types them. All cases of one world size run as the
  jobs of ONE Hydra multirun (`deepspeed --num_gpus N train.py -m +case=a,b,...`): each case is an overlay config
  written here from its overrides, each job builds a fresh engine in the same ranks (sweep/callback.py) and writes
  what a single run writes, into <sweep dir>/<module>-<case>. Read them with the `case_runs` fixture.
- `ENGINE_RUNS = {name: EngineRun(...)}`: engine-level fixtures (tests/fixtures/<module>.py, a `run(**args)` per
  rank). All of one world size run in turn in ONE launch of tests/fixtures/engine_runs.py, in one process group.
  Read them with the `engine_runs` fixture.

Running one test file launches only that module's runs; the whole suite launches each kind once per world size.
"""

import json
import subprocess
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from omegaconf import OmegaConf

from tests.runs import REPO, cpu_env, launch_multirun, launch_script

CONF_GROUPS = frozenset(p.name for p in (REPO / "conf").iterdir() if p.is_dir())
SHARED_MEMORY = Path("/dev/shm")
ENGINE_DRIVER = REPO / "tests" / "fixtures" / "engine_runs.py"


@dataclass(frozen=True)
class Case:
    """One train.py run: its overrides (as on the command line), its world size, and files (text or bytes) to write
    first into the case's scratch directory, which `{scratch}` in an override names. `{runs}` names the directory
    that holds every case's run directory (<module>-<case>): a case may resume from an earlier case's checkpoint."""

    overrides: tuple[str, ...]
    nproc: int = 2
    files: Mapping[str, str | bytes] = field(default_factory=dict)
    # Called with the scratch directory after `files` are written, before the launch: writes what a file's
    # content given here cannot (a corpus prepared into token files).
    setup: Callable[[Path], None] | None = None


def case(
    *overrides: str,
    nproc: int = 2,
    files: Mapping[str, str | bytes] | None = None,
    setup: Callable[[Path], None] | None = None,
) -> Case:
    return Case(tuple(overrides), nproc, dict(files or {}), setup)


@dataclass(frozen=True)
class EngineRun:
    """`tests/fixtures/<module>.py`'s run(**args) on `nproc` ranks; its result is the list of every rank's."""

    module: str
    args: Mapping
    nproc: int = 2


def case_config(overrides: tuple[str, ...]) -> str:
    """An overlay config (`# @package _global_`) that composes as `overrides` on the command line would: a config
    group (`data=synthetic`) overrides the default, `+group=option` adds one, `key=value` sets a value."""
    added, replaced, values = [], [], []
    for override in overrides:
        key, _, value = override.partition("=")
        if key.startswith("+"):
            added.append(f"  - /{key[1:]}: {value}")
        elif key in CONF_GROUPS:
            replaced.append(f"  - override /{key}: {value}")
        else:
            values.append(override)
    defaults = ["defaults:", *added, *replaced] if added or replaced else []  # Hydra: overrides come last
    body = OmegaConf.to_yaml(OmegaConf.from_dotlist(values)) if values else ""
    return "\n".join(["# @package _global_", *defaults, body])


@dataclass
class Launch:
    """What one shared launch did: its process, and what it left in /dev/shm and in its own (empty at start)
    torch extensions directory."""

    result: subprocess.CompletedProcess
    shared_memory_added: set[Path]
    extensions: Path


class SharedRuns:
    """Every collected module's CASES and ENGINE_RUNS; each kind and world size launched once, when first read."""

    def __init__(self, modules, root: Path):
        self.root = root
        self.cases = {(m.__name__, n): c for m in modules for n, c in getattr(m, "CASES", {}).items()}
        self.engines = {(m.__name__, n): e for m in modules for n, e in getattr(m, "ENGINE_RUNS", {}).items()}
        self.launches: dict[tuple[str, int], Launch] = {}

    def case_runs(self, module: str) -> dict[str, Path]:
        """name -> run directory of each of `module`'s cases; a case that did not finish fails the reader."""
        mine = {name: c for (m, name), c in self.cases.items() if m == module}
        for nproc in sorted({c.nproc for c in mine.values()}):
            self._launch_cases(nproc)
        runs = {name: self._case_dir(module, name) for name in mine}
        for name, run_dir in runs.items():
            if not (run_dir / "summary.json").exists():
                launch = self.launches[("cases", mine[name].nproc)]
                failed = (run_dir / "FAILED").read_text() if (run_dir / "FAILED").exists() else ""
                raise AssertionError(
                    f"case {name} of {module} did not finish ({run_dir})\n{failed}\nSTDOUT:\n"
                    f"{launch.result.stdout[-4000:]}\nSTDERR:\n{launch.result.stderr[-6000:]}"
                )
        return runs

    def engine_runs(self, module: str) -> dict[str, list]:
        """name -> every rank's result of each of `module`'s engine runs."""
        mine = {name: e for (m, name), e in self.engines.items() if m == module}
        for nproc in sorted({e.nproc for e in mine.values()}):
            self._launch_engines(nproc)
            result = self.launch("engines", nproc).result
            assert result.returncode == 0, f"STDOUT:\n{result.stdout[-4000:]}\nSTDERR:\n{result.stderr[-6000:]}"
        return {name: json.loads(self._engine_file(module, name).read_text()) for name in mine}

    def launch(self, kind: str, nproc: int) -> Launch:
        return self.launches[(kind, nproc)]

    def case_output(self, nproc: int = 2) -> str:
        """What the cases' launch of `nproc` ranks printed (every job's lines, in job order)."""
        result = self.launch("cases", nproc).result
        return result.stdout + result.stderr

    def _case_dir(self, module: str, name: str) -> Path:
        nproc = self.cases[(module, name)].nproc
        return self.root / f"cases-{nproc}" / "sweep" / _job_name(module, name)

    def _engine_file(self, module: str, name: str) -> Path:
        return self.root / f"engines-{self.engines[(module, name)].nproc}" / f"{_job_name(module, name)}.json"

    def _launch_cases(self, nproc: int) -> None:
        if ("cases", nproc) in self.launches:
            return
        scratch = self.root / f"cases-{nproc}"
        conf = scratch / "conf" / "case"
        conf.mkdir(parents=True)
        names = []
        for (module, name), c in self.cases.items():
            if c.nproc != nproc:
                continue
            job = _job_name(module, name)
            files = scratch / "files" / job
            files.mkdir(parents=True)
            for file_name, content in c.files.items():
                if isinstance(content, bytes):
                    (files / file_name).write_bytes(content)
                else:
                    (files / file_name).write_text(content, encoding="utf-8")
            if c.setup is not None:
                c.setup(files)
            overrides = tuple(
                o.replace("{scratch}", str(files)).replace("{runs}", str(scratch / "sweep")) for o in c.overrides
            )
            (conf / f"{job}.yaml").write_text(case_config(overrides))
            names.append(job)
        self.launches[("cases", nproc)] = self._run(
            scratch,
            lambda env: launch_multirun(
                scratch / "sweep",
                f"hydra.searchpath=[file://{scratch / 'conf'}]",
                "hydra.sweep.subdir=${hydra:runtime.choices.case}",  # the job's directory is its case's name
                f"+case={','.join(names)}",
                nproc=nproc,
                timeout=1800,
                check=False,
                env=env,
            ),
        )

    def _launch_engines(self, nproc: int) -> None:
        if ("engines", nproc) in self.launches:
            return
        scratch = self.root / f"engines-{nproc}"
        scratch.mkdir(parents=True)
        spec = {
            _job_name(module, name): {"module": e.module, "args": dict(e.args)}
            for (module, name), e in self.engines.items()
            if e.nproc == nproc
        }
        self.launches[("engines", nproc)] = self._run(
            scratch,
            lambda env: launch_script(
                ENGINE_DRIVER, str(scratch), json.dumps(spec), nproc=nproc, env=env, timeout=1800, check=False
            ),
            PYTHONPATH=str(REPO),  # the fixtures import the repository's packages from tests/fixtures/
        )

    @staticmethod
    def _run(scratch: Path, start, **extra_env: str) -> Launch:
        extensions = scratch / "torch_extensions"
        shared_before = set(SHARED_MEMORY.iterdir())
        env = cpu_env(scratch, TORCH_EXTENSIONS_DIR=str(extensions), **extra_env)
        env.pop("OMP_NUM_THREADS", None)  # as the deepspeed launcher leaves it: each rank takes its share
        result = start(env)
        return Launch(result, set(SHARED_MEMORY.iterdir()) - shared_before, extensions)


def _job_name(module: str, name: str) -> str:
    return f"{module.removeprefix('tests.test_')}-{name}"


def _modules_using(session, fixtures: set[str]) -> list:
    return sorted(
        {item.module for item in session.items if fixtures & set(item.fixturenames)}, key=lambda m: m.__name__
    )


def shared_runs_of(session, root: Path) -> SharedRuns:
    return SharedRuns(_modules_using(session, {"case_runs", "engine_runs", "shared_runs"}), root)
