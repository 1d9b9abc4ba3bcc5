"""Every config key is documented by a docstring in its schema, and docs/configuration.md is rendered from them."""

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig, OmegaConf

from harness.run_dir import register_run_stamp_resolver
from schema import GROUP_SCHEMAS, register_schemas
from schema.reference import COMMAND, PAGE, field_docs, render

CONF = Path(__file__).resolve().parents[1] / "conf"
MODELS = sorted(p.stem for p in (CONF / "model").glob("*.yaml"))
OPTIONS = [("model", m) for m in MODELS] + [(g, o) for g, opts in GROUP_SCHEMAS.items() for o in opts]
SKIPPED = ("hydra", "variant")  # Hydra's own node; a variant only sets recompute keys

register_schemas()
register_run_stamp_resolver()


def compose_config(override: str) -> DictConfig:
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose(config_name="config", overrides=[override])


def keys(node: DictConfig, prefix: str = "") -> Iterator[tuple[str, type, str]]:
    """(dotted key, schema of the node holding it, field name) for every key under `node`, nested ones included."""
    schema = OmegaConf.get_type(node)
    for name in node:
        key = prefix + str(name)
        if key in SKIPPED:
            continue
        yield key, schema, str(name)
        child = node._get_node(name)
        if isinstance(child, DictConfig):
            yield from keys(child, key + ".")


def declaring_class(schema: type, name: str) -> type:
    return next((c for c in schema.__mro__ if name in c.__dict__.get("__annotations__", {})), schema)


@pytest.mark.parametrize("group, option", OPTIONS)
def test_every_config_key_has_a_docstring(group, option):
    prefix = "+" if group == "recompute" else ""
    cfg = compose_config(f"{prefix}{group}={option}")
    missing = []
    for key, schema, name in keys(cfg):
        if not field_docs(schema).get(name, "").strip():
            owner = declaring_class(schema, name)
            missing.append(f"{key}: add a docstring after `{name}` in {owner.__name__} ({owner.__module__})")
    assert not missing, f"with {prefix}{group}={option}, keys without a docstring:\n" + "\n".join(missing)


def test_the_docstring_reader_sees_a_missing_docstring():
    @dataclass
    class Example:
        documented: int = 1
        """Has one."""
        bare: int = 2

    assert field_docs(Example) == {"documented": "Has one."}


def test_configuration_page_is_the_rendered_reference():
    assert PAGE.read_text() == render(), f"{PAGE.name} differs from the schemas' docstrings: run `{COMMAND}`"
