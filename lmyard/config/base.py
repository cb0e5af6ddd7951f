"""The base of every config section, and helpers every section shares (names, URIs, digests)."""

from __future__ import annotations

import hashlib
import json
import re
import types
import typing
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationInfo, field_validator

# The run name becomes a folder name in the store (255 bytes at most on ext4, xfs, APFS), a part of staging
# and checkpoint folder names with suffixes of their own, and the MLflow run's and registered model's name.
RUN_NAME_MAX = 100


def _numeric(annotation: Any) -> bool:
    """Whether a field's type takes numbers (int, float, optionally with None or literals) and not booleans."""
    args = (
        typing.get_args(annotation)
        if typing.get_origin(annotation) in (typing.Union, types.UnionType)
        else (annotation,)
    )
    return bool(set(args) & {int, float}) and bool not in args


class _Section(BaseModel):
    """A config section: unknown keys are refused, and so are booleans for numbers (`max_steps: true`
    would otherwise pass as 1) and non-finite floats (`lr: .inf` would pass every bound check, then be
    dumped to JSON as null)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)

    @field_validator("*", mode="before")
    @classmethod
    def _no_bool_for_numbers(cls, v: Any, info: ValidationInfo) -> Any:
        assert info.field_name is not None  # a validator of fields ("*") always has its field
        if isinstance(v, bool) and _numeric(cls.model_fields[info.field_name].annotation):
            raise ValueError(f"expected a number, not the boolean {str(v).lower()}")
        return v


_USERINFO = re.compile(r"(\w[\w+.-]*://[^/\s:@]+):[^/\s]*@")


def redact_uri(uri: str) -> str:
    """`uri` without the password of its `user:password@` part (`http://me:s3cret@host` -> `http://me:***@host`);
    any URI inside a longer text (an error message) too; other strings as they are."""
    return _USERINFO.sub(r"\1:***@", uri)


def digest(obj: Any, n: int = 16) -> str:
    """A short, stable content hash of JSON-able data."""
    blob = json.dumps(obj, sort_keys=True, separators=(",", ":"), default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:n]
