"""W&B sweep configurations, checked offline: the schema, the grid, and the command an agent would run.

wandb's own validation (`wandb.wandb_controller` -> `sweeps.schema_violations_from_proposed_config`) lives
in the optional `sweeps` package (`wandb[sweeps]`, which pulls in scipy and scikit-learn) and the W&B
server; neither is here. `schema_violations` checks the same JSON schema (sweeps 0.2.0,
`sweeps/config/schema.json`: top-level keys, `method`, `metric`, parameter names and the parameter forms)
for what a stagecheck sweep file may hold; `sweeps` is used as well when it is installed. The agent's
command is built with wandb's own `create_sweep_command` / `create_sweep_command_args` and the macro
expansion of `wandb_agent.Agent._command_run`.
"""

import itertools
import numbers
import re
from typing import Any

from wandb.sdk.launch.sweeps.utils import create_sweep_command, create_sweep_command_args

TOP_LEVEL = {
    "apiVersion",
    "kind",
    "controller",
    "description",
    "program",
    "entity",
    "project",
    "method",
    "command",
    "name",
    "metric",
    "early_terminate",
    "parameters",
}
METHODS = ("bayes", "random", "grid", "custom")
PARAM_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_.-]*$")
DISTRIBUTIONS = {
    "constant",
    "categorical",
    "categorical_w_probabilities",
    "int_uniform",
    "uniform",
    "q_uniform",
    "log_uniform",
    "log_uniform_values",
    "q_log_uniform",
    "q_log_uniform_values",
    "inv_log_uniform",
    "inv_log_uniform_values",
    "normal",
    "q_normal",
    "log_normal",
    "q_log_normal",
    "beta",
    "q_beta",
}
COMMAND_MACROS = {
    "env",
    "interpreter",
    "program",
    "args",
    "args_no_hyphens",
    "args_no_boolean_flags",
    "args_json",
    "args_json_file",
    "args_no_equals",
    "args_append_hydra",
    "args_override_hydra",
}


def _parameter_violations(name: str, spec: Any) -> list[str]:
    where = f"parameters.{name}"
    if not PARAM_NAME.match(name):
        return [f"{where}: the name does not match {PARAM_NAME.pattern}"]
    if not isinstance(spec, dict):
        return [f"{where}: must be an object"]
    if "parameters" in spec:  # a nested dictionary of parameters
        extra = set(spec) - {"parameters"}
        return ([f"{where}: unexpected keys {sorted(extra)}"] if extra else []) + [
            v for sub, sub_spec in spec["parameters"].items() for v in _parameter_violations(f"{name}.{sub}", sub_spec)
        ]
    distribution = spec.get("distribution")
    if distribution is not None and distribution not in DISTRIBUTIONS:
        return [f"{where}.distribution={distribution!r} is unknown"]
    if "value" in spec:
        extra = set(spec) - {"value", "distribution"}
        bad = distribution not in (None, "constant")
        return [f"{where}: a constant takes only value (and distribution: constant)"] if extra or bad else []
    if "values" in spec:
        values = spec["values"]
        if not isinstance(values, list) or not values:
            return [f"{where}.values must be a non-empty list"]
        allowed = {"values", "distribution"} | (
            {"probabilities"} if distribution == "categorical_w_probabilities" else set()
        )
        if set(spec) - allowed:
            return [f"{where}: unexpected keys {sorted(set(spec) - allowed)}"]
        if distribution not in (None, "categorical", "categorical_w_probabilities"):
            return [f"{where}: values go with distribution categorical"]
        return []
    if "min" in spec or "max" in spec:
        if not all(isinstance(spec.get(k), numbers.Number) for k in ("min", "max")):
            return [f"{where}: min and max must both be numbers"]
        return []
    if distribution in ("normal", "q_normal", "log_normal", "q_log_normal", "beta", "q_beta"):
        return []
    return [f"{where}: needs value, values, min/max or a distribution"]


def schema_violations(config: dict) -> list[str]:
    """Violations of the W&B sweep configuration schema (empty: valid)."""
    if not isinstance(config, dict):
        return ["the sweep configuration must be a mapping"]
    out = [f"unknown top-level key {k!r}" for k in sorted(set(config) - TOP_LEVEL)]
    out += [f"missing required key {k!r}" for k in ("method", "parameters") if k not in config]
    if config.get("method") not in METHODS:
        out.append(f"method={config.get('method')!r}: allowed values are {', '.join(METHODS)}")
    metric = config.get("metric")
    if metric is not None:
        if not isinstance(metric, dict) or "name" not in metric:
            out.append("metric must be an object with a name")
        else:
            out += [f"metric: unexpected key {k!r}" for k in sorted(set(metric) - {"name", "goal", "target", "impute"})]
            if metric.get("goal", "minimize") not in ("minimize", "maximize"):
                out.append(f"metric.goal={metric['goal']!r}: allowed values are minimize, maximize")
    for key in ("program", "name", "description", "project", "entity"):
        if key in config and not isinstance(config[key], str):
            out.append(f"{key} must be a string")
    if "command" in config:
        command = config["command"]
        if not isinstance(command, list):
            out.append("command must be a list")
        else:
            for chunk in command:
                text = str(chunk)
                if text.startswith("${") and text.endswith("}") and text[2:-1] not in COMMAND_MACROS:
                    out.append(f"command: unknown macro {text}")
    parameters = config.get("parameters")
    if not isinstance(parameters, dict) or not parameters:
        out.append("parameters must be a non-empty mapping")
    else:
        for name, spec in parameters.items():
            out += _parameter_violations(name, spec)
        if config.get("method") == "grid":
            out += [
                f"parameters.{name}: a grid needs value or values"
                for name, spec in parameters.items()
                if isinstance(spec, dict) and not ({"value", "values"} & set(spec))
            ]
    try:  # wandb's own validator, when wandb[sweeps] is installed
        import sweeps

        out += list(sweeps.schema_violations_from_proposed_config(config))
    except ImportError:
        pass
    return out


def grid(config: dict) -> list[dict[str, Any]]:
    """Every combination a grid sweep runs: {parameter name: value}."""
    names, choices = [], []
    for name, spec in config["parameters"].items():
        names.append(name)
        choices.append(spec["values"] if "values" in spec else [spec["value"]])
    return [dict(zip(names, combo)) for combo in itertools.product(*choices)]


def agent_command(config: dict, params: dict[str, Any]) -> list[str]:
    """The argv a W&B agent runs for one combination (wandb_agent.Agent._command_run, non-function path)."""
    command = create_sweep_command(list(config["command"]))
    sweep_vars = create_sweep_command_args({"args": {k: {"value": v} for k, v in params.items()}})
    sweep_vars.update(
        interpreter=["python"],
        program=[config["program"]],
        env=["/usr/bin/env"],
        args_json_file=["wandb/sweep-ID/config-RUN.json"],
    )
    argv: list[str] = []
    for chunk in command:
        chunk = str(chunk)
        if chunk.startswith("${") and chunk.endswith("}"):
            argv += sweep_vars.get(chunk[2:-1]) or []
        else:
            argv.append(chunk)
    return argv
