"""The import contract of docs/ARCHITECTURE.md, checked on the source: which package may import which, the
one-way order of the planning modules, no import cycle anywhere, DeepSpeed only in parallel/ (never in planning),
model/ pure PyTorch. Every import counts, wherever it stands: one placed inside a function cannot dodge the
contract. And in subprocesses: start-up, the dry run and the sweep report load no DeepSpeed, and the runtime
loads it with train.device's accelerator."""

import ast
import importlib
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.runs import TINY, cpu_env

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("model", "data", "parallel", "schema", "harness", "sweep", "hydra_plugins", "bench")
ENTRY_POINTS = ("train", "report", "generate", "export_hf", "evaluate", "prepare_data")

MAY_IMPORT = {
    "model": set(),
    "data": set(),
    "parallel": {"model"},
    "schema": {"model", "data", "parallel"},
    "harness": {"model", "data", "parallel", "schema"},
    "sweep": {"model", "data", "parallel", "schema", "harness"},
    "hydra_plugins": {"sweep"},
    "bench": {"model", "data", "parallel"},
    "train": {"harness", "schema", "sweep"},
    "report": {"sweep"},
    "generate": {"harness", "schema"},
    "export_hf": {"harness", "schema"},
    "evaluate": {"harness", "schema"},
    "prepare_data": {"data", "harness", "schema"},
}
"""Project packages each part may import (its own modules aside); tests/ may import anything."""

PLANNING = [
    {
        "parallel.planning.config",
        "parallel.planning.shapes",
        "parallel.planning.device_profile_file",
    },
    {"parallel.planning.schedules"},  # step 1's schedules, which schedule_walk.py and step_sim.py walk
    {
        "parallel.planning.stage_plan",
        "parallel.planning.partition",
        "parallel.planning.schedule_walk",
        "parallel.planning.step_sim",
        "parallel.planning.virtual_program",  # v chunks per rank: placements, instructions, programmes, slots
    },
    {"parallel.planning.virtual_schedules"},  # the programmes of interleaved 1F1B, ZB-V and V-Half, laid out in slots
    {"parallel.planning.virtual_support"},  # what their multi-rank runtime runs so far, which resumes keep placement
    {"parallel.planning.compression"},  # compressed stashes: the bytes a stored segment input keeps, the lossy note
    {"parallel.planning.given_plan"},  # +recompute=plan: a plan.json's stage boundaries and plans, read once
    {
        "parallel.planning.memory_model",
        "parallel.planning.flops",
        "parallel.planning.model_states",
        "parallel.planning.virtual_walk",
        "parallel.planning.virtual_sim",
    },
    {"parallel.planning.weight_grad_bytes"},  # what a split backward holds from B to W, and a W's transient
    {"parallel.planning.working_set"},  # the backward's working set, from memory_model's kept items
    {"parallel.planning.virtual_memory"},  # each rank's peak under a virtual-stage schedule, working sets inside
    # what a stage holds, and the one record of what each block option keeps and costs
    {"parallel.planning.stage_bytes", "parallel.planning.block_prices"},
    {"parallel.planning.auto_recompute"},
    {"parallel.planning.curve_seconds"},  # a device profile priced into a block's costs, by each architecture's op list
    {"parallel.planning.instruction_seconds"},
    {"parallel.planning.stage_price"},  # the one function that prices a stage: memory, seconds, FLOPs
    {"parallel.planning.virtual_slots"},  # the slots a virtual-stage programme is laid out in, from measured prices
    {"parallel.planning.stage_planner"},
    {"parallel.planning.chunk_candidates"},  # a chunk's plans under auto per chunk, and what each keeps and works
    {
        "parallel.planning.balanced_search",
        "parallel.planning.schedule_choice",
        "parallel.planning.budget_refusal",
        "parallel.planning.virtual_auto",  # auto per chunk: a rank's chunks planned together against its budget
    },
    {"parallel.planning.considered_plans"},  # the whole-run plans auto weighed, ranked by simulated step
    # what each rank of a virtual-stage schedule is planned to hold, and a run's simulated step, as records
    {"parallel.planning.virtual_plan", "parallel.planning.step_time_record"},
    {"parallel.planning.layout", "parallel.planning.plan_record"},
    {"parallel.planning.virtual_choice"},  # the virtual-stage schedules priced on a layout's ranks, for the dry run
    {"parallel.planning.virtual_layout"},  # a run under one: its virtual stages, each rank's peak and step
    {"parallel.planning.run_plan"},
    {"parallel.planning.plan_verdict"},  # the dry run's verdict: each change it weighs planned again
]
"""Planning flows one way: shapes, then bytes / FLOPs / schedule, then per-stage costs, then auto, then the
step-time model, then the layout and the plan. A planning module imports only from steps before its own."""

PARALLEL_MAY_IMPORT = {
    "parallel.planning": set(),
    "parallel.runtime": {"parallel.planning"},
    "parallel.measurement": {"parallel.planning", "parallel.runtime"},
}
"""Inside parallel/: planning <- runtime <- measurement (each may also import its own modules and model/)."""


def project_modules() -> dict[str, Path]:
    modules = {name: REPO / f"{name}.py" for name in ENTRY_POINTS}
    for package in PACKAGES:
        for path in (REPO / package).rglob("*.py"):
            parts = path.relative_to(REPO).with_suffix("").parts
            modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def imports_of(path: Path, modules: dict[str, Path]) -> tuple[set[str], set[str]]:
    """(project modules, top-level names of everything else) that `path` imports anywhere in it."""
    project, external = set(), set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            # `from harness import faults` imports the module harness.faults; `from model import GPT`, the package.
            names = [
                f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules else node.module for a in node.names
            ]
        else:
            continue
        for name in names:
            (project if name in modules else external).add(name if name in modules else name.split(".")[0])
    return project, external


MODULES = project_modules()
GRAPH = {name: imports_of(path, MODULES) for name, path in MODULES.items()}


def part_of(module: str) -> str:
    return module.split(".")[0]


def test_packages_import_only_what_the_contract_allows():
    wrong = [
        f"{module} imports {target}"
        for module, (project, _) in GRAPH.items()
        for target in sorted(project)
        if part_of(target) != part_of(module) and part_of(target) not in MAY_IMPORT[part_of(module)]
    ]
    assert not wrong, "imports against docs/ARCHITECTURE.md's contract:\n" + "\n".join(wrong)


def test_hugging_face_interop_lives_in_model_hf_and_harness_hf():
    """The mappings are model/hf/'s (they import the model; the rest of model/ never imports them), the files
    harness/hf/'s (the only modules that import safetensors; the rest of harness/ reaches the mappings through
    them), so adding a family touches model/hf/ alone."""
    wrong = []
    for module, (project, external) in GRAPH.items():
        uses_mappings = any(target.startswith("model.hf") for target in project)
        if (
            part_of(module) in ("model", "harness")
            and uses_mappings
            and not module.startswith(("model.hf", "harness.hf"))
        ):
            wrong.append(f"{module} imports model/hf/ (only model/hf/ and harness/hf/ may)")
        if "safetensors" in external and not module.startswith("harness.hf"):
            wrong.append(f"{module} imports safetensors (only harness/hf/ may)")
    assert not wrong, "\n".join(wrong)


def test_each_family_is_one_module_of_model_hf_registered_once():
    """Every HFFamily a model/hf/ module builds is in format.FAMILIES, each model.arch has exactly one, and every
    model.hf_model_type a config accepts is some family's."""
    from model import ARCHITECTURES
    from model.config import HF_MODEL_TYPES
    from model.hf.family import HFFamily
    from model.hf.format import FAMILIES, FAMILY_OF_TYPE

    built = [
        value
        for module in MODULES
        if module.startswith("model.hf.")
        for value in vars(importlib.import_module(module)).values()
        if isinstance(value, HFFamily)
    ]
    assert set(built) == set(FAMILIES) and len(FAMILIES) == len(set(FAMILIES))
    assert sorted(family.arch for family in FAMILIES) == sorted(ARCHITECTURES)
    assert {model_type for types in HF_MODEL_TYPES.values() for model_type in types} <= set(FAMILY_OF_TYPE)


def test_planning_modules_import_only_earlier_steps():
    step = {module: i for i, modules in enumerate(PLANNING) for module in modules}
    assert set(step) <= set(MODULES), f"PLANNING names modules that do not exist: {set(step) - set(MODULES)}"
    wrong = [
        f"{module} (step {step[module]}) imports {target}"
        for module in step
        for target in sorted(GRAPH[module][0])
        if part_of(target) == "parallel" and (target not in step or step[target] >= step[module])
    ]
    assert not wrong, "planning must flow one way:\n" + "\n".join(wrong)


def test_there_is_no_import_cycle():
    """Tarjan's strongly connected components over the module graph: any component of two or more modules
    (or a module importing itself) is a cycle."""
    index, low, stack, on_stack, cycles = {}, {}, [], set(), []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        on_stack.add(module)
        for target in GRAPH[module][0]:
            if target not in index:
                visit(target)
                low[module] = min(low[module], low[target])
            elif target in on_stack:
                low[module] = min(low[module], index[target])
        if low[module] == index[module]:
            component = []
            while not component or component[-1] != module:
                component.append(stack.pop())
                on_stack.discard(component[-1])
            if len(component) > 1 or module in GRAPH[module][0]:
                cycles.append(sorted(component))

    for module in sorted(GRAPH):
        if module not in index:
            visit(module)
    assert not cycles, f"import cycles: {cycles}"


def subpackage_of(module: str) -> str:
    return ".".join(module.split(".")[:2])


def test_parallel_subpackages_import_one_way():
    wrong = [
        f"{module} imports {target}"
        for module, (project, _) in GRAPH.items()
        if subpackage_of(module) in PARALLEL_MAY_IMPORT
        for target in sorted(project)
        if part_of(target) == "parallel"
        and subpackage_of(target) != subpackage_of(module)
        and subpackage_of(target) not in PARALLEL_MAY_IMPORT[subpackage_of(module)]
    ]
    assert not wrong, "parallel/ must flow planning <- runtime <- measurement:\n" + "\n".join(wrong)


def test_planning_imports_neither_deepspeed_nor_torch_distributed():
    """On the source, every import anywhere in a module: `import torch` itself loads torch.distributed, so only
    the source can tell what planning asks for."""
    wrong = []
    for module, path in MODULES.items():
        if subpackage_of(module) != "parallel.planning":
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            wrong += [f"{module} imports {n}" for n in names if n.split(".")[0] == "deepspeed"]
            wrong += [f"{module} imports {n}" for n in names if n.startswith("torch.distributed")]
    assert not wrong, "planning must stay free of DeepSpeed and torch.distributed:\n" + "\n".join(wrong)


PLAIN_DEEPSPEED_PEER = "bench.peers_deepspeed"
"""bench/pipeline_peers.py's plain DeepSpeed pipeline: a user's DeepSpeed code written apart from stagecheck, which
stagecheck is measured against, so it imports DeepSpeed itself."""


def test_only_parallel_imports_deepspeed():
    users = sorted(
        m
        for m, (_, external) in GRAPH.items()
        if "deepspeed" in external and part_of(m) != "parallel" and m != PLAIN_DEEPSPEED_PEER
    )
    assert not users, f"only parallel/ may import deepspeed: {users}"


@pytest.mark.parametrize("package", ["model", "data"])
def test_leaf_packages_import_only_the_standard_library_torch_numpy_and_their_own_libraries(package):
    # data/ also tokenizes text with the Hugging Face tokenizers library (a Rust extension with no dependencies), and
    # prepare_data.py's corpora come through it: Parquet (pyarrow), saved datasets (datasets), a progress bar (tqdm).
    data_libraries = {"tokenizers", "pyarrow", "datasets", "tqdm"}
    allowed = set(sys.stdlib_module_names) | {"torch", "numpy"} | (data_libraries if package == "data" else set())
    foreign = {
        m: sorted(external - allowed)
        for m, (_, external) in GRAPH.items()
        if part_of(m) == package and external - allowed
    }
    assert not foreign, f"{package}/ must stay free of other libraries: {foreign}"


def test_every_package_says_what_it_does():
    # hydra_plugins is a namespace package (Hydra scans it for launchers): it has no __init__.py by design.
    undocumented = [
        p
        for p in PACKAGES
        if p != "hydra_plugins" and not ast.get_docstring(ast.parse((REPO / p / "__init__.py").read_text()))
    ]
    assert not undocumented, f"packages whose __init__.py has no docstring: {undocumented}"


def test_start_up_loads_no_deepspeed_until_use_accelerator_chooses_train_devices():
    """DeepSpeed settles its accelerator when it is first loaded. What train.py and Hydra's sweep callback import
    (start-up, the dry run, the report, all of planning) loads none of it; `use_accelerator` then loads it with
    train.device's accelerator, over a DS_ACCELERATOR left in the environment and over what DeepSpeed would detect
    (no GPU here: it would say cpu), and refuses another device once one is settled."""
    code = textwrap.dedent(
        """
        import sys
        import harness.startup, harness.run_dir, schema, sweep.job, sweep.callback, parallel.planning.run_plan
        assert not [m for m in sys.modules if m.split(".")[0] == "deepspeed"]
        from parallel.runtime.accelerator import settled_accelerator, use_accelerator
        assert settled_accelerator() is None
        use_accelerator("cuda")
        from deepspeed.accelerator import get_accelerator
        assert get_accelerator().device_name() == settled_accelerator() == "cuda"
        use_accelerator("cuda")  # the next job of a sweep, on the same device
        try:
            use_accelerator("cpu")
        except ValueError as error:
            print(error)
        """
    )
    env = {**os.environ, "DS_ACCELERATOR": "cpu"}
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, check=True)
    assert out.stdout.startswith("train.device='cpu', but DeepSpeed already runs on its 'cuda' accelerator"), out


def deepspeed_loaded_by(command: list[str], tmp_path: Path) -> list[str]:
    """Run `command` (it must succeed) under PYTHONPROFILEIMPORTTIME: the DeepSpeed modules it imported."""
    env = cpu_env(tmp_path, PYTHONPROFILEIMPORTTIME="1")
    out = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-4000:]
    imported = [line.rsplit("|", 1)[1].strip() for line in out.stderr.splitlines() if line.startswith("import time:")]
    assert "torch" in imported  # the profile is there to read
    return [name for name in imported if name.split(".")[0] == "deepspeed"]


def test_the_dry_run_and_the_sweep_report_load_no_deepspeed(tmp_path):
    run_dir = tmp_path / "plan"
    dry_run = [sys.executable, "train.py", f"hydra.run.dir={run_dir}", *TINY, "dry_run=true"]
    assert deepspeed_loaded_by(dry_run, tmp_path) == []
    assert (run_dir / "plan.json").is_file()
    sweep = shutil.copytree(REPO / "tests" / "fixtures" / "sweep_report", tmp_path / "sweep")
    assert deepspeed_loaded_by([sys.executable, "report.py", "--no-wandb", str(sweep)], tmp_path) == []
    assert (sweep / "report.md").is_file()
