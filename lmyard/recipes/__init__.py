"""Resolving a run's config: defaults, the environment, a recipe, `--set` overrides.

    RunConfig defaults  <  LMYARD_* environment  <  recipe (YAML)  <  --set key=value / explicit fields

Later layers win, key by key. The defaults are the `smoke` recipe (lmyard.config).
The environment holds an operator's site settings, for every run started from
that shell or worker: `LMYARD_STORE=s3://bucket/lmyard`,
`LMYARD_TRACKING__URI=http://mlflow:5000`; a nested key joins its sections with
`__` (`LMYARD_TRAIN__MAX_STEPS=50`), names are case-insensitive, a list or a
mapping is given as JSON (`LMYARD_EVAL__PROMPTS='["Once upon", "A"]'`).
pydantic-settings reads them, so they map to the same fields a recipe sets.
A recipe is the reviewed definition of one run and wins over the site; a
`--set` (or a field a deployment's `config` parameter sets) wins over both.
Other LMYARD_* variables (LMYARD_CACHE, LMYARD_SPEC, ...) name no field and are
not config. The environment applies where a config is resolved from a recipe
(`lmyard run/shard/config`, `python -m lmyard.dispatch`, a deployment's `recipe`
parameter); a RunConfig handed over whole (a flow called without a recipe, the
trainer's spec) is taken as it is, so a stage never re-reads another host's
environment into a run already resolved.

The layers are merged as plain data and validated once, so cross-field rules
(a llama field needs a llama preset) see the resolved run, and an error names
the key, and the variable when the value came from the environment.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError
from pydantic_settings import BaseSettings, EnvSettingsSource, SettingsConfigDict, SettingsError

from lmyard.config import RunConfig
from lmyard.errors import UserError

ENV_PREFIX = "LMYARD_"
ENV_NESTED = "__"
# a site's own recipes (deploy/recipes/ of the working folder) first, then the ones lmyard ships (package data)
RECIPE_DIRS = (Path.cwd() / "deploy" / "recipes", Path(__file__).resolve().parent)


class _EnvFields(BaseSettings, RunConfig):
    """RunConfig's fields as pydantic-settings sees them; only its environment source is used, never an
    instance (so the layers are validated together, once)."""

    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, env_nested_delimiter=ENV_NESTED, extra="forbid")


def env_values() -> dict[str, Any]:
    """The config fields that LMYARD_* variables of this process set, as nested raw data (strings)."""
    try:
        return EnvSettingsSource(_EnvFields)()
    except SettingsError as e:  # its message names the field, not the variable
        field = re.search(r'field "(\w+)"', str(e))
        var = f"{ENV_PREFIX}{field.group(1).upper()}{ENV_NESTED}..." if field else f"an {ENV_PREFIX}* variable"
        raise UserError(
            f"{var} is not valid: lists and mappings are given as JSON, e.g. {ENV_PREFIX}EVAL{ENV_NESTED}PROMPTS="
            """'["Once upon a time"]'"""
        ) from None


def builtin_recipes() -> list[str]:
    names = {"smoke"}
    for d in RECIPE_DIRS:
        names.update(p.stem for p in d.glob("*.yaml"))
    return sorted(names)


def _recipe_path(recipe: str) -> Path:
    path = Path(recipe)
    if not path.suffix:
        for d in RECIPE_DIRS:
            if (d / f"{recipe}.yaml").is_file():
                return d / f"{recipe}.yaml"
    if not path.is_file():
        raise UserError(
            f"unknown recipe {recipe!r}: give a built-in name ({', '.join(builtin_recipes())}) "
            "or the path of a YAML file"
        )
    return path


def _recipe_dict(recipe: str) -> dict[str, Any]:
    if recipe == "smoke":
        return {}
    path = _recipe_path(recipe)
    try:
        data = yaml.safe_load(path.read_bytes().decode("utf-8")) or {}
    except UnicodeDecodeError as e:
        raise UserError(
            f"recipe {path} is not UTF-8 text (byte {e.object[e.start]:#04x} at offset {e.start}): save it as UTF-8"
        ) from None
    except yaml.YAMLError as e:
        raise UserError(f"recipe {path} is not valid YAML: {str(e).splitlines()[0]}") from None
    if not isinstance(data, dict):
        raise UserError(f"recipe {path} must be a YAML mapping of config sections")
    return data


def apply_override(data: dict[str, Any], assignment: str) -> None:
    """Apply one `dotted.key=value` to a nested dict; the value is parsed as YAML."""
    key, sep, raw = assignment.partition("=")
    if not sep or not key.strip():
        raise UserError(f"--set {assignment!r}: expected dotted.key=value, e.g. --set train.max_steps=50")
    try:
        value = yaml.safe_load(raw) if raw.strip() else raw
    except yaml.YAMLError:
        value = raw
    parts = key.strip().split(".")
    node = data
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise UserError(f"--set {key}: {part!r} is a value, not a section")
        node = child
    node[parts[-1]] = value


def _env_name(loc: tuple[Any, ...], env: dict[str, Any]) -> str | None:
    """The variable that set the key at `loc`, when it came from the environment (else None)."""
    node: Any = env
    for part in loc:
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return ENV_PREFIX + ENV_NESTED.join(str(p) for p in loc).upper()


def format_validation_error(err: ValidationError, env: dict[str, Any] | None = None) -> str:
    msgs = []
    for e in err.errors():
        loc = ".".join(str(x) for x in e["loc"])
        var = _env_name(e["loc"], env or {})
        origin = f" (from {var})" if var else ""
        if e["type"] == "extra_forbidden":
            msgs.append(f"unknown config key {loc!r}{origin} (see the config reference: `lmyard config --reference`)")
            continue
        got = e.get("input")
        msg = e["msg"].removeprefix("Value error, ")
        if isinstance(got, (str, int, float, bool)) and e["type"] not in ("value_error",):
            msg = f"{msg}, got {got!r}"
        msgs.append(f"{loc}{origin}: {msg}" if loc else msg)
    return "invalid config: " + "; ".join(msgs)


def validate(data: dict[str, Any], env: dict[str, Any] | None = None) -> RunConfig:
    """`data` as a RunConfig, or a UserError naming every bad key (and its variable, for `env`'s keys)."""
    try:
        return RunConfig.model_validate(data)
    except ValidationError as e:
        raise UserError(format_validation_error(e, env)) from None


def _merge(base: dict[str, Any], top: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in top.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def _unset_by(data: dict[str, Any], top: dict[str, Any]) -> dict[str, Any]:
    """`data` without the keys `top` sets: what is left of the environment after the later layers."""
    out = {}
    for k, v in data.items():
        if k not in top:
            out[k] = v
        elif isinstance(v, dict) and isinstance(top[k], dict):
            out[k] = _unset_by(v, top[k])
    return out


def _over_environment(data: dict[str, Any]) -> RunConfig:
    """`data` (recipe and overrides) over the LMYARD_* environment, validated once."""
    env = env_values()
    return validate(_merge(env, data), _unset_by(env, data))


def load_recipe(recipe: str = "smoke", overrides: list[str] | tuple[str, ...] = ()) -> RunConfig:
    """A recipe by built-in name or YAML path over the LMYARD_* environment, with `dotted.key=value` overrides."""
    data = _recipe_dict(recipe)
    for assignment in overrides:
        apply_override(data, assignment)
    return _over_environment(data)


def site_config(overrides: list[str] | tuple[str, ...] = ()) -> RunConfig:
    """No recipe: the defaults, the LMYARD_* environment (a site's store and tracking URI) and overrides."""
    data: dict[str, Any] = {}
    for assignment in overrides:
        apply_override(data, assignment)
    return _over_environment(data)


def with_recipe(config: RunConfig, recipe: str | None) -> RunConfig:
    """`config` on top of a recipe (over the LMYARD_* environment): the recipe's values, then every field
    `config` sets explicitly.

    This is how a deployment points at its recipe (parameter `recipe`) while a run still overrides any
    field through `config`; with no recipe, `config` as it is.
    """
    if not recipe:
        return config
    return _over_environment(_merge(_recipe_dict(recipe), config.model_dump(mode="json", exclude_unset=True)))
