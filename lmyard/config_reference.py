"""The config reference (docs/config.md), generated from lmyard.config's model: key, type, default, meaning.

    lmyard config --reference > docs/config.md

tests/unit/config/test_config_errors.py fails when the committed page differs from what
this writes, so a field's description is its one documentation.
"""

from __future__ import annotations

import json
import typing
from typing import Any, Literal

from pydantic import BaseModel

from lmyard.config import RunConfig

_INTRO = [
    "# Config reference",
    "",
    "Generated from `lmyard/config/` (one module a section) by `lmyard config --reference`; the defaults are the `smoke` recipe.",
    "Set any key in a recipe YAML, with `--set key=value`, or in the environment as `LMYARD_` + the key",
    "upper-cased, sections joined by `__` (`LMYARD_STORE`, `LMYARD_TRAIN__MAX_STEPS`, `LMYARD_TRACKING__URI`;",
    "lists and mappings as JSON). Later wins, key by key:",
    "",
    "    defaults (below)  <  LMYARD_* environment  <  recipe  <  --set (a deployment's `config` fields)",
    "",
    "The environment holds site settings (the store, the tracking server) for every run started there;",
    "a recipe is the definition of one run and wins over it. Numbers must be finite (`.inf`, `.nan` are",
    "refused); `run_name` names a store folder and the MLflow run, so it is at most 100 characters.",
    "",
]


def _type_name(ann: Any) -> str:
    args = typing.get_args(ann)
    if typing.get_origin(ann) is Literal:
        return " \\| ".join(f"`{a}`" for a in args)
    if typing.get_origin(ann) is list:
        return f"list[{_type_name(args[0])}]"
    if args:
        return " \\| ".join(_type_name(a) for a in args)
    return "null" if ann is type(None) else getattr(ann, "__name__", str(ann))


def _section(lines: list[str], model: type[BaseModel], prefix: str, instance: BaseModel) -> None:
    """The table of one section's keys, then one per subsection."""
    rows = []
    for name, field in model.model_fields.items():
        value = getattr(instance, name)
        if isinstance(value, BaseModel):
            _section(lines, type(value), f"{prefix}{name}.", value)
            continue
        default = json.dumps(value) if not isinstance(value, str) else f"`{value}`"
        rows.append(
            f"| `{prefix}{name}` | {_type_name(field.annotation)} | {default} | "
            f"{(field.description or '').replace('|', '/')} |"
        )
    if rows:
        title = f"## {prefix.rstrip('.') or 'run'}"
        lines.extend([title, "", "| key | type | default | meaning |", "| --- | --- | --- | --- |", *rows, ""])


def reference_markdown() -> str:
    """The config reference (docs/config.md): every key with its type, default and meaning."""
    lines = list(_INTRO)
    _section(lines, RunConfig, "", RunConfig())
    return "\n".join(lines)
