"""What stages write back into their exchange folder: progress, what training resumed from, results, failures.

exchange/started.json       Started            training's rank 0, once resumed (what it actually loaded)
exchange/progress.json      Progress           training's rank 0, replaced at every log step
                            ShardProgress      tokenize-and-shard, replaced as it goes
exchange/result.json        the spec's result  last: ShardResult, TrainResult, EvalResult, ExportResult,
                                               or the StageError of a failure (exit_code != 0)
"""

from __future__ import annotations

import time
from typing import Any

from pydantic import ConfigDict, Field

from lmyard.data.shardset import ShardSet
from lmyard.errors import STATUS, ExitCode, Status
from lmyard.stages.exchange import Contract
from lmyard.tracking.schema import EVAL_LOSS


class Started(Contract):
    """What the trainer resumed from: the checkpoint it actually loaded (after any fallback), or none."""

    start_step: int
    resumed_from: str | None = None
    skipped_damaged: list[str] = Field(default_factory=list)
    world_size: int
    device: str = "cpu"  # the ranks' device type: `cuda` counts GPU-hours (lmyard.tracking.cost)
    hosts: list[str] = Field(default_factory=list)  # where a backend that places the nodes put them (the follower's)


class Progress(Contract):
    step: int
    max_steps: int
    loss: float | None = None
    tokens_per_s: float | None = None
    mfu: float | None = None
    time: float = Field(default_factory=time.time)


class ShardProgress(Contract):
    """Tokenize-and-shard's progress (lmyard.data.sharding.Progress), replaced as it goes."""

    documents: int
    tokens: int
    shards: int
    elapsed_s: float
    docs_per_s: float
    tokens_per_s: float
    fraction: float | None = None
    done: bool = False


class CompileReport(Contract):
    """What rank 0's torch.compile took from the run's store (lmyard.train.compile_cache) and torch's own cache
    counters in that process: hits are graphs not compiled again."""

    found: str = Field(description="off | loaded | none | mismatch | damaged")
    loaded: int = Field(0, description="Compiled artifacts put in place before the first step.")
    fxgraph_hits: int = 0
    fxgraph_misses: int = 0
    autograd_hits: int = 0
    autograd_misses: int = 0


class TrainResult(Contract):
    """How a training job ended. `exit_code` follows lmyard.errors.ExitCode."""

    status: Status
    exit_code: int
    message: str | None = None
    step: int = 0
    tokens_seen: int = 0
    val_loss: float | None = None
    train_loss: float | None = None
    rollbacks: int = 0
    start_step: int = 0
    resumed_from: str | None = None
    last_checkpoint: str | None = None
    rank: int | None = None  # a failed rank's: see StageError
    at: float | None = None
    output: list[str] = Field(default_factory=list)
    compile_cache: CompileReport | None = None

    @classmethod
    def ended(cls, code: ExitCode, message: str | None = None, **fields) -> TrainResult:
        return cls(status=STATUS[code], exit_code=int(code), message=message, **fields)


class Sample(Contract):
    prompt: str
    completion: str


class Score(Contract):
    """One evaluation's part of an EvalResult, made by its spec (lmyard.evaluate.spec.EvaluationSpec.score)."""

    metrics: dict[str, float] = Field(default_factory=dict, description="By MLflow name, at the checkpoint's step.")
    rows: dict[str, str] = Field(
        default_factory=dict, description="How it reads in a table, what -> value (default: its metrics)."
    )
    samples: list[Sample] = Field(default_factory=list, description="The text it generated.")
    result: Any = Field(None, description="Its own result as plain data.")


class EvalResult(Contract):
    step: int
    checkpoint: str
    tokens_seen: int
    trainer_val_loss: float | None = None
    device: str
    scores: dict[str, Score] = Field(
        default_factory=dict, description="Each evaluation's, by its name, in the registry's order (lmyard.evaluate)."
    )
    eval_s: float = 0.0

    @property
    def metrics(self) -> dict[str, float]:
        """Every evaluation's metrics by MLflow name."""
        return {k: v for s in self.scores.values() for k, v in s.metrics.items()}

    @property
    def rows(self) -> dict[str, str]:
        """Every evaluation's rows, what -> value, in the registry's order: how the result reads in a table."""
        return {k: v for s in self.scores.values() for k, v in s.rows.items()}

    @property
    def samples(self) -> list[Sample]:
        """Every evaluation's samples."""
        return [s for score in self.scores.values() for s in score.samples]

    @property
    def val_loss(self) -> float | None:
        """The evaluator's val loss (`loss/eval`, the metric that marks a checkpoint evaluated)."""
        return self.metrics.get(EVAL_LOSS)


class ShardResult(Contract):
    shards: ShardSet
    reused: bool = Field(description="The shard set was already at its address: nothing was tokenized.")
    train_tokens: int
    val_tokens: int
    ray_nodes: list[str] = Field(
        default_factory=list, description="launch.backend=ray: the Ray node id that read each piece, in order."
    )


class ExportResult(Contract):
    """lmyard_export.json's fields and where the folder went."""

    model_config = ConfigDict(extra="allow")  # the rest of lmyard_export.json (tokenizer, provenance)
    uri: str
    checkpoint: str
    step: int
    tokens_seen: int
    architecture: str
    hf_architecture: str


class StageError(Contract):
    """What a stage writes when it fails: its exit code and one-line message; a training rank adds which rank it
    is, when it failed and its traceback's last lines (lmyard.stages.run_stage: the launcher names the rank that
    failed first, lmyard.launch.follower)."""

    status: Status
    exit_code: int
    message: str
    rank: int | None = None
    at: float | None = None  # time.time() as it failed
    output: list[str] = Field(default_factory=list)

    @classmethod
    def ended(cls, code: ExitCode, message: str) -> StageError:
        return cls(status=STATUS[code], exit_code=int(code), message=message)
