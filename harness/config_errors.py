"""Hydra's composition errors (an unknown option or key, a value of the wrong type, a group chosen twice) as one
line that names the option and its allowed values or the closest valid one, exit 2 like every other bad input.

Hydra prints these itself and exits 1, unless HYDRA_FULL_ERROR is set: then it raises them, and `config_errors`
turns them into our message. Its option lists also hold the groups' schemas (`auto_schema`, registered by
schema/run.py for the YAML options to start from), which are never a user's choice.
"""

import difflib
import os
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import fields, is_dataclass

from hydra.errors import ConfigCompositionException, HydraException, MissingConfigException, OverrideParseException
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigAttributeError, ConfigKeyError, ValidationError

from harness.faults import EXIT_CONFIG

SCHEMA_SUFFIX = "_schema"
APPEND_EXISTING = "Could not append to config. An item is already at '"
NOT_IN_DEFAULTS = "Could not override '"
TYPE_NAMES = {"Integer": "an integer", "Float": "a number", "Boolean": "true or false", "String": "a string"}


@contextmanager
def config_errors(argv: Sequence[str]) -> Iterator[None]:
    """Around the Hydra entry point: a composition error of the command line `argv` ends the process with one
    line and exit 2; anything else passes through."""
    os.environ.setdefault("HYDRA_FULL_ERROR", "1")  # Hydra raises instead of printing its own report
    try:
        yield
    except HydraException as error:
        if first_rank():  # every rank composes the same command line: one of them says what is wrong
            print(f"stagecheck: error: {describe(error, argv)}", file=sys.stderr)
        sys.exit(EXIT_CONFIG)


def first_rank() -> bool:
    """Whether this process is rank 0 (or alone), from the launcher's variables, before any are checked."""
    return os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0")) == "0"


def describe(error: HydraException, argv: Sequence[str]) -> str:
    """One line for a Hydra composition error."""
    if isinstance(error, MissingConfigException) and error.missing_cfg_file and "/" in error.missing_cfg_file:
        group, _, option = error.missing_cfg_file.rpartition("/")
        return unknown_option(group, option, error.options or [])
    cause = error.__cause__
    if isinstance(cause, ValidationError) and cause.full_key:
        text = str(cause).split("\n")[0]
        expected = "Boolean" if "valid bool" in text else text.split("converted to ")[-1].strip()
        value = text.split("'")[1] if "'" in text else ""
        return f"{cause.full_key}={value!r} is invalid: it must be {TYPE_NAMES.get(expected, expected)}"
    if isinstance(cause, ConfigAttributeError | ConfigKeyError) and cause.full_key:
        parent = cause.parent_node
        return unknown_key(cause.full_key, list(parent.keys()) if parent is not None else [])
    first = str(error).split("\n")[0]
    if isinstance(error, ConfigCompositionException) and first.startswith("Multiple values for "):
        return chosen_twice(first.removeprefix("Multiple values for ").split(".")[0], argv)
    if first.startswith(NOT_IN_DEFAULTS) and "No match in the defaults list" in first:
        return group_without_plus(first.removeprefix(NOT_IN_DEFAULTS).split("'")[0], argv)
    if first.startswith(APPEND_EXISTING):
        key = first.removeprefix(APPEND_EXISTING).split("'")[0]
        return f"+{key}=... adds an option that exists already: set it without the + ({key}=...)"
    if isinstance(error, OverrideParseException):
        bad = first.rpartition(" at input ")[2].strip("'")
        typed = next((a for a in argv if bad and bad in a), None)
        where = f"{typed!r} is not a valid override" if typed else "an override is not valid"
        return f"{where} ({first}): see https://hydra.cc/docs/1.2/advanced/override_grammar/basic"
    return first


def unknown_option(group: str, option: str, options: Sequence[str]) -> str:
    choices = [o for o in options if not o.endswith(SCHEMA_SUFFIX)]
    close = difflib.get_close_matches(option, choices, n=1)
    hint = f"did you mean {group}={close[0]}? " if close else ""
    return f"{group}={option} is unknown: {hint}allowed values are {', '.join(choices)}"


def unknown_key(full_key: str, siblings: Sequence[str]) -> str:
    """An override of a key the config does not have; `siblings`: the keys that node does have."""
    parent, _, key = full_key.rpartition(".")
    if parent == "recompute" and not siblings:
        return f"{full_key} needs a recompute mode: add +recompute=full, selective, none or auto before it"
    prefix = f"{parent}." if parent else ""
    close = difflib.get_close_matches(key, siblings, n=1)
    if close:
        return f"{full_key} is not an option: did you mean {prefix}{close[0]}?"
    where = f"of {parent}" if parent else "at the top level"
    return f"{full_key} is not an option: the options {where} are {', '.join(prefix + s for s in siblings)}"


def group_without_plus(group: str, argv: Sequence[str]) -> str:
    """`recompute=auto`: a group that the defaults list leaves out (recompute) is added with `+`."""
    typed = next((a for a in argv if a.partition("=")[0] == group), f"{group}=...")
    return f"{typed} chooses a group that is absent by default: did you mean +{typed}?"


def chosen_twice(group: str, argv: Sequence[str]) -> str:
    """A group chosen on the command line that a chosen preset (`variant=...`) already sets."""
    choosing = [a for a in argv if a.lstrip("+~").partition("=")[0] in (group, "variant")]
    if len(choosing) >= 2:
        return f"{' and '.join(choosing)} both choose {group}: keep one of them"
    return f"{group} is chosen twice (on the command line and by a config it loads): keep one choice"


def unknown_added_keys(node, path: str = "") -> list[str]:
    """Keys a `+key=value` override added to a typed node (OmegaConf lets `+` bypass the schema, and the typed
    config then drops them unread): every such key, each with the closest real option."""
    found = []
    schema = OmegaConf.get_type(node)
    known = [f.name for f in fields(schema)] if schema is not None and is_dataclass(schema) else None
    for key in node.keys():
        full = f"{path}.{key}" if path else str(key)
        if known is not None and key not in known:
            found.append(unknown_key(full, known))
        elif isinstance(node._get_node(key), DictConfig):
            found.extend(unknown_added_keys(node[key], full))
    return found
