"""An evaluation as a spec (after lmyard.models.spec): what it runs on a checkpoint, what it logs, what it gates.

Design notes: docs/export.md, `lmyard/evaluate/spec.py`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from lmyard.checkpoint.state import Checkpoint
    from lmyard.config import EvalConfig, RunConfig
    from lmyard.data.shards import ShardSet
    from lmyard.models.base import LanguageModel


@dataclass(frozen=True)
class Context:
    """One checkpoint as every evaluation sees it: the run's config, the model on its device, the checkpoint
    (state and URI), the shard set and the local cache folder."""

    cfg: RunConfig
    model: LanguageModel
    checkpoint: Checkpoint
    shards: ShardSet
    device: str
    cache: str


def _always(_: EvalConfig) -> bool:
    return True


def _no_fields(_: Any) -> dict[str, Any]:
    return {}


@dataclass(frozen=True)
class EvaluationSpec:
    name: str
    run: Callable[[Context], Any]
    metrics: Callable[[Any], dict[str, float]]
    enabled: Callable[[EvalConfig], bool] = _always
    fields: Callable[[Any], dict[str, Any]] = _no_fields
    gates: Mapping[str, str] = field(default_factory=dict)
