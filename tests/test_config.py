"""Hydra composition exactly as train.py does it, for every shipped option, and the start-up checks."""

from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException

from harness.run_dir import register_run_stamp_resolver
from parallel.planning.config import SCHEDULE_CHOICES
from parallel.planning.virtual_program import VIRTUAL_SCHEDULES
from schema import GROUP_SCHEMAS, register_schemas
from schema.checks import to_run_config, topology

CONF = Path(__file__).resolve().parents[1] / "conf"
MODELS = sorted(p.stem for p in (CONF / "model").glob("*.yaml"))

register_schemas()
register_run_stamp_resolver()


def compose_run(*overrides: str):
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose(config_name="config", overrides=list(overrides))
    return to_run_config(cfg)


def test_every_shipped_group_option_has_a_yaml_and_a_schema():
    for group, options in GROUP_SCHEMAS.items():
        assert sorted(p.stem for p in (CONF / group).glob("*.yaml")) == sorted(options), group


@pytest.mark.parametrize("model", MODELS)
def test_every_model_preset_composes(model):
    run = compose_run(f"model={model}")
    assert run.model.n_embd % run.model.n_head == 0


def test_presets_cover_the_gpt2_gpt3_and_llama_families():
    assert set(MODELS) == {
        "tiny",
        "tiny-llama",
        "llama3.2-1b",
        "llama3-8b",
        "llama3-70b",
        "qwen2.5-0.5b",
        "qwen2.5-7b",
        "qwen3-0.6b",
        "qwen3-8b",
        "mistral-7b",
        "smollm2-135m",
        "gpt2",
        "gpt2-medium",
        "gpt2-large",
        "gpt2-xl",
        "gpt3-1.3b",
        "gpt3-2.7b",
        "gpt3-6.7b",
        "gpt3-13b",
        "gpt3-175b",
    }
    assert compose_run("model=gpt3-175b").model.n_layer == 96


@pytest.mark.parametrize("group, option", [(g, o) for g, opts in GROUP_SCHEMAS.items() for o in opts])
def test_every_group_option_composes_to_its_schema(group, option):
    prefix = "+" if group == "recompute" else ""
    extra = {"memmap": ["data.path=/tmp"], "plan": ["recompute.file=plan.json"]}.get(option, [])
    run = compose_run(f"{prefix}{group}={option}", *extra)
    assert isinstance(getattr(run, group), GROUP_SCHEMAS[group][option])


def test_recompute_is_none_when_absent_and_typed_when_added():
    assert compose_run().recompute.mode == "none"
    full = compose_run("+recompute=full", "recompute.interval=stage").recompute
    assert (full.mode, full.interval) == ("full", "stage")
    selective = compose_run("+recompute=selective", "recompute.modules=[core_attn,mlp]").recompute
    assert selective.modules == ["core_attn", "mlp"]


@pytest.mark.parametrize(
    "overrides",
    [
        ["train.stepz=3"],  # typo: not in the schema
        ["train.steps=many"],  # wrong type
        ["+recompute=full", "recompute.modules=[mlp]"],  # a field of another mode
    ],
)
def test_schema_rejects_typos_and_wrong_types_at_composition(overrides):
    with pytest.raises(ConfigCompositionException):
        compose_run(*overrides)


@pytest.mark.parametrize(
    "world, overrides, message",
    [
        (2, ["parallel.pipeline_stages=3"], "parallel.pipeline_stages=3 does not divide the world size 2"),
        (8, ["parallel.pipeline_stages=8"], "parallel.pipeline_stages=8 exceeds model.n_layer=4"),
    ],
)
def test_topology_checks(world, overrides, message):
    with pytest.raises(ValueError, match=message):
        topology(compose_run(*overrides), world)


@pytest.mark.parametrize("schedule", VIRTUAL_SCHEDULES)
def test_virtual_stage_schedules_are_named_and_composed(schedule):
    """train.py runs them (tests/test_train_runs.py); what their engine does not run is refused at start-up
    (tests/test_virtual_layout.py)."""
    assert schedule in SCHEDULE_CHOICES
    assert compose_run(f"parallel.schedule={schedule}").parallel.schedule == schedule


def test_default_topology_is_one_stage_per_rank():
    topo = topology(compose_run(), 4)
    assert (topo.pipeline_stages, topo.data_parallel_size) == (4, 1)
    topo = topology(compose_run("parallel.pipeline_stages=2"), 4)
    assert (topo.pipeline_stages, topo.data_parallel_size) == (2, 2)
