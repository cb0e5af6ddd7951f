"""The one config of a run: a validated pydantic model.

It is the Prefect flow's parameter (the UI renders a form from it), it is
logged whole to MLflow, and its relevant parts hash into content addresses.
The field defaults are the `smoke` recipe, the embedded default: a tiny
byte-level GPT trained on CPython's own documentation with 2 CPU ranks.

Design notes: docs/cli.md, `lmyard/config/__init__.py`.
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import Field, field_validator, model_validator

from lmyard.backends.docker import DockerConfig
from lmyard.backends.ray import RayConfig
from lmyard.config.base import RUN_NAME_MAX, _Section, digest, redact_uri
from lmyard.config.checkpoint import CheckpointConfig
from lmyard.config.data import DataConfig, SourceConfig, TokenizerConfig
from lmyard.config.evaluation import EvalConfig, EvalGates, MetricGate
from lmyard.config.launch import LaunchConfig
from lmyard.config.model import ModelConfig
from lmyard.config.tracking import DEFAULT_TRACKING_URI, TrackingConfig, default_tracking_uri
from lmyard.config.train import GuardConfig, TrainConfig
from lmyard.paths import store_uri_problem

__all__ = [
    "RUN_NAME_MAX",
    "DEFAULT_TRACKING_URI",
    "CheckpointConfig",
    "DataConfig",
    "DockerConfig",
    "EvalConfig",
    "EvalGates",
    "MetricGate",
    "GuardConfig",
    "LaunchConfig",
    "ModelConfig",
    "RayConfig",
    "RunConfig",
    "SourceConfig",
    "TokenizerConfig",
    "TrackingConfig",
    "TrainConfig",
    "default_tracking_uri",
    "digest",
    "redact_uri",
]


class RunConfig(_Section):
    store: str = Field(
        ".lmyard/store", description="Root URI of shards and runs: a local path, file://path, or s3://bucket/prefix."
    )
    run_name: str = Field(
        "smoke",
        pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$",
        description=f"The lineage's name (at most {RUN_NAME_MAX} characters): the store folder runs/<run_name>, "
        "the MLflow run's name and the default registered model name.",
    )
    data: DataConfig = Field(default_factory=DataConfig)
    tokenizer: TokenizerConfig = Field(default_factory=TokenizerConfig)
    model: ModelConfig = Field(default_factory=ModelConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    launch: LaunchConfig = Field(default_factory=LaunchConfig)
    tracking: TrackingConfig = Field(default_factory=TrackingConfig)

    @field_validator("store")
    @classmethod
    def _store_uri(cls, v: str) -> str:
        problem = store_uri_problem(v)
        if problem:
            raise ValueError(problem)
        return v

    @model_validator(mode="after")
    def _checkpointing_blocks_within_layers(self) -> RunConfig:
        blocks, n_layer = self.train.activation_checkpointing_blocks, self.model.dims()["n_layer"]
        if blocks is not None and n_layer is not None and not self.model.init_from and blocks > n_layer:
            raise ValueError(
                f"train.activation_checkpointing_blocks is {blocks} but the model has {n_layer} blocks: "
                f"set at most {n_layer} ({n_layer} is every block, as leaving it unset)"
            )
        return self

    @model_validator(mode="after")
    def _gates_need_registration(self) -> RunConfig:
        gates = self.eval.gates
        if not self.tracking.registry and (gates.configured() or gates.metrics or self.eval.approval):
            raise ValueError(
                "eval.gates and eval.approval act on the registered model: with tracking.registry=false, unset them"
            )
        return self

    @model_validator(mode="after")
    def _global_batch_at_every_size(self) -> RunConfig:
        """An elastic run keeps train.batch_tokens at each size it may shrink to: a size it cannot hold is refused
        here, before any shard is made, not when a node is lost (lmyard.train.build.grad_accum_steps)."""
        block, launch = self.model.dims()["block_size"] or 0, self.launch  # 0: a Hugging Face folder's, unknown here
        for n in range(launch.fewest_nodes(), launch.nnodes) if block else ():
            per_micro = self.train.micro_batch * block * n * launch.nproc_per_node
            if self.train.batch_tokens % per_micro:
                raise ValueError(
                    f"train.batch_tokens ({self.train.batch_tokens}) is not a multiple of micro_batch * block_size * "
                    f"world size at {n} of launch.nnodes={launch.nnodes} ({per_micro}), a size launch.min_nnodes="
                    f"{launch.min_nnodes} lets the run shrink to: make it a multiple of every size's, or raise "
                    "launch.min_nnodes"
                )
        return self

    @field_validator("run_name")
    @classmethod
    def _short_run_name(cls, v: str) -> str:
        if len(v) > RUN_NAME_MAX:
            raise ValueError(
                f"{len(v)} characters, at most {RUN_NAME_MAX} are allowed: it names the store folder "
                "runs/<run_name> (255 bytes per folder name on most filesystems) and the MLflow run; choose a shorter one"
            )
        return v

    def world_size(self) -> int:
        return self.launch.nnodes * self.launch.nproc_per_node

    def redacted_dump(self) -> dict[str, Any]:
        """model_dump(mode="json") with the password of every URI removed (see redact_uri): what may be
        logged or saved (MLflow params, lineage.json, checkpoint state)."""

        def walk(value: Any) -> Any:
            if isinstance(value, dict):
                return {k: walk(v) for k, v in value.items()}
            if isinstance(value, list):
                return [walk(v) for v in value]
            return redact_uri(value) if isinstance(value, str) else value

        return walk(self.model_dump(mode="json"))

    def flat(self) -> dict[str, str]:
        """Dotted key -> value, for MLflow params (credentials in URIs redacted)."""
        out: dict[str, str] = {}

        def walk(prefix: str, value: Any) -> None:
            if isinstance(value, dict):
                for k, v in value.items():
                    walk(f"{prefix}.{k}" if prefix else k, v)
            else:
                out[prefix] = json.dumps(value) if isinstance(value, (list, dict)) else str(value)

        walk("", self.redacted_dump())
        return out
