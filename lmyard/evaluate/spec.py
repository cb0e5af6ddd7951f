"""An evaluation as a spec (after lmyard.models.spec): what it runs on a checkpoint, what it logs, what it gates.

An `EvaluationSpec` names an evaluation and holds `enabled(eval_config)` (does the run's `eval` section ask for
it), `run(context)` (one checkpoint, in the evaluator's process: its own typed result, a dataclass),
`metrics(result)` (by MLflow name, at the checkpoint's step), `rows(result)` (how it reads in a table: the Prefect
table, the log line, the run's summary, `lmyard status`; default: its metrics), `samples(result)` (text it
generated, (prompt, completion) pairs) and `gates` (`eval.gates.<key>` -> the metric it limits). `score(result)`
is its `Score` in the stage's EvalResult, under its name: all that is read after the stage, so a plug-in's
scores go wherever the built-ins' go. This module loads no torch.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from lmyard.stages import Sample, Score

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


def _no_samples(_: Any) -> list[tuple[str, str]]:
    return []


def as_text(value: float) -> str:
    """A metric as a table shows it: an integer as one, else four decimals."""
    return str(int(value)) if float(value).is_integer() else f"{value:.4f}"


@dataclass(frozen=True)
class EvaluationSpec:
    name: str
    run: Callable[[Context], Any]
    metrics: Callable[[Any], dict[str, float]]
    enabled: Callable[[EvalConfig], bool] = _always
    rows: Callable[[Any], dict[str, str]] | None = None
    samples: Callable[[Any], list[tuple[str, str]]] = _no_samples
    gates: Mapping[str, str] = field(default_factory=dict)

    def score(self, result: Any) -> Score:
        """The evaluation's part of the stage's EvalResult: its metrics, rows, samples and its whole result."""
        metrics = self.metrics(result)
        rows = self.rows(result) if self.rows else {k: as_text(v) for k, v in metrics.items()}
        samples = [Sample(prompt=p, completion=c) for p, c in self.samples(result)]
        plain = dataclasses.is_dataclass(result) and not isinstance(result, type)
        data = dataclasses.asdict(result) if plain else result
        return Score(metrics=metrics, rows=rows, samples=samples, result=data)
