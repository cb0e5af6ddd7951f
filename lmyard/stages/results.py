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


class Started(Contract):
    """What the trainer resumed from: the checkpoint it actually loaded (after any fallback), or none."""

    start_step: int
    resumed_from: str | None = None
    skipped_damaged: list[str] = Field(default_factory=list)
    world_size: int


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
    compile_cache: CompileReport | None = None

    @classmethod
    def ended(cls, code: ExitCode, message: str | None = None, **fields) -> TrainResult:
        return cls(status=STATUS[code], exit_code=int(code), message=message, **fields)


class HellaSwagScore(Contract):
    acc: float = Field(description="The ending with the lowest summed loss is right.")
    acc_norm: float = Field(description="The ending with the lowest mean loss per token is right.")
    n: int
    rows: list[dict[str, Any]] = Field(default_factory=list, description="Per example: label, preds, losses.")


class HarnessScore(Contract):
    metrics: dict[str, float] = Field(description="lm-eval's metrics, flattened `task/metric`.")
    results: dict[str, Any] = Field(default_factory=dict)


class Sample(Contract):
    prompt: str
    completion: str


class EvalResult(Contract):
    step: int
    checkpoint: str
    tokens_seen: int
    trainer_val_loss: float | None = None
    device: str
    val_loss: float
    hellaswag: HellaSwagScore | None = None
    harness: HarnessScore | None = Field(None, description="eval.harness_tasks: lm-eval's {metrics, results}.")
    samples: list[Sample] = Field(default_factory=list)
    metrics: dict[str, float] = Field(
        default_factory=dict, description="Every evaluation's metrics by MLflow name (lmyard.evaluate.registry)."
    )
    eval_s: float = 0.0


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
    """What a stage writes when it fails: its exit code and one-line message."""

    status: Status
    exit_code: int
    message: str

    @classmethod
    def ended(cls, code: ExitCode, message: str) -> StageError:
        return cls(status=STATUS[code], exit_code=int(code), message=message)
