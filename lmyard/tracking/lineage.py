"""Tracking: a metrics sink for the trainer, and the lineage's MLflow run.

Training code logs through `MetricsSink` (exactly one rank does); only
`MLflowSink` talks to MLflow. A lineage (`runs/<run_name>` in the store)
keeps the id of its one MLflow run in `runs/<run_name>/lineage.json`;
whatever resumes the lineage reopens that run and records a new attempt.

Metric history stays continuous across attempts: a resumed trainer repeats
the steps between its checkpoint and the point where the last attempt died,
and `MLflowSink` does not log those again. For each key it drops points at
or below the highest step the run already holds (from earlier attempts, or
from this sink): the first value logged for a step is the one that stays.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Protocol

from lmyard.config import RunConfig, redact_uri
from lmyard.contracts import Lineage
from lmyard.errors import UserError
from lmyard.layout import RunLayout


class MetricsSink(Protocol):
    def log(self, metrics: dict[str, float], step: int) -> None: ...
    def flush(self, timeout: float | None = None) -> None: ...
    def close(self) -> None: ...


class NullSink:
    def log(self, metrics: dict[str, float], step: int) -> None:
        pass

    def flush(self, timeout: float | None = None) -> None:
        pass

    def close(self) -> None:
        pass


class MLflowSink:
    """Sends metrics to one MLflow run in batches, from a background thread: logging never stalls a step.

    Each key's points at or below the highest step the run already holds are
    dropped (see the module docstring), so a resumed attempt does not log a
    step twice. A batch that cannot be sent is kept and sent with the next one;
    the first failure of each kind is reported at once, in one line. Training
    never fails for tracking: what still cannot be sent at close() is counted
    in one warning line.
    """

    def __init__(self, tracking_uri: str, run_id: str):
        import queue
        import threading

        from mlflow.tracking import MlflowClient

        self.client, self.run_id = MlflowClient(tracking_uri), run_id
        self.queue: queue.Queue = queue.Queue()
        self.floor: dict[str, int] | None = None  # key -> highest step the run holds; read by the thread
        self.skipped = 0
        self.unsent: list = []  # points not sent yet (the server could not be reached), oldest first
        self.warned: set[str] = set()  # kinds of send errors already reported
        self.thread = threading.Thread(target=self._send, daemon=True, name="mlflow-sink")
        self.thread.start()

    def log(self, metrics: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.queue.put([Metric(k, float(v), now, step) for k, v in metrics.items()])

    def flush(self, timeout: float | None = None) -> None:
        """Wait until everything logged so far has been sent, or tried (e.g. before a checkpoint commits)."""
        import threading

        done = threading.Event()
        self.queue.put(done)
        done.wait(timeout)

    def _fresh(self, batch: list) -> list:
        if self.floor is None:
            self.floor = {m.key: m.step for m in self.client.get_run(self.run_id).data._metric_objs}
        out, seen = [], dict(self.floor)
        for m in batch:
            if m.step <= seen.get(m.key, -1):
                if not self.skipped:
                    print(
                        f"metrics: {m.key} at step {m.step} is already in the MLflow run (an earlier attempt "
                        "logged it); steps logged before are not logged again",
                        flush=True,
                    )
                self.skipped += 1
                continue
            seen[m.key] = m.step
            out.append(m)
        return out

    def _deliver(self, batch: list) -> None:
        """Send the unsent points and `batch`, 1000 at a time (MLflow's limit); keep what fails for the next try."""
        self.unsent.extend(batch)
        try:
            self.unsent = self._fresh(self.unsent)
            while self.unsent:
                chunk = self.unsent[:1000]
                self.client.log_batch(self.run_id, metrics=chunk)
                for m in chunk:
                    self.floor[m.key] = max(m.step, self.floor.get(m.key, -1))
                del self.unsent[: len(chunk)]
        except Exception as e:
            kind = type(e).__name__
            if kind not in self.warned:
                self.warned.add(kind)
                detail = redact_uri(str(e)).splitlines()[0][:300] if str(e) else ""
                print(
                    f"metrics: MLflow logging failed ({kind}: {detail}); "
                    "keeping the points and retrying with the next batch",
                    flush=True,
                )

    def _send(self) -> None:
        import threading

        while True:
            item = self.queue.get()
            batch, stop, markers = [], item is None, []
            if isinstance(item, threading.Event):
                markers.append(item)
            elif item is not None:
                batch.extend(item)
            while not stop and not self.queue.empty() and len(batch) < 1000:  # coalesce what queued up meanwhile
                more = self.queue.get()
                if more is None:
                    stop = True
                elif isinstance(more, threading.Event):
                    markers.append(more)
                else:
                    batch.extend(more)
            if batch or self.unsent:
                self._deliver(batch)
            for marker in markers:
                marker.set()
            if stop:
                return

    def close(self) -> None:
        """Send everything queued, then stop. Never raises: points that still cannot be sent are counted in
        one warning line."""
        self.queue.put(None)
        self.thread.join()
        if self.unsent:
            print(
                f"metrics: {len(self.unsent)} metric points could not be sent to MLflow and are lost "
                f"(from step {self.unsent[0].step} on)",
                flush=True,
            )


# ---------------------------------------------------------------- lineage


def lineage_key(run_name: str) -> str:
    return RunLayout(run_name).lineage


def _client(uri: str):
    from mlflow.tracking import MlflowClient

    if uri.startswith("sqlite:///"):
        path = uri.removeprefix("sqlite:///")
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    return MlflowClient(uri)


def check_reachable(uri: str, timeout_s: float = 5.0) -> None:
    """Fail in seconds, with one line, when an http(s) tracking server does not answer at all (MLflow's own
    client would retry for minutes). Any HTTP answer counts as reachable; other URIs are not checked."""
    if not uri.startswith(("http://", "https://")):
        return
    import requests

    try:
        requests.get(f"{uri.rstrip('/')}/health", timeout=timeout_s)
    except requests.RequestException as e:
        raise UserError(
            f"tracking.uri {redact_uri(uri)}: the MLflow server does not answer ({type(e).__name__}); "
            "start it, or point tracking.uri at a running server"
        ) from None


def _experiment_id(client, cfg: RunConfig) -> str:
    exp = client.get_experiment_by_name(cfg.tracking.experiment)
    if exp is not None:
        return exp.experiment_id
    location = None
    if cfg.tracking.uri.startswith("sqlite:///"):
        db = os.path.abspath(cfg.tracking.uri.removeprefix("sqlite:///"))
        location = "file://" + os.path.join(os.path.dirname(db), "mlartifacts")
    # the MLflow UI opens it in its model-training view (MLflow 3)
    return client.create_experiment(
        cfg.tracking.experiment, artifact_location=location, tags={"mlflow.experimentKind": "custom_model_development"}
    )


def open_lineage(cfg: RunConfig, store, *, shard_address: str, code_version: str) -> Lineage:
    """Create the lineage's MLflow run (params: the whole config), or reopen it (status RUNNING again).

    Attempts are recorded by `record_attempt`, once per launch of the trainer.
    """
    check_reachable(cfg.tracking.uri)
    client = _client(cfg.tracking.uri)
    key = lineage_key(cfg.run_name)
    params = cfg.flat()
    changed: dict[str, str] = {}
    if store.exists(key):
        saved = json.loads(store.read_bytes(key))
        run_id = saved["mlflow_run_id"]
        try:
            run = client.get_run(run_id)
        except Exception:
            raise UserError(
                f"lineage {cfg.run_name!r} belongs to MLflow run {run_id}, which {redact_uri(cfg.tracking.uri)} "
                "does not hold: point tracking.uri at the server that has it, or choose a new run_name"
            ) from None
        experiment_id = run.info.experiment_id
        attempts = int(run.data.tags.get("lmyard.attempts", "0"))
        changed = {k: v for k, v in params.items() if k in run.data.params and run.data.params[k] != v}
        client.update_run(run_id, status="RUNNING")
    else:
        experiment_id = _experiment_id(client, cfg)
        run = client.create_run(experiment_id, run_name=cfg.run_name, tags={"lmyard.run_name": cfg.run_name})
        run_id, attempts = run.info.run_id, 0
        from mlflow.entities import Param

        items = [Param(k, v[:6000]) for k, v in params.items()]
        for i in range(0, len(items), 100):
            client.log_batch(run_id, params=items[i : i + 100])
        store.write_bytes(
            key,
            json.dumps(
                {"mlflow_run_id": run_id, "experiment_id": experiment_id, "tracking_uri": redact_uri(cfg.tracking.uri)}
            ).encode(),
        )
    tags = {
        "lmyard.shard_address": shard_address,
        "lmyard.code_version": code_version,
        "lmyard.store": store.uri(RunLayout(cfg.run_name).root),
    }
    if changed:
        tags[f"lmyard.attempt.{attempts + 1}.config_changes"] = json.dumps(changed)[:5000]
    _set_tags(client, run_id, tags)
    return Lineage(
        run_name=cfg.run_name,
        tracking_uri=cfg.tracking.uri,
        experiment_id=experiment_id,
        mlflow_run_id=run_id,
        attempt=attempts,
        resumed_from=None,
        start_step=0,
    )


def record_attempt(lineage: Lineage, *, resumed_from: str | None, start_step: int, info: dict) -> Lineage:
    """Record a new attempt on the lineage's run (number, start step, resumed-from checkpoint, `info`)."""
    client = _client(lineage.tracking_uri)
    run = client.get_run(lineage.mlflow_run_id)
    attempt = int(run.data.tags.get("lmyard.attempts", "0")) + 1
    if run.info.status != "RUNNING":
        client.update_run(lineage.mlflow_run_id, status="RUNNING")
    tags = {
        "lmyard.attempts": str(attempt),
        f"lmyard.attempt.{attempt}.start_step": str(start_step),
        f"lmyard.attempt.{attempt}.resumed_from": resumed_from or "",
        f"lmyard.attempt.{attempt}.started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    tags.update({f"lmyard.attempt.{attempt}.{k}": str(v) for k, v in info.items()})
    _set_tags(client, lineage.mlflow_run_id, tags)
    return lineage.model_copy(update=dict(attempt=attempt, resumed_from=resumed_from, start_step=start_step))


def record_resume(lineage: Lineage, *, resumed_from: str | None, start_step: int) -> None:
    """Record on the current attempt the checkpoint the trainer actually loaded (reported by the trainer)."""
    _set_tags(
        _client(lineage.tracking_uri),
        lineage.mlflow_run_id,
        {
            f"lmyard.attempt.{lineage.attempt}.start_step": str(start_step),
            f"lmyard.attempt.{lineage.attempt}.resumed_from": resumed_from or "",
        },
    )


def end_attempt(lineage: Lineage, outcome: str, detail: str = "") -> None:
    """Record how the lineage's current attempt ended (`finished`, `failed: ...`)."""
    _set_tags(
        _client(lineage.tracking_uri),
        lineage.mlflow_run_id,
        {f"lmyard.attempt.{lineage.attempt}.outcome": (outcome + (f": {detail}" if detail else ""))[:5000]},
    )


def attempts(lineage: Lineage) -> list[dict]:
    """The recorded attempts of the lineage's run, oldest first."""
    tags = _client(lineage.tracking_uri).get_run(lineage.mlflow_run_id).data.tags
    out = []
    for n in range(1, int(tags.get("lmyard.attempts", "0")) + 1):
        prefix = f"lmyard.attempt.{n}."
        out.append({"attempt": n, **{k.removeprefix(prefix): v for k, v in tags.items() if k.startswith(prefix)}})
    return out


def _set_tags(client, run_id: str, tags: dict[str, str]) -> None:
    from mlflow.entities import RunTag

    client.log_batch(run_id, tags=[RunTag(k, v) for k, v in tags.items()])


def close_lineage(lineage: Lineage, status: str) -> None:
    """Mark the lineage's MLflow run FINISHED, FAILED or KILLED."""
    _client(lineage.tracking_uri).set_terminated(lineage.mlflow_run_id, status=status)


def close_lineage_of(tracking_uri: str, store, run_name: str, status: str) -> str | None:
    """Mark the MLflow run of runs/<run_name> `status` if it is still RUNNING (found through the store);
    its id, or None when there is no such run or it has already ended."""
    key = lineage_key(run_name)
    if not store.exists(key):
        return None
    run_id = json.loads(store.read_bytes(key))["mlflow_run_id"]
    client = _client(tracking_uri)
    if client.get_run(run_id).info.status != "RUNNING":
        return None
    client.set_terminated(run_id, status=status)
    return run_id


def log_artifact_text(lineage: Lineage, text: str, artifact_file: str) -> None:
    _client(lineage.tracking_uri).log_text(lineage.mlflow_run_id, text, artifact_file)


def log_artifact_dict(lineage: Lineage, data: dict | list, artifact_file: str) -> None:
    _client(lineage.tracking_uri).log_dict(lineage.mlflow_run_id, data, artifact_file)


def log_metrics(lineage: Lineage, metrics: dict[str, float], step: int, model_id: str | None = None) -> None:
    """Log metrics at `step` now, in one batch (for evaluations; the trainer uses MLflowSink); with
    `model_id`, linked to that logged model too."""
    from mlflow.entities import Metric

    now = int(time.time() * 1000)
    _client(lineage.tracking_uri).log_batch(
        lineage.mlflow_run_id, metrics=[Metric(k, float(v), now, step, model_id=model_id) for k, v in metrics.items()]
    )


def metric_history(lineage: Lineage, key: str) -> dict[int, float]:
    """step -> value of one metric of the lineage's run."""
    return {m.step: m.value for m in _client(lineage.tracking_uri).get_metric_history(lineage.mlflow_run_id, key)}


# ---------------------------------------------------------------- system metrics


@contextmanager
def system_metrics(lineage: Lineage, node_id: str, interval_s: float = 10.0) -> Iterator[None]:
    """Log CPU, memory, disk, network (and GPU, with nvidia-ml-py) metrics of this node meanwhile.

    Keys are `system/<node_id>/...`; a resumed attempt continues the series' steps.
    """
    from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

    monitor = SystemMetricsMonitor(
        lineage.mlflow_run_id,
        sampling_interval=interval_s,
        samples_before_logging=1,
        resume_logging=True,
        node_id=node_id,
        tracking_uri=lineage.tracking_uri,
    )
    monitor.start()
    try:
        yield
    finally:
        monitor.finish()


# ---------------------------------------------------------------- end of a run: plot, model registry


def log_loss_curve(lineage: Lineage, keys: tuple[str, ...] = ("train/loss", "val/loss", "eval/val_loss")) -> dict:
    """A PNG of the loss metrics against step, logged as plots/loss.png; returns the histories plotted."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    histories = {k: metric_history(lineage, k) for k in keys}
    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=100)
    for key, h in histories.items():
        if h:
            steps = sorted(h)
            ax.plot(steps, [h[s] for s in steps], marker="o" if len(steps) < 30 else None, label=key)
    for a in attempts(lineage)[1:]:
        if a.get("start_step"):
            ax.axvline(int(a["start_step"]), color="grey", linestyle=":", linewidth=1)
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/token)")
    ax.set_title(f"{lineage.run_name}: loss (dotted: resumed attempts)")
    ax.legend()
    fig.tight_layout()
    _client(lineage.tracking_uri).log_figure(lineage.mlflow_run_id, fig, "plots/loss.png")
    plt.close(fig)
    return histories


def log_shard_dataset(lineage: Lineage, shards) -> None:
    """The shard set as the run's training dataset input: name, content address (digest), store URI (source)."""
    from mlflow.entities import Dataset, DatasetInput, InputTag

    m = shards.manifest
    profile = {
        "address": shards.address,
        "train_tokens": shards.tokens("train"),
        "val_tokens": shards.tokens("val"),
        "shards": len(m.get("shards", [])),
        "tokenizer": m.get("tokenizer", {}).get("name"),
    }
    dataset = Dataset(
        name=f"shards-{shards.address[:12]}",
        digest=shards.address[:36],  # MLflow keeps 36 characters
        source_type="s3" if shards.uri.startswith("s3://") else "local",
        source=json.dumps({"uri": shards.uri}),
        profile=json.dumps(profile),
        schema=json.dumps({"format": "llm.c .bin token shards", "n_vocab": m.get("tokenizer", {}).get("n_vocab")}),
    )
    _client(lineage.tracking_uri).log_inputs(
        lineage.mlflow_run_id, datasets=[DatasetInput(dataset, tags=[InputTag("mlflow.data.context", "training")])]
    )


def log_checkpoint_model(lineage: Lineage, step: int, checkpoint_uri: str, descriptor: dict) -> str:
    """An MLflow logged model for one evaluated checkpoint: a descriptor that points at the checkpoint by URI
    (no weights are copied), an output of the run at `step`. Its id: log the step's metrics with it."""
    import tempfile

    from mlflow.entities import LoggedModelOutput

    client = _client(lineage.tracking_uri)
    model = client.create_logged_model(
        lineage.experiment_id,
        name=f"{lineage.run_name}-step-{step:08d}",
        source_run_id=lineage.mlflow_run_id,
        model_type="lmyard-checkpoint",
        params={"checkpoint_uri": checkpoint_uri, "step": str(step)},
        tags={"lmyard.run_name": lineage.run_name, "lmyard.step": str(step)},
    )
    with tempfile.TemporaryDirectory(prefix="lmyard-model-") as tmp:
        with open(os.path.join(tmp, "lmyard_checkpoint.json"), "w") as f:
            json.dump(descriptor, f, indent=1)
        client.log_model_artifacts(model.model_id, tmp)
    client.finalize_logged_model(model.model_id, "READY")
    client.log_outputs(lineage.mlflow_run_id, [LoggedModelOutput(model.model_id, step)])
    return model.model_id


def link_metrics(lineage: Lineage, model_id: str, step: int, prefixes: tuple[str, ...] = ("eval/", "val/")) -> None:
    """Link the run's metrics at `step` (those under `prefixes`) to a logged model, as MLflow's log_model does:
    the same points again with the model's id; the run's own history keeps one point per step."""
    from mlflow.entities import Metric

    client = _client(lineage.tracking_uri)
    keys = [k for k in client.get_run(lineage.mlflow_run_id).data.metrics if k.startswith(prefixes)]
    points = [
        Metric(m.key, m.value, m.timestamp, m.step, model_id=model_id, run_id=lineage.mlflow_run_id)
        for k in keys
        for m in client.get_metric_history(lineage.mlflow_run_id, k)
        if m.step == step and m.model_id is None
    ]
    if points:
        client.log_batch(lineage.mlflow_run_id, metrics=points)


def log_hf_model(
    lineage: Lineage, name: str, folder: str, step: int, params: dict[str, str], tags: dict[str, str]
) -> str:
    """Log an exported Hugging Face folder as an MLflow pyfunc model (lmyard/export/pyfunc.py, text in, text out)
    whose artifacts, the weights among them, go to the artifact store; linked to the run's metrics at
    `step`. Returns the logged model's id."""
    import tempfile

    import mlflow.pyfunc
    from mlflow.entities import LoggedModelOutput
    from mlflow.models import Model, ModelSignature
    from mlflow.types import ColSpec, ParamSchema, ParamSpec, Schema

    client = _client(lineage.tracking_uri)
    model = client.create_logged_model(
        lineage.experiment_id,
        name=name,
        source_run_id=lineage.mlflow_run_id,
        params=params,
        tags=tags,
        model_type="transformers-text-generation",
    )
    signature = ModelSignature(
        inputs=Schema([ColSpec("string")]),
        outputs=Schema([ColSpec("string")]),  # prompts in, texts out
        params=ParamSchema(
            [
                ParamSpec("max_new_tokens", "long", 64),
                ParamSpec("temperature", "double", 0.8),
                ParamSpec("top_k", "long", 40),
                ParamSpec("seed", "long", 0),
                ParamSpec("do_sample", "boolean", True),
            ]
        ),
    )
    with tempfile.TemporaryDirectory(prefix="lmyard-model-") as tmp:
        path = os.path.join(tmp, "model")
        mlflow.pyfunc.save_model(
            path,
            python_model=os.path.join(os.path.dirname(os.path.dirname(__file__)), "export", "pyfunc.py"),
            artifacts={"hf_model": folder},
            signature=signature,
            pip_requirements=_pyfunc_requirements(),
            mlflow_model=Model(
                artifact_path=model.artifact_location, run_id=lineage.mlflow_run_id, model_id=model.model_id
            ),
        )
        client.log_model_artifacts(model.model_id, path)
    client.finalize_logged_model(model.model_id, "READY")
    client.log_outputs(lineage.mlflow_run_id, [LoggedModelOutput(model.model_id, step)])
    link_metrics(lineage, model.model_id, step)
    return model.model_id


def _pyfunc_requirements() -> list[str]:
    """What loading the pyfunc needs (pinned to what is installed here, where known); never inferred by
    loading the model, which would cost a full load at logging time."""
    from importlib.metadata import PackageNotFoundError, version

    out = []
    for dist in ("mlflow", "torch", "transformers", "tokenizers", "safetensors"):
        try:
            out.append(f"{dist}=={version(dist)}")
        except PackageNotFoundError:
            out.append(dist)
    return out


def register_model(
    lineage: Lineage, name: str, model_id: str, step: int, description: str, tags: dict[str, str], checkpoint_uri: str
) -> str:
    """Register a logged model as a new version of `name` (source `models:/<model_id>`, which an MLflow
    server accepts whatever the artifact store); its version number."""
    from mlflow.exceptions import MlflowException

    client = _client(lineage.tracking_uri)
    try:
        client.create_registered_model(name, description="GPT models pretrained with lmyard")
    except MlflowException as e:
        if e.error_code != "RESOURCE_ALREADY_EXISTS":
            raise
    # MLflow's SQL registry store (a sqlite:// URI, no server) looks the logged model up through the process's
    # global tracking URI rather than this client's: point that at ours for the call
    from mlflow.tracking._tracking_service.utils import _use_tracking_uri

    with _use_tracking_uri(lineage.tracking_uri):
        version = client.create_model_version(
            name,
            source=f"models:/{model_id}",
            run_id=lineage.mlflow_run_id,
            description=description,
            tags={"lmyard.step": str(step), "lmyard.checkpoint": checkpoint_uri, **tags},
            model_id=model_id,
        )
    _set_tags(
        client,
        lineage.mlflow_run_id,
        {"lmyard.registered_model": f"{name}/{version.version}", "lmyard.final_checkpoint": checkpoint_uri},
    )
    return str(version.version)


def protect_checkpoint(store, run_name: str, step: int) -> list[int]:
    """Add `step` to runs/<run>/protected.json ({"steps": [...]}): retention keeps what a registered model points to."""
    key = RunLayout(run_name).protected
    steps = set(json.loads(store.read_bytes(key))["steps"]) if store.exists(key) else set()
    steps.add(step)
    store.write_bytes(key, json.dumps({"steps": sorted(steps)}).encode())
    return sorted(steps)


def set_alias(tracking_uri: str, name: str, alias: str, version: str) -> None:
    _client(tracking_uri).set_registered_model_alias(name, alias, version)


def log_table(lineage: Lineage, columns: dict[str, list], artifact_file: str) -> None:
    """Append rows (given as columns) to a table artifact the MLflow UI renders (e.g. evals/checkpoints.json)."""
    _client(lineage.tracking_uri).log_table(lineage.mlflow_run_id, data=columns, artifact_file=artifact_file)


def set_tags(lineage: Lineage, tags: dict[str, str]) -> None:
    _set_tags(_client(lineage.tracking_uri), lineage.mlflow_run_id, tags)
