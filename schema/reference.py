"""The option reference, docs/configuration.md, rendered from the config schemas' attribute docstrings.

`python -m schema.reference` prints it; `python -m schema.reference --write` writes it.
"""

import argparse
import ast
import dataclasses
import functools
import inspect
import textwrap
import types
import typing
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from schema.run import GROUP_SCHEMAS, RunConfig
from schema.scripts import SCRIPT_SCHEMAS

ROOT = Path(__file__).resolve().parents[1]
CONF = ROOT / "conf"
PAGE = ROOT / "docs" / "configuration.md"
COMMAND = "python -m schema.reference --write"


def field_docs(schema: type) -> dict[str, str]:
    """Each field's attribute docstring (the string literal right after it), inherited fields included."""
    docs: dict[str, str] = {}
    # Bases first, so a subclass that redeclares a field documents it.
    for cls in reversed(schema.__mro__):
        if not dataclasses.is_dataclass(cls):
            continue
        body = class_node(cls).body
        for statement, following in zip(body, body[1:]):
            if (
                isinstance(statement, ast.AnnAssign)
                and isinstance(statement.target, ast.Name)
                and isinstance(following, ast.Expr)
                and isinstance(following.value, ast.Constant)
                and isinstance(following.value.value, str)
            ):
                docs[statement.target.id] = inspect.cleandoc(following.value.value)
    return docs


@functools.cache  # a source's parse, once per class: every key of every composed config asks for its class's
def class_node(cls: type) -> ast.ClassDef:
    # Dedented: a class defined inside a function (a test's) is indented.
    node = ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0]
    assert isinstance(node, ast.ClassDef), cls
    return node


def class_doc(cls: type) -> str:
    # Not cls.__doc__: dataclass fills that with the signature when the class has no docstring.
    return ast.get_docstring(class_node(cls)) or ""


def render() -> str:
    """The whole page: the top-level keys, then one section per node and group, in RunConfig's order."""
    chosen = default_options()
    docs = field_docs(RunConfig)
    parts = [
        "# Configuration reference",
        f"Generated from the config schemas' field docstrings by `{COMMAND}`: do not edit this page by"
        " hand. Edit the docstring, then run the command; `tests/test_config_reference.py` fails while"
        " the two differ.",
        "Set a key on the command line as `key=value` (a Hydra override) or in the YAML files under"
        " `conf/`. A default is what the shipped YAML sets, else the schema's default.",
    ]
    top = [f for f in dataclasses.fields(RunConfig) if f.name not in GROUP_SCHEMAS and not is_schema(f.type)]
    parts.append(section("## Top level", RunConfig, "", top, yaml_values(CONF / "config.yaml")))
    for f in dataclasses.fields(RunConfig):
        if f.name in GROUP_SCHEMAS:
            parts.append(group_section(f.name, docs.get(f.name, ""), chosen.get(f.name)))
        elif is_schema(f.type):
            parts.append(node_section(f.name, f.type, docs.get(f.name, ""), chosen.get(f.name)))
    for name, schema in SCRIPT_SCHEMAS.items():
        script = name.removesuffix("_schema")
        parts.append(section(f"## `python {script}.py`", schema, "", dataclasses.fields(schema), {}))
    return "\n\n".join(parts) + "\n"


def node_section(name: str, schema: type, doc: str, preset: str | None) -> str:
    """A node of the top-level config; one with presets (conf/<name>/*.yaml) lists them too."""
    fields = dataclasses.fields(schema)
    if preset is None:
        return section(f"## `{name}`", schema, f"{name}.", fields, yaml_values(CONF / "config.yaml", name), doc)
    text = section(
        f"## `{name}` (default `{name}={preset}`)",
        schema,
        f"{name}.",
        fields,
        yaml_values(CONF / name / f"{preset}.yaml"),
        doc,
    )
    rows = ["| preset | " + " | ".join(f.name for f in fields) + " |", "|---" * (len(fields) + 1) + "|"]
    for path in sorted((CONF / name).glob("*.yaml"), key=lambda path: path.stem):
        values = yaml_values(path)
        label = f"`{path.stem}`" + (" (default)" if path.stem == preset else "")
        rows.append(f"| {label} | " + " | ".join(literal(values.get(f.name)) for f in fields) + " |")
    return text + f"\n\nPresets (`{name}=PRESET`, conf/{name}/):\n\n" + "\n".join(rows)


def group_section(group: str, doc: str, default: str | None) -> str:
    # A group outside the defaults list is added with `+group=option`.
    prefix = "+" if default is None else ""
    options = [
        f"`{prefix}{group}={option}`" + (" (default)" if option == default else "") for option in GROUP_SCHEMAS[group]
    ]
    parts = [f"## `{group}`", doc, "Options: " + ", ".join(options) + "."]
    for option, schema in GROUP_SCHEMAS[group].items():
        parts.append(
            section(
                f"### `{prefix}{group}={option}`",
                schema,
                f"{group}.",
                dataclasses.fields(schema),
                yaml_values(CONF / group / f"{option}.yaml"),
            )
        )
    return "\n\n".join(parts)


def section(
    heading: str,
    schema: type,
    prefix: str,
    fields: typing.Iterable[dataclasses.Field],
    values: dict[str, Any],
    doc: str = "",
) -> str:
    """A heading, what the node is, where its schema lives, and one table row per field."""
    hints = typing.get_type_hints(schema)
    docs = field_docs(schema)
    rows = ["| key | type | default | meaning |", "|---|---|---|---|"]
    for f in fields:
        value = values[f.name] if f.name in values else schema_default(f)
        rows.append(
            f"| `{prefix}{f.name}` | {type_name(hints[f.name])} | `{literal(value)}` | {cell(docs.get(f.name, ''))} |"
        )
    intro = [text for text in (doc, class_doc(schema)) if text]
    return "\n\n".join([heading, *intro, f"Schema: {declared_in(schema)}.", "\n".join(rows)])


def declared_in(schema: type) -> str:
    """The schema class and the bases its fields come from, each with its file."""
    where = [
        f"`{c.__name__}` ({Path(inspect.getsourcefile(c)).relative_to(ROOT)})"
        for c in schema.__mro__
        if dataclasses.is_dataclass(c)
    ]
    return ", extending ".join(where)


def is_schema(tp: Any) -> bool:
    return isinstance(tp, type) and dataclasses.is_dataclass(tp)


def default_options() -> dict[str, str]:
    """group -> option that conf/config.yaml's defaults list chooses."""
    entries = OmegaConf.to_container(OmegaConf.load(CONF / "config.yaml"))["defaults"]
    return {k: v for e in entries if isinstance(e, dict) for k, v in e.items() if v is not None}


def yaml_values(path: Path, node: str | None = None) -> dict[str, Any]:
    """The keys a YAML file sets (under `node`, when given)."""
    values = OmegaConf.to_container(OmegaConf.load(path))
    return values if node is None else values.get(node) or {}


def schema_default(f: dataclasses.Field) -> Any:
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default


def type_name(tp: Any) -> str:
    """A field's type in YAML words: Optional[int] is "int or null", list[str] is "list of str"."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        return " or ".join("null" if a is type(None) else type_name(a) for a in args)
    if origin is list:
        return f"list of {type_name(args[0])}"
    return tp.__name__


def literal(value: Any) -> str:
    """A value as it is written in the YAML files or on the command line."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, list):
        return "[" + ", ".join(literal(v) for v in value) + "]"
    if isinstance(value, str) and not value.isprintable():  # generate.py's prompt "\n": one table row
        return '"' + value.encode("unicode_escape").decode() + '"'
    return str(value) if value != "" else '""'


def cell(text: str) -> str:
    """Text on one line of a Markdown table, its own pipes escaped."""
    return " ".join(text.split()).replace("|", "\\|")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help=f"write {PAGE.relative_to(ROOT)} instead of printing it")
    write = parser.parse_args().write
    page = render()
    if write:
        PAGE.write_text(page)
        print(f"wrote {PAGE.relative_to(ROOT)}")
    else:
        print(page, end="")


if __name__ == "__main__":
    main()
