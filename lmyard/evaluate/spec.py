"""An evaluation as a spec (after lmyard.models.spec): what it runs on a checkpoint, what it logs, what it gates.

An `EvaluationSpec` names an evaluation and holds:

- `enabled(eval_config)`: whether a run's `eval` section asks for it (its config keys live there);
- `run(context)`: the evaluation of one checkpoint, in the evaluator's process (torch is there), returning the
  evaluation's own typed result (a dataclass);
- `metrics(result)`: its metrics at the checkpoint's step, by their MLflow names (`loss/eval`, `eval/...`);
- `fields(result)`: what it fills of the stage's `EvalResult` besides its metrics (the built-ins' typed fields);
- `gates`: `eval.gates.<key>` -> the metric that gate limits (`_max`: at most, `_min`: at least).

This module loads no torch: the flow's process reads the specs' metric names and gates.
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
