"""What the tasks hand the flows: typed results that cross no process boundary (flows read fields, never string
keys). What a stage process writes back is lmyard.stages."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from lmyard.stages import Contract, EvalResult


class CheckpointReport(Contract):
    """A checkpoint verified in the store against its manifest (lmyard.checkpoint.catalog.verify)."""

    step: int
    uri: str
    format: str = Field(description="The checkpoint's format: `full` (one state dict) or `dcp` (shards per rank).")
    files: int
    bytes: int
    serialize_s: float | None = None
    upload_s: float | None = None
    committed: float | None = Field(None, description="When the manifest was written (epoch seconds).")


class Evaluation(Contract):
    """One checkpoint's evaluation as the flow sees it: its result, or the error that stopped it.
    A failed evaluation never fails the run (it is recorded on the MLflow run and in the RunSummary)."""

    step: int
    checkpoint: str
    result: EvalResult | None = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.result is not None


class Gate(Contract):
    value: float | None
    limit: float
    passed: bool


class RegisteredModel(Contract):
    """A model version in the MLflow registry: the final checkpoint exported and logged."""

    name: str
    version: str
    alias: str | None = None
    gates: dict[str, Gate] = Field(default_factory=dict)
    source: str
    model_uri: str


class RunSummary(Contract):
    """What the pretrain flow returns (and logs as summary.json)."""

    run_name: str
    mlflow_run_id: str
    attempts: int
    shard_address: str
    steps: int
    tokens_seen: int
    train_loss: float | None = None
    val_loss: float | None = Field(None, description="The final evaluation's, else the trainer's own.")
    metrics: dict[str, float] = Field(
        default_factory=dict, description="The final evaluation's metrics by MLflow name (none if it failed)."
    )
    checkpoint: str
    registered_model: str | None = Field(None, description="NAME/VERSION; none with tracking.registry=false.")
    alias: str | None = None
    failed_evaluations: dict[int, str] = Field(default_factory=dict, description="step -> what went wrong.")


class RetrainDecision(Contract):
    """What a scheduled retraining does: `train` from scratch, `continue` on new data, or `none`."""

    action: Literal["train", "continue", "none"]
    reason: str
    from_step: int
    max_steps: int
    run: RunSummary | None = None
