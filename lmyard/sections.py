"""The base of every config section: below the config and the backend table (lmyard.backends), whose modules
declare their own sections."""

from __future__ import annotations

import types
import typing
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationInfo, field_validator


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
