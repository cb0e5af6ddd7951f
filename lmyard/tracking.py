"""Tracking: a metrics sink for the trainer, and the lineage's MLflow run.

Training code logs through `MetricsSink` (exactly one rank does); only
`MLflowSink` talks to MLflow. A lineage (`runs/<run_name>` in the store)
keeps the id of its one MLflow run in `runs/<run_name>/lineage.json`;
whatever resumes the lineage reopens that run and records a new attempt.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass
from typing import Protocol

from lmyard.config import RunConfig
from lmyard.errors import UserError


class MetricsSink(Protocol):
    def log(self, metrics: dict[str, float], step: int) -> None: ...
    def close(self) -> None: ...


class NullSink:
    def log(self, metrics: dict[str, float], step: int) -> None:
        pass

    def close(self) -> None:
        pass


class MLflowSink:
    """Sends metrics to one MLflow run in batches, from a background thread: logging never stalls a step."""

    def __init__(self, tracking_uri: str, run_id: str):
        import queue
        import threading

        from mlflow.tracking import MlflowClient

        self.client, self.run_id = MlflowClient(tracking_uri), run_id
        self.queue: queue.Queue = queue.Queue()
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._send, daemon=True, name="mlflow-sink")
        self.thread.start()

    def log(self, metrics: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.queue.put([Metric(k, float(v), now, step) for k, v in metrics.items()])

    def _send(self) -> None:
        while True:
            batch = self.queue.get()
            if batch is None:
                return
            while not self.queue.empty() and len(batch) < 1000:  # coalesce what has queued up meanwhile
                more = self.queue.get()
                if more is None:
                    self.queue.put(None)
                    break
                batch.extend(more)
            try:
                self.client.log_batch(self.run_id, metrics=batch)
            except Exception as e:  # noqa: BLE001 - reported at close(); training must not stop for tracking
                self.error = e

    def close(self) -> None:
        """Send everything queued, then stop; raises if a batch could not be sent."""
        self.queue.put(None)
        self.thread.join()
        if self.error is not None:
            raise RuntimeError(f"MLflow logging failed: {self.error}") from self.error


# ---------------------------------------------------------------- lineage

@dataclass(frozen=True)
class Lineage:
    run_name: str
    tracking_uri: str
    experiment_id: str
    mlflow_run_id: str
    attempt: int
    resumed_from: str | None
    start_step: int

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> Lineage:
        return cls(**d)


def lineage_key(run_name: str) -> str:
    return f"runs/{run_name}/lineage.json"


def _client(uri: str):
    from mlflow.tracking import MlflowClient

    if uri.startswith("sqlite:///"):
        path = uri.removeprefix("sqlite:///")
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    return MlflowClient(uri)


def _experiment_id(client, cfg: RunConfig) -> str:
    exp = client.get_experiment_by_name(cfg.tracking.experiment)
    if exp is not None:
        return exp.experiment_id
    location = None
    if cfg.tracking.uri.startswith("sqlite:///"):
        db = os.path.abspath(cfg.tracking.uri.removeprefix("sqlite:///"))
        location = "file://" + os.path.join(os.path.dirname(db), "mlartifacts")
    return client.create_experiment(cfg.tracking.experiment, artifact_location=location)


def open_lineage(cfg: RunConfig, store, *, attempt_info: dict, resumed_from: str | None,
                 start_step: int, shard_address: str, code_version: str) -> Lineage:
    """Create the lineage's MLflow run, or reopen it and record a new attempt."""
    client = _client(cfg.tracking.uri)
    key = lineage_key(cfg.run_name)
    params = cfg.flat()
    if store.exists(key):
        saved = json.loads(store.read_bytes(key))
        run_id = saved["mlflow_run_id"]
        try:
            run = client.get_run(run_id)
        except Exception:  # noqa: BLE001 - MlflowException for a missing run or an unreachable server
            raise UserError(f"lineage {cfg.run_name!r} belongs to MLflow run {run_id}, which {cfg.tracking.uri} "
                            "does not hold: point tracking.uri at the server that has it, or choose a new run_name") from None
        experiment_id = run.info.experiment_id
        attempt = int(run.data.tags.get("lmyard.attempts", "1")) + 1
        changed = {k: v for k, v in params.items() if k in run.data.params and run.data.params[k] != v}
        client.update_run(run_id, status="RUNNING")
    else:
        experiment_id = _experiment_id(client, cfg)
        run = client.create_run(experiment_id, run_name=cfg.run_name, tags={"lmyard.run_name": cfg.run_name})
        run_id, attempt, changed = run.info.run_id, 1, {}
        from mlflow.entities import Param

        items = [Param(k, v[:6000]) for k, v in params.items()]
        for i in range(0, len(items), 100):
            client.log_batch(run_id, params=items[i:i + 100])
        store.write_bytes(key, json.dumps({"mlflow_run_id": run_id, "experiment_id": experiment_id,
                                           "tracking_uri": cfg.tracking.uri}).encode())
    tags = {
        "lmyard.attempts": str(attempt),
        "lmyard.shard_address": shard_address,
        "lmyard.code_version": code_version,
        f"lmyard.attempt.{attempt}.start_step": str(start_step),
        f"lmyard.attempt.{attempt}.resumed_from": resumed_from or "",
        f"lmyard.attempt.{attempt}.started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    tags.update({f"lmyard.attempt.{attempt}.{k}": str(v) for k, v in attempt_info.items()})
    if changed:
        tags[f"lmyard.attempt.{attempt}.config_changes"] = json.dumps(changed)[:5000]
    for k, v in tags.items():
        client.set_tag(run_id, k, v)
    return Lineage(run_name=cfg.run_name, tracking_uri=cfg.tracking.uri, experiment_id=experiment_id,
                   mlflow_run_id=run_id, attempt=attempt, resumed_from=resumed_from, start_step=start_step)


def close_lineage(lineage: Lineage, status: str) -> None:
    """Mark the lineage's MLflow run FINISHED, FAILED or KILLED."""
    _client(lineage.tracking_uri).set_terminated(lineage.mlflow_run_id, status=status)


def log_artifact_text(lineage: Lineage, text: str, artifact_file: str) -> None:
    _client(lineage.tracking_uri).log_text(lineage.mlflow_run_id, text, artifact_file)


def log_artifact_dict(lineage: Lineage, data: dict, artifact_file: str) -> None:
    _client(lineage.tracking_uri).log_dict(lineage.mlflow_run_id, data, artifact_file)


def log_metrics(lineage: Lineage, metrics: dict[str, float], step: int) -> None:
    sink = MLflowSink(lineage.tracking_uri, lineage.mlflow_run_id)
    sink.log(metrics, step)
    sink.close()
