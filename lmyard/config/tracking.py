"""The `tracking` section: MLflow, the lineage's lease."""

from __future__ import annotations

import os

from pydantic import Field

from lmyard.config.base import _Section

DEFAULT_TRACKING_URI = "sqlite:///.lmyard/mlflow.db"


def default_tracking_uri() -> str:
    """tracking.uri when a config does not set it: MLflow's standard MLFLOW_TRACKING_URI (what a platform sets
    for its jobs), else a local sqlite file. Read when the config is built, never at import."""
    return os.environ.get("MLFLOW_TRACKING_URI") or DEFAULT_TRACKING_URI


class TrackingConfig(_Section):
    uri: str = Field(
        default_factory=default_tracking_uri,
        description="MLflow tracking URI; when not set: $MLFLOW_TRACKING_URI, else a local sqlite file.",
    )
    experiment: str = Field("lmyard", description="MLflow experiment name.")
    registered_model: str | None = Field(
        None, description="Model registry name of the final model; default: the run_name."
    )
    registry: bool = Field(
        True,
        description="Export the final checkpoint and register it as a version of tracking.registered_model "
        "(eval.gates, eval.alias and eval.approval act on it); false: the run ends at its final evaluation, "
        "nothing registered (sweep trials, drills).",
    )
    parent_run_id: str | None = Field(
        None,
        description="The MLflow run of the sweep this lineage is a trial of (set by `lmyard sweep`): the lineage's "
        "run is its child (the `mlflow.parentRunId` tag).",
    )
    gpu_hour_price: float | None = Field(
        None,
        ge=0,
        description="Price of one GPU-hour (in any currency): each attempt records it, and a lineage's GPU-hours "
        "then give a cost estimate (the `system/cost/estimate` metric, `lmyard status`, `lmyard runs --cost`).",
    )
    system_metrics: bool = Field(True, description="Log CPU, memory, disk, network (and GPU) metrics per node.")
    system_metrics_interval_s: float = Field(10.0, gt=0, description="Seconds between system metric samples.")
    lease_ttl_s: float = Field(
        60.0,
        ge=3,
        description="One run writes a lineage at a time: it holds a lease on runs/<run_name>, renewed "
        "every ttl/3; a lease not renewed for this long (its holder died) may be taken over.",
    )
    lease_wait_s: float = Field(
        90.0,
        ge=0,
        description="How long a run waits for another run of the same lineage to end (or for a dead "
        "holder's lease to expire) before it refuses, naming the holder.",
    )
