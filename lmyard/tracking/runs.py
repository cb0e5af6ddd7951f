"""What an operator asks of a store: its lineages (`lmyard runs`) and the state of one (`lmyard status RUN`).

Both read what lmyard itself wrote: the store's `runs/<run>/` folders (complete checkpoints, the lease, the
lineage's MLflow run id) and, for one lineage, its MLflow run (attempts, last evaluation, registered versions).
Nothing here writes. The types are what `--json` prints.
"""

from __future__ import annotations

import json
import os
import tempfile
import time

from pydantic import BaseModel

from lmyard.checkpoint import catalog
from lmyard.config import redact_uri
from lmyard.errors import UserError
from lmyard.layout import RUNS, RunLayout
from lmyard.store import Store
from lmyard.tracking import lease, schema
from lmyard.tracking.client import mlflow_client, tracking_errors


class LeaseHolder(BaseModel):
    holder: str  # host, pid, flow run, since
    heartbeat_age_s: float
    expired: bool  # a run started now would take it over


class RunRow(BaseModel):
    """One lineage of the store, from the store alone."""

    run_name: str
    checkpoints: int  # complete ones
    newest_step: int | None
    newest_checkpoint: str | None  # its URI
    lease: LeaseHolder | None  # None: no run holds the lineage
    mlflow_run_id: str | None


class Attempt(BaseModel):
    number: int
    start_step: int | None
    resumed_from: str | None
    outcome: str | None  # None while it runs (or when it died without a word)


class LastEvaluation(BaseModel):
    step: int
    val_loss: float
    rows: dict[str, str] = {}  # every evaluation's, what -> value (its logged EvalResult's: lmyard.stages)


class ModelVersion(BaseModel):
    name: str
    version: str
    aliases: list[str]
    uri: str  # models:/NAME/VERSION


class RunStatus(RunRow):
    """One lineage: the store's view and its MLflow run's."""

    tokens_seen: int | None  # at the newest complete checkpoint
    newest_damaged: str | None  # what is wrong with the newest complete checkpoint's files (None: nothing found)
    damaged_steps: list[int]  # steps whose checkpoint was moved aside as damaged (runs/RUN/damaged/)
    mlflow_status: str | None  # RUNNING, FINISHED, FAILED, KILLED
    mlflow_run_url: str | None  # the run's page, for a tracking server over HTTP
    attempts: list[Attempt]
    last_evaluation: LastEvaluation | None
    registered_versions: list[ModelVersion]


def check_store(store: Store) -> None:
    """UserError when the store is not there: a local folder that does not exist, a bucket that does not (an
    unreachable S3 endpoint is one line too: lmyard.store.s3_errors)."""
    local = store.local_path("")
    if local is not None and not os.path.isdir(local):
        raise UserError(
            f"store {local} does not exist: give --store (or LMYARD_STORE) the store the lineages were written to"
        )
    store.exists(RUNS)


def run_names(store: Store) -> list[str]:
    """Names of the lineages in the store (folders under runs/ that hold a lineage, a lease or checkpoints)."""
    names = set()
    for key in store.list(f"{RUNS}/"):
        parts = key.split("/")
        if len(parts) >= 3 and parts[0] == RUNS:
            names.add(parts[1])
    return sorted(names)


def _lease(store: Store, run_name: str) -> LeaseHolder | None:
    key = RunLayout(run_name).lease
    if not store.exists(key):
        return None
    record = lease.parse(store.read_bytes(key), store.uri(key))
    now = time.time()
    return LeaseHolder(
        holder=lease.describe(record),
        heartbeat_age_s=round(now - float(record.get("heartbeat", 0)), 1),
        expired=lease.expired(record, now),
    )


def lineage_run_id(store: Store, run_name: str) -> str | None:
    key = RunLayout(run_name).lineage
    if not store.exists(key):
        return None
    try:
        return json.loads(store.read_bytes(key))["mlflow_run_id"]
    except (ValueError, KeyError, TypeError):
        raise UserError(f"{store.uri(key)} is not a lineage file lmyard wrote; move it aside") from None


def run_row(store: Store, run_name: str) -> RunRow:
    steps = catalog.complete_steps(store, run_name)
    return RunRow(
        run_name=run_name,
        checkpoints=len(steps),
        newest_step=steps[-1] if steps else None,
        newest_checkpoint=store.uri(RunLayout(run_name).step(steps[-1])) if steps else None,
        lease=_lease(store, run_name),
        mlflow_run_id=lineage_run_id(store, run_name),
    )


def list_runs(store: Store) -> list[RunRow]:
    return [run_row(store, name) for name in run_names(store)]


def _attempts(tags: dict[str, str]) -> list[Attempt]:
    def tag(n: int, key: str) -> str | None:
        return tags.get(f"lmyard.attempt.{n}.{key}") or None

    return [
        Attempt(
            number=n,
            start_step=int(s) if (s := tag(n, "start_step")) is not None else None,
            resumed_from=tag(n, "resumed_from"),
            outcome=tag(n, "outcome"),
        )
        for n in range(1, int(tags.get("lmyard.attempts", "0")) + 1)
    ]


def _run_url(tracking_uri: str, experiment_id: str, run_id: str) -> str | None:
    uri = tracking_uri.rstrip("/")
    if not uri.startswith(("http://", "https://")):
        return None
    return redact_uri(f"{uri}/#/experiments/{experiment_id}/runs/{run_id}")  # not a store key: the UI page


def _evaluation_rows(client, run_id: str, step: int) -> dict[str, str]:
    """How the evaluation logged at `step` reads (its EvalResult's scores' rows, in order); {} without its file."""
    key = schema.EVAL_RESULT.format(step)
    if key not in {a.path for a in client.list_artifacts(run_id, os.path.dirname(key))}:
        return {}
    with tempfile.TemporaryDirectory(prefix="lmyard-status-") as tmp:
        with open(client.download_artifacts(run_id, key, tmp)) as f:
            scores = json.load(f).get("scores") or {}
    return {what: value for score in scores.values() for what, value in score.get("rows", {}).items()}


def checkpoint_damage(store: Store, run_name: str, step: int, checksums: bool = False) -> str | None:
    """What is wrong with checkpoint `step`'s files against its manifest: their sizes (one listing call a file),
    and with `checksums` their SHA-256 (reads every byte); None when nothing is."""
    from lmyard.checkpoint.manifest import mismatch

    try:
        catalog.verify(store, run_name, step)
        catalog.read_state(store, run_name, step)
        if checksums:
            for name, meta in catalog.read_manifest(store, run_name, step).files.items():
                key = RunLayout(run_name).step_file(step, name)
                if store.sha256(key) != meta.sha256:
                    raise mismatch(store.uri(key))
    except ValueError as e:  # DamagedCheckpoint and pydantic's ValidationError are ValueErrors
        return str(e).splitlines()[0]
    return None


def run_status(store: Store, run_name: str, tracking_uri: str, checksums: bool = False) -> RunStatus:
    """The state of lineage `run_name`; UserError when the store holds no such lineage."""
    if run_name not in run_names(store):
        known = ", ".join(run_names(store)) or "none"
        raise UserError(f"no lineage {run_name!r} in {store.uri(RUNS)} (lineages there: {known})")
    row = run_row(store, run_name)
    step = row.newest_step
    damage = checkpoint_damage(store, run_name, step, checksums) if step is not None else None
    tokens = catalog.read_state(store, run_name, step).tokens_seen if step is not None and not damage else None
    status = RunStatus(
        **row.model_dump(),
        tokens_seen=tokens,
        newest_damaged=damage,
        damaged_steps=sorted(catalog.damaged(store, run_name)),
        mlflow_status=None,
        mlflow_run_url=None,
        attempts=[],
        last_evaluation=None,
        registered_versions=[],
    )
    if row.mlflow_run_id is None:
        return status
    client = mlflow_client(tracking_uri)
    fix = "give --tracking-uri (or LMYARD_TRACKING__URI) the MLflow server the lineage was recorded on"
    with tracking_errors(tracking_uri, f"lineage {run_name}'s MLflow run {row.mlflow_run_id}", fix):
        run = client.get_run(row.mlflow_run_id)
        history = client.get_metric_history(row.mlflow_run_id, schema.EVAL_LOSS)
        versions = client.search_model_versions(f"run_id = '{row.mlflow_run_id}'")
        last = max(history, key=lambda m: m.step) if history else None
        rows = _evaluation_rows(client, row.mlflow_run_id, last.step) if last else {}
    status.mlflow_status = run.info.status
    status.mlflow_run_url = _run_url(tracking_uri, run.info.experiment_id, row.mlflow_run_id)
    status.attempts = _attempts(run.data.tags)
    status.last_evaluation = LastEvaluation(step=last.step, val_loss=last.value, rows=rows) if last else None
    status.registered_versions = [
        ModelVersion(
            name=v.name, version=str(v.version), aliases=list(v.aliases or []), uri=f"models:/{v.name}/{v.version}"
        )
        for v in sorted(versions, key=lambda v: int(v.version))
    ]
    return status
